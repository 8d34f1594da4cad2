"""Basic filters, scorers and pickers: table-driven."""

from __future__ import annotations

import random
import time
from collections import Counter
from typing import Any

import pytest

from kvgate.middleware.framework.errors import NoEndpointAvailable
from kvgate.middleware.framework.plugin import Plugin
from kvgate.middleware.framework.types import (
    Api,
    CycleState,
    Endpoint,
    InferenceRequest,
    Role,
    ScoredEndpoint,
)
from kvgate.plugins.basic.filters import HealthFilter, ModelFilter, RoleFilter
from kvgate.plugins.basic.pickers import MaxScorePicker, RoundRobinPicker, WeightedRandomPicker
from kvgate.plugins.basic.scorers import LeastInFlightScorer
from tests.plugin_helpers import make_plugin


def _ep(i: int, **kw: Any) -> Endpoint:
    return Endpoint(id=f"e{i}", url=f"http://e{i}", kind="vllm", **kw)


def _req(model: str = "m") -> InferenceRequest:
    return InferenceRequest(
        request_id="r", api=Api.CHAT, model=model, body={}, headers={}, stream=False,
        client_wants_usage=False, prompt_token_estimate=1, received_at=time.monotonic(),
    )


FILTER_CASES = [
    ("health keeps healthy", HealthFilter, {}, [_ep(0), _ep(1, healthy=False)], ["e0"]),
    ("health none", HealthFilter, {}, [_ep(0, healthy=False)], []),
    ("health empty", HealthFilter, {}, [], []),
    ("model match", ModelFilter, {}, [_ep(0, models=frozenset({"m"})),
                                      _ep(1, models=frozenset({"x"}))], ["e0"]),
    ("model unknown kept", ModelFilter, {}, [_ep(0), _ep(1, models=frozenset({"x"}))], ["e0"]),
    ("model unknown dropped", ModelFilter, {"keep_unknown": False},
     [_ep(0), _ep(1, models=frozenset({"m"}))], ["e1"]),
    ("role decode + both", RoleFilter, {"role": "decode"},
     [_ep(0, role=Role.PREFILL), _ep(1, role=Role.DECODE), _ep(2)], ["e1", "e2"]),
    ("role decode only", RoleFilter, {"role": "decode", "include_both": False},
     [_ep(0, role=Role.PREFILL), _ep(1, role=Role.DECODE), _ep(2)], ["e1"]),
    ("role prefill", RoleFilter, {"role": "prefill"},
     [_ep(0, role=Role.PREFILL), _ep(1, role=Role.DECODE)], ["e0"]),
]


@pytest.mark.parametrize(("case", "cls", "params", "eps", "kept"), FILTER_CASES,
                         ids=[c[0] for c in FILTER_CASES])
def test_filters(case: str, cls: type[Plugin], params: dict[str, Any], eps: list[Endpoint],
                 kept: list[str]) -> None:
    out = make_plugin(cls, **params).filter(_req(), CycleState(), eps)
    assert [ep.id for ep in out] == kept


SCORER_CASES = [
    ("idle all 1", {}, [(0, 0), (0, 0)], {"e0": 1.0, "e1": 1.0}),
    ("by requests", {}, [(4, 0), (1, 0), (0, 0)], {"e0": 0.0, "e1": 0.75, "e2": 1.0}),
    ("equal busy", {}, [(3, 0), (3, 0)], {"e0": 0.0, "e1": 0.0}),
    ("by tokens", {"by": "tokens"}, [(1, 1000), (5, 250)], {"e0": 0.0, "e1": 0.75}),
]


@pytest.mark.parametrize(("case", "params", "loads", "expected"), SCORER_CASES,
                         ids=[c[0] for c in SCORER_CASES])
def test_least_in_flight(case: str, params: dict[str, Any], loads: list[tuple[int, int]],
                         expected: dict[str, float]) -> None:
    eps = [_ep(i, in_flight_requests=r, in_flight_tokens=t) for i, (r, t) in enumerate(loads)]
    scores = make_plugin(LeastInFlightScorer, **params).score(_req(), CycleState(), eps)
    assert scores == pytest.approx(expected)


def _scored(*scores: float) -> list[ScoredEndpoint]:
    return [ScoredEndpoint(_ep(i), s) for i, s in enumerate(scores)]


@pytest.mark.parametrize("cls", [MaxScorePicker, WeightedRandomPicker, RoundRobinPicker])
def test_pickers_reject_empty(cls: type[Plugin]) -> None:
    with pytest.raises(NoEndpointAvailable):
        make_plugin(cls).pick(CycleState(), [], random.Random(0))


@pytest.mark.parametrize(("scores", "first"), [((0.1, 0.9, 0.5), "e1"), ((2.0, 1.0), "e0")])
def test_max_score_order(scores: tuple[float, ...], first: str) -> None:
    result = make_plugin(MaxScorePicker).pick(CycleState(), _scored(*scores), random.Random(0))
    assert result.target.id == first
    got = [ep.id for ep in result.endpoints]
    assert got == sorted(got, key=lambda i: -scores[int(i[1:])])


def test_max_score_ties_are_seeded_and_spread() -> None:
    picker = make_plugin(MaxScorePicker)
    picks = [picker.pick(CycleState(), _scored(1, 1, 1), random.Random(s)).target.id
             for s in range(300)]
    again = [picker.pick(CycleState(), _scored(1, 1, 1), random.Random(s)).target.id
             for s in range(300)]
    assert picks == again
    assert all(n > 60 for n in Counter(picks).values())


def test_weighted_random_follows_weights() -> None:
    picker, rng = make_plugin(WeightedRandomPicker), random.Random(42)
    counts = Counter(picker.pick(CycleState(), _scored(1, 3, 0), rng).target.id
                     for _ in range(4000))
    assert counts["e2"] == 0  # zero score: only a fallback
    assert counts["e1"] / 4000 == pytest.approx(0.75, abs=0.03)


def test_weighted_random_all_zero_is_uniform_permutation() -> None:
    picker, rng = make_plugin(WeightedRandomPicker), random.Random(1)
    results = [picker.pick(CycleState(), _scored(0, 0, 0), rng) for _ in range(900)]
    assert all(sorted(ep.id for ep in r.endpoints) == ["e0", "e1", "e2"] for r in results)
    assert all(n > 220 for n in Counter(r.target.id for r in results).values())


def test_round_robin_rotates_fairly() -> None:
    picker = make_plugin(RoundRobinPicker)
    firsts = [picker.pick(CycleState(), list(reversed(_scored(9, 0, 5))), random.Random(0))
              .target.id for _ in range(6)]
    assert firsts == ["e0", "e1", "e2", "e0", "e1", "e2"]
