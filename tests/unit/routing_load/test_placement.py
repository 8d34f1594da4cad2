"""kv-placement-scorer: costs per engine, stickiness until saturated, capacity from metrics,
insertion ledger decay, session pins, metrics."""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvgate.middleware.framework.types import CycleState, Endpoint, EngineMetrics, RoutingDecision
from kvgate.plugins.common.state import PREFIX_MATCH, SESSION_KEY, TOKEN_IDS, PrefixMatch
from kvgate.plugins.placement.insertion_ledger import InsertionLedger, SessionInsertions
from kvgate.plugins.placement.scorer import KvPlacementScorer
from kvgate.plugins.placement.state import PLACEMENT
from tests.unit.routing_load.helpers import Lookup, ep, load_scorer, req

CAP = 10_000  # tokens per engine in these tests


def scorer(**params: Any) -> KvPlacementScorer:
    params.setdefault("default_capacity_tokens", CAP)
    p = KvPlacementScorer.Params.model_validate(params)
    return KvPlacementScorer("kv-placement-scorer", p, Lookup())


def state_for(prompt: int, held: dict[str, int] | None = None,
              session: str | None = None, other: dict[str, int] | None = None) -> CycleState:
    state = CycleState()
    state.put(TOKEN_IDS, tuple(range(prompt)))
    if held is not None:
        state.put(PREFIX_MATCH, PrefixMatch(prompt, held, other or {}, True))
    if session is not None:
        state.put(SESSION_KEY, session)
    return state


def best(s: KvPlacementScorer, state: CycleState, eps: list[Endpoint]) -> str:
    scores = s.score(req(), state, eps)
    return max(scores, key=lambda e: scores[e])


# (case, inserted-so-far per engine, prompt, held per engine, expected engine)
CASES = [
    ("a prefix every engine holds does not decide: cold goes to the least rewritten cache",
     {"e0": 3000, "e1": 500}, 4000, {"e0": 2000, "e1": 2000}, "e1"),
    ("the first engine to cache a shared prompt does not attract new sessions",
     {"e0": 2500, "e1": 0}, 4000, {"e0": 2000, "e1": 0}, "e1"),
    ("a session stays where its prefix lives while its cache's recent insertions exceed the "
     "slowest's by < floor x held beyond / new (0.15 of a cache here)",
     {"e0": 2000, "e1": 1000}, 6000, {"e0": 5000, "e1": 2000}, "e0"),
    ("... and moves once they exceed it by more (0.7 of a cache here)",
     {"e0": 8000, "e1": 1000}, 6000, {"e0": 5000, "e1": 2000}, "e1"),
    ("no match data: pressure alone", {"e0": 100, "e1": 50}, 1000, None, "e1"),
]


@pytest.mark.parametrize(("case", "inserted", "prompt", "held", "expected"), CASES,
                         ids=[c[0] for c in CASES])
def test_placement_decisions(case: str, inserted: dict[str, int], prompt: int,
                             held: dict[str, int] | None, expected: str) -> None:
    s = scorer(half_life_caches=1e9)  # no decay inside one table row
    eps = [ep("e0"), ep("e1")]
    s.score(req(), state_for(1), eps)  # learn the capacities
    for engine, tokens in inserted.items():
        s.ledger.add(engine, tokens, 1e12)
    assert best(s, state_for(prompt, held), eps) == expected, case


def test_costs_are_tokens_of_recompute_queue_and_pressure() -> None:
    load = load_scorer()
    p = KvPlacementScorer.Params.model_validate(
        {"default_capacity_tokens": CAP, "load": "token-load-scorer", "half_life_caches": 1e9})
    s = KvPlacementScorer("kv-placement-scorer", p, Lookup({"token-load-scorer": load}))
    eps = [ep("e0"), ep("e1")]
    s.score(req(), state_for(1), eps)
    s.ledger.add("e0", 1000, 1e12)
    load.tracker.charge("other", [_charge("e1", 700)], 0.0)
    state = state_for(3000, {"e0": 2500, "e1": 500})
    costs = s.place(req(), state, eps).costs
    # miss x relative turnover ((0.1 + 0.05) / (0 + 0.05) = 3) + load_weight (0.02) x queue
    assert costs["e0"] == pytest.approx(500 * 3 + 0)
    assert costs["e1"] == pytest.approx(2500 * 1 + 0.02 * 700)


def _charge(engine: str, prefill: int) -> Any:
    from kvgate.plugins.load.loads import Charge
    return Charge(engine, prefill, 0)


