"""The decode-first P/D profile handler, run by the real scheduler with real filters/pickers."""

from __future__ import annotations

import time

import pytest

from kvgate.middleware.framework.errors import NoEndpointAvailable
from kvgate.middleware.framework.scheduler import Profile, Scheduler, WeightedScorer
from kvgate.middleware.framework.types import Api, CycleState, Endpoint, InferenceRequest, Role
from kvgate.plugins.basic.filters import HealthFilter, RoleFilter
from kvgate.plugins.basic.pickers import MaxScorePicker
from kvgate.plugins.basic.scorers import LeastInFlightScorer
from kvgate.plugins.common.state import PREFIX_MATCH, TOKEN_IDS, PrefixMatch
from kvgate.plugins.pd.profile_handler import PdProfileHandler, prefill_pays
from tests.plugin_helpers import make_plugin


def _req(estimate: int = 10) -> InferenceRequest:
    return InferenceRequest(
        request_id="r", api=Api.CHAT, model="m", body={}, headers={}, stream=False,
        client_wants_usage=False, prompt_token_estimate=estimate, received_at=time.monotonic(),
    )


def _scheduler(min_uncached: int = 256) -> Scheduler:
    health = make_plugin(HealthFilter)
    picker = make_plugin(MaxScorePicker)
    load = WeightedScorer("load", make_plugin(LeastInFlightScorer), 1.0)
    profiles = {
        "decode": Profile("decode", (("h", health), ("r", make_plugin(RoleFilter, role="decode"))),
                          (load,), picker),
        "prefill": Profile("prefill", (("h", health), ("r", make_plugin(RoleFilter, role="prefill"))),
                           (load,), picker),
    }
    handler = make_plugin(PdProfileHandler, min_uncached_tokens=min_uncached)
    return Scheduler(profiles, handler, seed=1)


P0 = Endpoint("p0", "http://p0", "vllm", role=Role.PREFILL)
P1 = Endpoint("p1", "http://p1", "vllm", role=Role.PREFILL, in_flight_requests=3)
D0 = Endpoint("d0", "http://d0", "vllm", role=Role.DECODE, in_flight_requests=2)
D1 = Endpoint("d1", "http://d1", "vllm", role=Role.DECODE)
SICK_P = Endpoint("p2", "http://p2", "vllm", role=Role.PREFILL, healthy=False)


def _match(prompt: int, held: dict[str, int], other: dict[str, int] | None = None) -> PrefixMatch:
    return PrefixMatch(prompt, held, other or {}, precise=True)


CASES: list[tuple[str, list[Endpoint], int, int | None, PrefixMatch | None, str, str | None]] = [
    # (case, endpoints, prompt tokens (token ids), estimate, match, decode, prefill)
    ("long cold prompt: two hops", [P0, P1, D0, D1], 1000, None, None, "d1", "p0"),
    ("short prompt stays local", [P0, D1], 100, None, None, "d1", None),
    ("threshold is inclusive", [P0, D1], 256, None, None, "d1", "p0"),
    ("decode holds the prefix", [P0, D1], 1000, None, _match(1000, {"d1": 900}), "d1", None),
    ("slower tier counts as held", [P0, D1], 1000, None,
     _match(1000, {"d1": 500}, {"d1": 400}), "d1", None),
    ("prefix held elsewhere only", [P0, D1], 1000, None, _match(1000, {"p0": 992}), "d1", "p0"),
    ("no token ids: estimate", [P0, D1], 0, 4000, None, "d1", "p0"),
    ("no healthy prefill: local", [SICK_P, D0], 4000, None, None, "d0", None),
    ("both-role engine may prefill", [Endpoint("b", "http://b", "vllm"), D1], 4000, None, None,
     "b", None),
]


@pytest.mark.parametrize(("case", "eps", "prompt", "estimate", "match", "decode", "prefill"),
                         CASES, ids=[c[0] for c in CASES])
def test_decode_first_decisions(case: str, eps: list[Endpoint], prompt: int,
                                estimate: int | None, match: PrefixMatch | None, decode: str,
                                prefill: str | None) -> None:
    state = CycleState()
    if prompt:
        state.put(TOKEN_IDS, tuple(range(prompt)))
    if match is not None:
        state.put(PREFIX_MATCH, match)
    decision = _scheduler().schedule(_req(estimate or 10), state, eps)
    assert decision.target.id == decode
    assert (decision.prefill.id if decision.prefill else None) == prefill
    assert "decode" in decision.profiles


def test_alternates_are_other_decode_engines() -> None:
    d2 = Endpoint("d2", "http://d2", "vllm", role=Role.DECODE, in_flight_requests=5)
    state = CycleState()
    decision = _scheduler().schedule(_req(5000), state, [P0, D0, D1, d2])
    assert [e.id for e in decision.alternates] == ["d0", "d2"]


def test_no_decode_engine_is_503() -> None:
    with pytest.raises(NoEndpointAvailable):
        _scheduler().schedule(_req(5000), CycleState(), [P0, P1])


@pytest.mark.parametrize(("threshold", "uncached", "pays"),
                         [(256, 255, False), (256, 256, True), (0, 0, True), (1024, 1000, False)])
def test_decider_threshold(threshold: int, uncached: int, pays: bool) -> None:
    state = CycleState()
    state.put(TOKEN_IDS, tuple(range(2000)))
    state.put(PREFIX_MATCH, _match(2000, {"d1": 2000 - uncached}))
    assert prefill_pays(_req(), state, D1, threshold) is pays
