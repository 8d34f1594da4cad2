"""Scheduler: filters, weighted and clamped scores, picker order, profile handler rounds."""

from __future__ import annotations

import time
from typing import Any

import pytest

from kvgate.engines.vllm import VllmAdapter
from kvgate.middleware.framework.composition.config import parse_config
from kvgate.middleware.framework.composition.pipeline import build_pipeline
from kvgate.middleware.framework.errors import NoEndpointAvailable
from kvgate.middleware.framework.scheduler import Scheduler
from kvgate.middleware.framework.types import Api, CycleState, Endpoint, InferenceRequest
from tests.unit.middleware.fakes import registry

EPS = [Endpoint(id=f"e{i}", url=f"http://e{i}", kind="vllm") for i in range(3)]


def _req() -> InferenceRequest:
    return InferenceRequest(
        request_id="r", api=Api.CHAT, model="m", body={}, headers={}, stream=False,
        client_wants_usage=False, prompt_token_estimate=1, received_at=time.monotonic(),
    )


def _scheduler(scorers: list[tuple[dict[str, float], float]], flt: str = "keep-all") -> Scheduler:
    plugins: list[dict[str, Any]] = [{"type": flt}, {"type": "best"}]
    refs: list[dict[str, Any]] = [{"ref": flt}]
    for i, (scores, weight) in enumerate(scorers):
        plugins.append({"type": "fixed-scorer", "name": f"s{i}", "params": {"scores": scores}})
        refs.append({"ref": f"s{i}", "weight": weight})
    refs.append({"ref": "best"})
    data = {"plugins": plugins, "profiles": [{"name": "p", "plugins": refs}]}
    return build_pipeline(parse_config(data, "t"), registry(VllmAdapter)).scheduler


CASES = [
    ("no scorers: id order", [], ["e0", "e1", "e2"]),
    ("one scorer", [({"e2": 0.9, "e1": 0.5}, 1.0)], ["e2", "e1", "e0"]),
    ("weights decide", [({"e0": 1.0}, 1.0), ({"e1": 1.0}, 3.0)], ["e1", "e0", "e2"]),
    ("clamped above 1", [({"e0": 50.0, "e1": 1.0}, 1.0), ({"e1": 0.5}, 1.0)], ["e1", "e0", "e2"]),
    ("clamped below 0", [({"e0": -5.0}, 1.0)], ["e0", "e1", "e2"]),
    ("nan is 0", [({"e0": float("nan"), "e1": 0.1}, 1.0)], ["e1", "e0", "e2"]),
    ("unknown ids ignored", [({"zz": 1.0, "e2": 0.2}, 1.0)], ["e2", "e0", "e1"]),
    ("zero weight", [({"e2": 1.0}, 0.0)], ["e0", "e1", "e2"]),
]


@pytest.mark.parametrize(("case", "scorers", "order"), CASES, ids=[c[0] for c in CASES])
def test_weighted_scoring(case: str, scorers: list[tuple[dict[str, float], float]],
                          order: list[str]) -> None:
    decision = _scheduler(scorers).schedule(_req(), CycleState(), EPS)
    assert [decision.target.id, *(e.id for e in decision.alternates)] == order


def test_filter_leaving_nothing_is_503() -> None:
    with pytest.raises(NoEndpointAvailable) as info:
        _scheduler([], flt="drop-all").schedule(_req(), CycleState(), EPS)
    assert info.value.status == 503
    assert "drop-all" in info.value.message


def test_empty_candidates_is_503() -> None:
    with pytest.raises(NoEndpointAvailable):
        _scheduler([]).schedule(_req(), CycleState(), [])


def test_profile_handler_runs_each_profile() -> None:
    data = {
        "plugins": [{"type": "keep-all"}, {"type": "best"}, {"type": "two-profiles"},
                    {"type": "fixed-scorer", "name": "d", "params": {"scores": {"e1": 1}}},
                    {"type": "fixed-scorer", "name": "p", "params": {"scores": {"e2": 1}}}],
        "profiles": [
            {"name": "decode", "plugins": [{"ref": "keep-all"}, {"ref": "d"}, {"ref": "best"}]},
            {"name": "prefill", "plugins": [{"ref": "p"}, {"ref": "best"}]},
        ],
        "profile_handler": "two-profiles",
    }
    scheduler = build_pipeline(parse_config(data, "t"), registry(VllmAdapter)).scheduler
    decision = scheduler.schedule(_req(), CycleState(), EPS)
    assert decision.target.id == "e1"
    assert decision.prefill is not None and decision.prefill.id == "e2"
    assert set(decision.profiles) == {"decode", "prefill"}