def test_a_busy_home_is_left_when_waiting_costs_more_than_recomputing() -> None:
    """Saturation: the home is given up once its queue, at load_weight 0.02 per token, costs
    more than recomputing the 2,000 tokens it holds beyond the other engine: beyond a queue of
    100,000 tokens."""
    load = load_scorer()
    p = KvPlacementScorer.Params.model_validate({"load": "token-load-scorer"})
    s = KvPlacementScorer("kv-placement-scorer", p, Lookup({"token-load-scorer": load}))
    eps = [ep("e0"), ep("e1")]
    state = state_for(3000, {"e0": 2000, "e1": 0})
    assert best(s, state, eps) == "e0"
    load.tracker.charge("long", [_charge("e0", 85_000)], 0.0)
    assert best(s, state_for(3000, {"e0": 2000, "e1": 0}), eps) == "e0"
    load.tracker.charge("longer", [_charge("e0", 20_000)], 0.0)
    assert best(s, state_for(3000, {"e0": 2000, "e1": 0}), eps) == "e1"


def test_other_tiers_count_at_their_weight() -> None:
    s = scorer(other_tier_weight=0.5)
    eps = [ep("e0"), ep("e1")]
    costs = s.place(req(), state_for(1000, {"e0": 0, "e1": 400}, other={"e0": 1000}), eps).costs
    assert costs == {"e0": pytest.approx(500), "e1": pytest.approx(600)}


def test_capacity_configured_then_reported_then_default() -> None:
    s = scorer(capacity_tokens={"e0": 123})
    reported = dataclasses.replace(
        ep("e1"), metrics=EngineMetrics(extra={"kv_capacity_tokens": 4096.0}))
    assert (s.capacity(ep("e0")), s.capacity(reported), s.capacity(ep("e2"))) == (123, 4096, CAP)


@pytest.mark.parametrize(("name", "extra", "configured", "expected"), [
    ("e0", {}, {"e0": 123}, 123),  # configured wins over everything
    ("e0", {"kv_capacity_tokens": 4096.0}, {"e0": 123}, 123),
    ("e1", {"kv_capacity_tokens": 4096.0}, {}, 4096),  # reported
    ("e1", {"kv_capacity_tokens": 4096.7}, {}, 4096),  # reported, truncated as capacity()
    ("e1", {"kv_capacity_tokens": 0.5}, {}, CAP),  # below one token: not a capacity
    ("e2", {}, {}, CAP),  # the default
])
def test_the_placement_reads_each_capacity_as_capacity_does(
        name: str, extra: dict[str, float], configured: dict[str, int], expected: int) -> None:
    """place() keeps each candidate's capacity between scrapes: the same figure as
    capacity(), which the metric uses."""
    s = scorer(capacity_tokens=configured)
    engine = dataclasses.replace(ep(name), metrics=EngineMetrics(extra=extra))
    s.place(req(), state_for(10), [engine, ep("other")])
    assert s._capacity[name] == s.capacity(engine) == expected


def test_ledger_pressures_are_value_over_capacity_to_the_last_bit() -> None:
    rng = random.Random(7)
    ledger = InsertionLedger()
    engines = [f"e{i}" for i in range(12)]
    for _ in range(200):
        ledger.add(rng.choice(engines[:10]), rng.uniform(1, 5000), 30_000.0)  # e10, e11: none
    capacity = {e: rng.randint(1000, 100_000) for e in engines}
    for half_life, floor in ((30_000.0, 0.0), (1234.5, 0.05)):
        got = ledger.pressures(engines, capacity, half_life, floor)
        assert list(got) == engines
        for e in engines:
            assert got[e] == ledger.value(e, half_life) / capacity[e] + floor, e


def test_pressure_exponent_scales_the_turnover() -> None:
    """J = miss x turnover ** exponent: with 2.0 the 3x turnover of the costs test costs 9x."""
    s = scorer(half_life_caches=1e9, pressure_exponent=2.0)
    eps = [ep("e0"), ep("e1")]
    s.score(req(), state_for(1), eps)
    s.ledger.add("e0", 1000, 1e12)
    costs = s.place(req(), state_for(3000, {"e0": 2500, "e1": 500}), eps).costs
    assert costs["e0"] == pytest.approx(500 * 9)
    assert costs["e1"] == pytest.approx(2500 * 1)


