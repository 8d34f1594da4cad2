"""Token-load scorer and imbalance filter: accounting at dispatch / completion (idempotent, swept,
bounded), P/D charges, score formula, the imbalance guard, and a seeded hot-prefix run."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from pydantic import ValidationError

from kvgate.middleware.framework.errors import ConfigError
from kvgate.middleware.framework.plugin import Plugin, Scorer
from kvgate.middleware.framework.scheduler import Profile, Scheduler, WeightedScorer
from kvgate.middleware.framework.types import (
    CycleState,
    Endpoint,
    EndpointId,
    InferenceRequest,
    Outcome,
    OutcomeKind,
    RoutingDecision,
)
from kvgate.plugins.common.state import PREFIX_MATCH, TOKEN_IDS, PrefixMatch
from kvgate.plugins.load.loads import Charge, EngineLoad, LoadTracker
from kvgate.plugins.load.token_load import (
    TokenImbalanceFilter,
    TokenLoadScorer,
    expected_output_tokens,
    uncached_tokens,
)
from tests.unit.middleware.fakes import Best
from tests.unit.routing_load.helpers import (
    FakeClock,
    Lookup,
    ep,
    fleet,
    imbalance_filter,
    load_scorer,
    req,
)


def _match(prompt: int, device: dict[str, int], other: dict[str, int] | None = None
           ) -> PrefixMatch:
    return PrefixMatch(prompt_tokens=prompt, device=device, other=other or {}, precise=True)


def _done(kind: OutcomeKind = OutcomeKind.DONE) -> Outcome:
    return Outcome(kind=kind, status=200)


async def _dispatch(scorer: TokenLoadScorer, r: InferenceRequest, target: str,
                    prefill: str | None = None, state: CycleState | None = None) -> CycleState:
    state = state or CycleState()
    decision = RoutingDecision(target=ep(target),
                               prefill=None if prefill is None else ep(prefill))
    await scorer.before_dispatch(r, state, decision)
    return state


# -- pure helpers ------------------------------------------------------------------------------

OUTPUTS = [
    ("no limit: default", {}, 256),
    ("max_tokens", {"max_tokens": 100}, 100),
    ("max_completion_tokens wins", {"max_tokens": 100, "max_completion_tokens": 50}, 50),
    ("capped", {"max_tokens": 100000}, 4096),
    ("n choices", {"max_tokens": 10, "n": 3}, 30),
    ("n absent or 0", {"max_tokens": 10, "n": 0}, 10),
    ("bool is not an int", {"max_tokens": True}, 256),
    ("zero", {"max_tokens": 0}, 0),
    ("invalid max_completion_tokens: max_tokens", {"max_completion_tokens": "5", "max_tokens": 7},
     7),
    ("negative: default", {"max_tokens": -1}, 256),
    ("invalid n: one choice", {"max_tokens": 10, "n": "3"}, 10),
    ("null fields: default", {"max_tokens": None, "max_completion_tokens": None, "n": None}, 256),
]


@pytest.mark.parametrize(("case", "body", "expected"), OUTPUTS, ids=[c[0] for c in OUTPUTS])
def test_expected_output_tokens(case: str, body: dict[str, Any], expected: int) -> None:
    assert expected_output_tokens(body, default=256, cap=4096) == expected


UNCACHED = [
    ("no match data: whole prompt", 1000, None, "e0", 1000),
    ("device hit", 1000, _match(1000, {"e0": 600}), "e0", 400),
    ("other tier counts too", 1000, _match(1000, {"e0": 600}, {"e0": 200}), "e0", 200),
    ("other engine", 1000, _match(1000, {"e0": 600}), "e1", 1000),
    ("never negative", 100, _match(100, {"e0": 160}), "e0", 0),
]


@pytest.mark.parametrize(("case", "prompt", "match", "endpoint", "expected"), UNCACHED,
                         ids=[c[0] for c in UNCACHED])
def test_uncached_tokens(case: str, prompt: int, match: PrefixMatch | None, endpoint: str,
                         expected: int) -> None:
    assert uncached_tokens(prompt, match, endpoint) == expected


# -- accounting --------------------------------------------------------------------------------

#: (case, estimate, token ids, prefix match, body, target, prefill, expected loads)
CHARGES: list[tuple[str, int, int | None, PrefixMatch | None, dict[str, Any], str, str | None,
                    dict[str, EngineLoad]]] = [
    ("estimate, no match", 500, None, None, {"max_tokens": 20}, "e0", None,
     {"e0": EngineLoad(500, 20, 1)}),
    ("token ids beat the estimate", 500, 800, None, {"max_tokens": 20}, "e0", None,
     {"e0": EngineLoad(800, 20, 1)}),
    ("prefix match removes cached part", 500, 800, _match(800, {"e0": 512}), {}, "e0", None,
     {"e0": EngineLoad(288, 256, 1)}),
    ("match for another engine does not help", 500, 800, _match(800, {"e1": 512}), {}, "e0",
     None, {"e0": EngineLoad(800, 256, 1)}),
    ("match's prompt size without token ids", 500, None, _match(640, {"e0": 512}), {}, "e0",
     None, {"e0": EngineLoad(128, 256, 1)}),
    ("P/D: prefill on prefill engine, decode on target", 500, 800,
     _match(800, {"p0": 256, "d0": 800}), {"max_tokens": 64}, "d0", "p0",
     {"p0": EngineLoad(544, 0, 1), "d0": EngineLoad(0, 64, 1)}),
]


@pytest.mark.parametrize(("case", "estimate", "ids", "match", "body", "target", "prefill",
                          "expected"), CHARGES, ids=[c[0] for c in CHARGES])
async def test_dispatch_charges_and_every_outcome_releases(
    case: str, estimate: int, ids: int | None, match: PrefixMatch | None, body: dict[str, Any],
    target: str, prefill: str | None, expected: dict[str, EngineLoad],
) -> None:
    for kind in OutcomeKind:
        scorer = load_scorer()
        state = CycleState()
        if ids is not None:
            state.put(TOKEN_IDS, tuple(range(ids)))
        if match is not None:
            state.put(PREFIX_MATCH, match)
        r = req(body=body, estimate=estimate)
        await _dispatch(scorer, r, target, prefill, state)
        for name, load in expected.items():
            assert scorer.tracker.load(name) == load
        await scorer.on_complete(r, state, ep(target), _done(kind))
        for name in expected:
            assert scorer.tracker.load(name) == EngineLoad()
        assert len(scorer.tracker) == 0


async def test_release_is_idempotent() -> None:
    scorer = load_scorer()
    r1, r2 = req(rid="a", estimate=100), req(rid="b", estimate=300)
    s1 = await _dispatch(scorer, r1, "e0")
    await _dispatch(scorer, r2, "e0")
    for _ in range(3):
        await scorer.on_complete(r1, s1, ep("e0"), _done())
    assert scorer.tracker.load("e0") == EngineLoad(300, 256, 1)
    assert scorer.tracker.stats.released == 1
    assert scorer.tracker.stats.repeated_releases == 2


async def test_same_client_request_id_does_not_cross_release() -> None:
    scorer = load_scorer()
    a, b = req(rid="dup", estimate=100), req(rid="dup", estimate=1000)
    sa = await _dispatch(scorer, a, "e0")
    sb = await _dispatch(scorer, b, "e1")
    await scorer.on_complete(a, sa, ep("e0"), _done())
    assert scorer.tracker.load("e0") == EngineLoad()
    assert scorer.tracker.load("e1") == EngineLoad(1000, 256, 1)
    await scorer.on_complete(b, sb, ep("e1"), _done())
    assert len(scorer.tracker) == 0


async def test_retry_moves_the_charge() -> None:
    scorer = load_scorer()
    r = req(estimate=400)
    state = await _dispatch(scorer, r, "e0")
    await scorer.on_complete(r, state, ep("e0"),
                             Outcome(OutcomeKind.UPSTREAM_ERROR, 502, will_retry=True))
    await _dispatch(scorer, r, "e1", state=state)
    assert scorer.tracker.load("e0") == EngineLoad()
    assert scorer.tracker.load("e1") == EngineLoad(400, 256, 1)
    await scorer.on_complete(r, state, ep("e1"), _done())
    assert len(scorer.tracker) == 0


async def test_redispatch_without_completion_releases_the_first() -> None:
    scorer = load_scorer()
    r = req(estimate=400)
    state = await _dispatch(scorer, r, "e0")
    await _dispatch(scorer, r, "e1", state=state)  # completion never ran for the first
    assert scorer.tracker.load("e0") == EngineLoad()
    assert scorer.tracker.load("e1").requests == 1


async def test_stale_entries_are_swept() -> None:
    scorer = load_scorer(max_age_s=60)
    clock = FakeClock()
    scorer.clock = clock
    for i in range(3):  # leaked: no completion will ever come
        await _dispatch(scorer, req(rid=f"leak{i}", estimate=100), "e0")
        clock.now += 10
    clock.now += 35  # the first is 65 s old, the second 55 s, the third 45 s
    live = req(rid="live", estimate=50)
    state = await _dispatch(scorer, live, "e1")
    assert scorer.tracker.stats.swept == 1
    assert scorer.tracker.load("e0") == EngineLoad(200, 512, 2)
    clock.now += 30
    await scorer.on_complete(live, state, ep("e1"), _done())
    assert scorer.tracker.stats.swept == 3
    assert len(scorer.tracker) == 0
    assert scorer.tracker.load("e0") == EngineLoad()


def test_tracker_is_bounded() -> None:
    tracker = LoadTracker(max_entries=3, max_age_s=1e9)
    for i in range(5):
        tracker.charge(f"r{i}", [Charge("e0", 10 * (i + 1), 1)], now=float(i))
    assert len(tracker) == 3
    assert tracker.stats.evicted == 2
    assert tracker.load("e0") == EngineLoad(30 + 40 + 50, 3, 3)


async def test_removed_engine_is_forgotten() -> None:
    scorer = load_scorer()
    r = req(estimate=100)
    state = await _dispatch(scorer, r, "e0")
    scorer.on_endpoints_changed([], [ep("e0")])
    assert scorer.tracker.load("e0") == EngineLoad()
    scorer.on_endpoints_changed([ep("e0")], [])
    await scorer.on_complete(r, state, ep("e0"), _done())
    assert scorer.tracker.load("e0") == EngineLoad()  # clamped at 0, not negative


# -- scoring -----------------------------------------------------------------------------------

#: (case, in-flight (prefill, decode) per engine, prompt, match, params, expected scores)
SCORES: list[tuple[str, dict[str, tuple[int, int]], int, PrefixMatch | None, dict[str, Any],
                   dict[str, float]]] = [
    ("idle fleet, small prompt", {}, 1024, None, {},
     {"e0": 1 - 1024 / 32768, "e1": 1 - 1024 / 32768}),
    ("below saturation: linear", {"e0": (8192, 0)}, 0, None, {},
     {"e0": 0.75, "e1": 1.0}),
    ("decode weighted", {"e0": (0, 2048)}, 0, None, {},
     {"e0": 0.75, "e1": 1.0}),
    ("decode weight param", {"e0": (0, 2048)}, 0, None, {"decode_token_weight": 1.0},
     {"e0": 1 - 2048 / 32768, "e1": 1.0}),
    ("above saturation: relative to the max", {"e0": (60000, 0), "e1": (20000, 0)}, 0, None, {},
     {"e0": 0.0, "e1": 1 - 20000 / 60000}),
    ("own uncached tokens count", {"e0": (20000, 0), "e1": (4000, 0)}, 20000,
     _match(20000, {"e0": 19000}), {},
     {"e0": 1 - 21000 / 32768, "e1": 1 - 24000 / 32768}),
    ("saturation param", {"e0": (1000, 0)}, 0, None, {"saturation_tokens": 2000},
     {"e0": 0.5, "e1": 1.0}),
]


@pytest.mark.parametrize(("case", "loads", "prompt", "match", "params", "expected"), SCORES,
                         ids=[c[0] for c in SCORES])
def test_scores(case: str, loads: dict[str, tuple[int, int]], prompt: int,
                match: PrefixMatch | None, params: dict[str, Any],
                expected: dict[str, float]) -> None:
    scorer = load_scorer(**params)
    for name, (prefill, decode) in loads.items():
        scorer.tracker.charge("x", [Charge(name, prefill, decode)], now=0.0)
    state = CycleState()
    if match is not None:
        state.put(PREFIX_MATCH, match)
    scores = scorer.score(req(estimate=prompt), state, fleet(2))
    assert scores == pytest.approx(expected)


def test_params_validation() -> None:
    for params in ({"decode_token_weight": -1}, {"saturation_tokens": 0}, {"bogus": 1},
                   {"max_entries": 0}):
        with pytest.raises(ValidationError):
            TokenLoadScorer.Params.model_validate(params)
    for bad in ({"max_imbalance": 0.9}, {"measure": "requests"}, {"slack_tokens": -1}):
        with pytest.raises(ValidationError):
            TokenImbalanceFilter.Params.model_validate(bad)
    TokenLoadScorer.Params.model_validate(TokenLoadScorer.example_params)
    TokenImbalanceFilter.Params.model_validate(TokenImbalanceFilter.example_params)


# -- imbalance guard ---------------------------------------------------------------------------

#: (case, (prefill, decode) per engine e0..e3, params, kept engines)
GUARD: list[tuple[str, list[tuple[int, int]], dict[str, Any], set[str]]] = [
    ("idle: all kept", [(0, 0)] * 4, {}, {"e0", "e1", "e2", "e3"}),
    ("one request on an idle fleet: slack", [(4000, 0), (0, 0), (0, 0), (0, 0)], {},
     {"e0", "e1", "e2", "e3"}),
    ("hot engine dropped", [(20000, 0), (2000, 0), (2000, 0), (0, 0)], {},
     {"e1", "e2", "e3"}),  # mean 6000, bound 11596
    ("balanced high load kept", [(40000, 0), (36000, 0), (38000, 0), (35000, 0)], {},
     {"e0", "e1", "e2", "e3"}),
    ("decode counts in total", [(0, 4000), (0, 0), (0, 0), (0, 0)], {},
     {"e1", "e2", "e3"}),  # total 16000, mean 4000, bound 9096
    ("decode ignored in prefill mode", [(0, 4000), (0, 0), (0, 0), (0, 0)],
     {"measure": "prefill"}, {"e0", "e1", "e2", "e3"}),
    ("strict bound keeps the least loaded", [(300, 0), (200, 0), (100, 0), (100, 0)],
     {"max_imbalance": 1.0, "slack_tokens": 0}, {"e2", "e3"}),
]


@pytest.mark.parametrize(("case", "loads", "params", "kept"), GUARD, ids=[c[0] for c in GUARD])
def test_imbalance_guard(case: str, loads: list[tuple[int, int]], params: dict[str, Any],
                         kept: set[str]) -> None:
    scorer = load_scorer()
    for i, (prefill, decode) in enumerate(loads):
        scorer.tracker.charge("x", [Charge(f"e{i}", prefill, decode)], now=0.0)
    guard = imbalance_filter(scorer, **params)
    out = guard.filter(req(), CycleState(), fleet(4))
    assert {e.id for e in out} == kept


def test_guard_never_empties_random_loads() -> None:
    rng = random.Random(11)
    for _ in range(500):
        scorer = load_scorer()
        n = rng.randint(1, 8)
        for i in range(n):
            scorer.tracker.charge("x", [Charge(f"e{i}", rng.randint(0, 10**6),
                                               rng.randint(0, 10**4))], now=0.0)
        guard = imbalance_filter(scorer, max_imbalance=1.0, slack_tokens=0)
        assert guard.filter(req(), CycleState(), fleet(n))


def test_guard_needs_a_token_load_scorer() -> None:
    params = TokenImbalanceFilter.Params(load_scorer="other")
    with pytest.raises(ConfigError):
        TokenImbalanceFilter("g", params, Lookup({"other": object()}))


# -- a hot shared prefix through the scheduler -------------------------------------------------


class PrefixFraction(Plugin, Scorer):
    """Test stand-in for the prefix-cache scorer: matched / prompt tokens."""

    type_name = "test-prefix"

    def score(self, req: InferenceRequest, state: CycleState, eps: Sequence[Endpoint]
              ) -> Mapping[EndpointId, float]:
        match = state.require(PREFIX_MATCH)
        return {e.id: match.device.get(e.id, 0) / match.prompt_tokens for e in eps}


def _scheduler(scorer: TokenLoadScorer, guard: TokenImbalanceFilter | None) -> Scheduler:
    prefix = PrefixFraction("prefix", PrefixFraction.Params(), Lookup())
    best = Best("best", Best.Params(), Lookup())
    filters = () if guard is None else (("guard", guard),)
    profile = Profile("p", filters, (WeightedScorer("prefix", prefix, 3.0),
                                     WeightedScorer("load", scorer, 2.0)), best)
    return Scheduler({"p": profile}, None, seed=0)


async def _hot_prefix_run(with_guard: bool) -> tuple[dict[str, int], float]:
    """400 requests share a 7,680-token prefix cached on e0 only (8k prompts); 24 stay in
    flight, a seeded random one completing per arrival. Returns requests per engine and the
    worst (chosen engine's load) / (guard bound) seen at a decision."""
    rng = random.Random(5)
    scorer = load_scorer()
    guard = imbalance_filter(scorer) if with_guard else None
    scheduler = _scheduler(scorer, guard)
    eps = fleet(4)
    in_flight: list[tuple[InferenceRequest, CycleState, Endpoint]] = []
    counts = dict.fromkeys((e.id for e in eps), 0)
    worst = 0.0
    for i in range(400):
        r = req(rid=f"r{i}", estimate=8192, body={"max_tokens": 128})
        state = CycleState()
        state.put(PREFIX_MATCH, _match(8192, {"e0": 7680}))
        loads = {e.id: scorer.work(e.id) for e in eps}
        assert scorer.works([e.id for e in eps]) == loads  # the placement scorer's batch read
        bound = 1.25 * sum(loads.values()) / len(loads) + 4096
        decision = scheduler.schedule(r, state, eps)
        worst = max(worst, loads[decision.target.id] / bound)
        counts[decision.target.id] += 1
        await scorer.before_dispatch(r, state, decision)
        in_flight.append((r, state, decision.target))
        rng.shuffle(in_flight)
        while len(in_flight) > 24:
            done_r, done_state, target = in_flight.pop()
            await scorer.on_complete(done_r, done_state, target, _done())
    return counts, worst


async def test_hot_prefix_cannot_take_every_request() -> None:
    counts, worst = await _hot_prefix_run(with_guard=False)
    assert counts["e0"] == 400  # the prefix pulls the whole stream onto e0
    assert worst > 1.0  # past the bound the guard would enforce

    counts, worst = await _hot_prefix_run(with_guard=True)
    assert all(counts[e] > 0 for e in counts)  # spill-over reached every engine
    assert counts["e0"] < 400
    assert worst <= 1.0  # never dispatched to an engine over max_imbalance * mean + slack