def test_half_life_follows_the_fleets_capacity() -> None:
    """The half-life (``half_life_caches`` fleet capacities) is kept between requests and
    follows every change: an engine reporting a new capacity, one joining, one leaving, one
    rejoining with the metrics it had."""
    def sized(name: str, tokens: float) -> Endpoint:
        return dataclasses.replace(ep(name), metrics=EngineMetrics(
            extra={"kv_capacity_tokens": tokens}))

    s = scorer(half_life_caches=2.0)
    # the same metrics object before and after leaving: its capacity is read again on rejoining
    # (the scorer skips engines whose metrics object it has read, until they leave)
    same_metrics = sized("e0", 2000)
    steps: list[tuple[list[Endpoint], list[Endpoint], float]] = [
        ([sized("e0", 1000)], [], 2 * 1000),
        ([sized("e0", 1000)], [], 2 * 1000),  # unchanged: the kept value
        ([sized("e0", 4000)], [], 2 * 4000),  # the engine reports a larger cache
        ([sized("e0", 4000), sized("e1", 1000)], [], 2 * 5000),  # a second engine
        ([sized("e1", 1000)], [ep("e0")], 2 * 1000),  # the first leaves the pool
        ([same_metrics, sized("e1", 1000)], [], 2 * 3000),  # and rejoins, metrics unchanged
        ([sized("e1", 1000)], [ep("e0")], 2 * 1000),  # leaves again
        ([same_metrics, sized("e1", 1000)], [], 2 * 3000),  # back with the same object
    ]
    for eps, removed, expected in steps:
        if removed:
            s.on_endpoints_changed([], removed)
        s.score(req(), state_for(100), eps)
        assert s._half_life() == expected


def test_larger_caches_take_proportionally_more_cold_work() -> None:
    big = dataclasses.replace(
        ep("big"), metrics=EngineMetrics(extra={"kv_capacity_tokens": 30_000.0}))
    small = dataclasses.replace(
        ep("small"), metrics=EngineMetrics(extra={"kv_capacity_tokens": 10_000.0}))
    s = scorer()
    placed = {"big": 0, "small": 0}
    for i in range(400):
        state = state_for(1000 + i % 7)  # cold requests, no match data
        target = best(s, state, [big, small])
        placed[target] += 1
        decision = RoutingDecision(target=big if target == "big" else small)
        _run(s.before_dispatch(req(body={"max_tokens": 0}), state, decision))
    assert placed["big"] / placed["small"] == pytest.approx(3.0, rel=0.1)


def test_ledger_decays_by_fleet_insertions_not_time() -> None:
    ledger = InsertionLedger()
    ledger.add("e0", 1000, half_life=1000)
    assert ledger.value("e0", 1000) == 1000
    ledger.add("e1", 1000, half_life=1000)  # the fleet inserted one half-life since
    assert ledger.value("e0", 1000) == pytest.approx(500)
    assert ledger.value("e1", 1000) == 1000
    ledger.add("e0", 0, half_life=1000)  # nothing inserted: nothing decays
    assert ledger.value("e0", 1000) == pytest.approx(500)
    ledger.add("e0", 1000, half_life=1000)  # its own insertion ages its older tokens
    assert ledger.value("e0", 1000) == pytest.approx(250 + 1000)
    ledger.forget("e0")
    assert ledger.value("e0", 1000) == 0.0
    assert math.isclose(ledger.total, 3000)


def test_dispatch_charges_prefill_and_decode_engines() -> None:
    s = scorer(half_life_caches=1e9)
    eps = [ep("p0"), ep("d0")]
    state = state_for(3000, {"p0": 1000, "d0": 2000})
    s.score(req(), state, eps)
    decision = RoutingDecision(target=eps[1], prefill=eps[0])
    _run(s.before_dispatch(req(body={"max_tokens": 10}), state, decision))
    assert s.ledger.value("p0", 1e12) == pytest.approx(2000)  # its miss
    assert s.ledger.value("d0", 1e12) == pytest.approx(1000 + 10)  # KV transferred + output
    assert s.stats.decisions == {"home": 1, "moved": 0, "cold": 0}


def test_session_pin_breaks_ties_and_is_bounded() -> None:
    s = scorer(max_sessions=2, pin_tokens=256)
    eps = [ep("e0"), ep("e1")]
    for session, engine in (("a", "e1"), ("b", "e0"), ("c", "e1")):
        state = state_for(100, {}, session=session)
        _run(s.before_dispatch(req(body={"max_tokens": 0}), state,
                               RoutingDecision(target=eps[int(engine[1])])))
    assert s.stats.pins_evicted == 1  # "a" went first
    state = state_for(100, {}, session="b")
    costs = s.place(req(), state, eps).costs
    assert costs["e0"] < costs["e1"]  # pinned, although e0 and e1 are otherwise close
    s.on_endpoints_changed([], [eps[0]])
    assert s.place(req(), state_for(100, {}, session="b"), [eps[1]]).costs["e1"] > 0


def test_score_is_one_for_the_cheapest_and_records_the_placement() -> None:
    s = scorer()
    eps = [ep("e0"), ep("e1"), ep("e2")]
    state = state_for(1000, {"e0": 1000, "e1": 500, "e2": 0})
    scores = s.score(req(), state, eps)
    assert scores == {"e0": 1.0, "e1": pytest.approx(0.5), "e2": 0.0}
    placement = state.get(PLACEMENT)
    assert placement is not None and placement.home == "e0"
    assert s.score(req(), state_for(10, {}), eps) == dict.fromkeys(["e0", "e1", "e2"], 1.0)


def test_metrics_reach_prometheus() -> None:
    s = scorer()
    eps = [ep("e0")]
    state = state_for(500, {"e0": 0})
    s.score(req(), state, eps)
    _run(s.before_dispatch(req(body={"max_tokens": 0}), state, RoutingDecision(target=eps[0])))
    registry = CollectorRegistry()
    registry.register(s.collector())
    text = generate_latest(registry).decode()
    assert 'kvgate_placement_decisions_total{kind="cold"} 1.0' in text
    assert 'kvgate_placement_pressure{engine="e0"} 0.05' in text
    assert 'kvgate_placement_capacity_tokens{engine="e0"} 10000.0' in text


def test_load_must_name_a_token_load_scorer() -> None:
    from kvgate.middleware.framework.errors import ConfigError
    p = KvPlacementScorer.Params.model_validate({"load": "x"})
    with pytest.raises(ConfigError, match="not a token-load-scorer"):
        KvPlacementScorer("kv-placement-scorer", p, Lookup({"x": object()}))


def _run(coro: Any) -> None:
    import asyncio
    asyncio.run(coro)


def test_default_tier_weight_is_the_derived_shared_tier_credit() -> None:
    """The default ``other_tier_weight`` is plugins/prefix/shared_tier.py's credit for its default
    link and model (docs/shared-tier.md), not a convention."""
    from kvgate.plugins.prefix.shared_tier import TierLink

    assert KvPlacementScorer.Params().other_tier_weight == round(TierLink().credit, 2)


# (case, session's own turns at e0 [tokens each], other traffic at e0, expected engine)
OWN_GROWTH = [
    ("a session alone on its engine is not pushed to an idle one by its own growth",
     [3000, 3000, 3000], 0, "e0"),
    ("... but other sessions' insertions there still count", [3000], 20_000, "e1"),
]


@pytest.mark.parametrize(("case", "own", "others", "expected"), OWN_GROWTH,
                         ids=[c[0] for c in OWN_GROWTH])
def test_a_sessions_own_insertions_do_not_push_it_off_its_engine(
        case: str, own: list[int], others: int, expected: str) -> None:
    s = scorer(pin_tokens=0)
    eps = [ep("e0"), ep("e1")]
    prompt = 0
    for tokens in own:  # the session's turns, each inserting its growth at e0
        prompt += tokens
        state = state_for(prompt, {"e0": prompt - tokens, "e1": 0}, session="s")
        _run(s.before_dispatch(req(body={"max_tokens": 0}), state,
                               RoutingDecision(target=eps[0])))
    if others:
        _run(s.before_dispatch(req(body={"max_tokens": 0}), state_for(others, {}),
                               RoutingDecision(target=eps[0])))
    # the next turn adds 800: staying inserts 800 where the session's own 9,000 were inserted
    # (19x the idle engine's turnover if they counted: 15,200 against moving's 9,800)
    nxt = state_for(prompt + 800, {"e0": prompt, "e1": 0}, session="s")
    assert best(s, nxt, eps) == expected
    # the same turn without its session: the growth is anyone's, and it moves
    assert best(s, state_for(prompt + 800, {"e0": prompt, "e1": 0}), eps) == "e1"


def test_session_insertions_decay_move_and_stay_bounded() -> None:
    own = SessionInsertions(max_sessions=2)
    own.add("a", "e0", 1000, total=1000, half_life=1000)
    own.add("a", "e0", 1000, total=3000, half_life=1000)  # 2,000 later: two half-lives
    assert own.pressure("a", "e0", 3000, 1000, 10_000) == pytest.approx((250 + 1000) / 10_000)
    own.add("a", "e1", 500, total=3500, half_life=1000)  # moved: starts afresh
    assert own.pressure("a", "e0", 3500, 1000, 10_000) == 0.0
    assert own.pressure("a", "e1", 3500, 1000, 10_000) == pytest.approx(0.05)
    own.add("b", "e0", 1, total=3501, half_life=1000)
    own.add("c", "e0", 1, total=3502, half_life=1000)
    assert len(own) == 2 and own.pressure("a", "e1", 3502, 1000, 10_000) == 0.0
    own.forget_engine("e0")
    assert len(own) == 0
