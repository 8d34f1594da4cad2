"""The placement's session memory shared between replicas (plugins/placement/shared.py): a
session's turns spread round robin over replicas stay on their engine as with one router, with
and without session headers; the items are validated; and through a real ``redis-server`` one
replica's dispatch reaches the other, and a Redis outage is reported on ``/health``."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvgate.middleware.framework.types import CycleState, RoutingDecision
from kvgate.plugins.common.broadcast import Broadcast, Channel
from kvgate.plugins.common.state import (
    PREFIX_MATCH,
    PROMPT_CHAIN,
    SESSION_KEY,
    SESSION_PIN,
    TOKEN_IDS,
    PrefixMatch,
)
from kvgate.plugins.placement.conversations import Turn
from kvgate.plugins.placement.scorer import KvPlacementScorer
from kvgate.plugins.placement.shared import ConversationTold, SessionTold, parse
from kvgate.plugins.prefix.index.hashing import chain_hashes
from tests.servers import RedisServer
from tests.unit.routing_load.helpers import Lookup, ep, req, until

CAP = 10_000  # tokens per engine
B = 16  # block size of the prompts' chains
EPS = [ep("e0"), ep("e1")]


def scorer(**params: Any) -> KvPlacementScorer:
    p = KvPlacementScorer.Params.model_validate(
        {"default_capacity_tokens": CAP, "pin_tokens": 0, **params})
    return KvPlacementScorer("kv-placement-scorer", p, Lookup())


def bus(scorers: Sequence[KvPlacementScorer]) -> None:
    """What ``redis_url`` gives each replica, without Redis: a broadcast whose queue the test
    delivers (:func:`deliver`)."""
    for i, s in enumerate(scorers):
        s.shared = Broadcast(None, None, s.apply_shared, Channel("t", "t", "t", "t"),
                             me=f"r{i}", flush_s=1.0, timeout_s=1.0, retry_s=1.0,
                             max_pending=64)


def deliver(scorers: Sequence[KvPlacementScorer], k: int, inserted: float,
            engine: str) -> None:
    """After replica ``k`` dispatched: its insertions reach the others' ledgers (the token-load
    counter exchange) and, when shared, its session memory (through JSON, as on the wire)."""
    told = scorers[k].shared
    items = [] if told is None else json.loads(json.dumps(told.drain()))
    for i, other in enumerate(scorers):
        if i != k:
            other.add_remote({engine: inserted})
            for item in items:
                assert other.apply_shared(item)


def state_of(tokens: list[int], held: dict[str, int], session: str | None,
             pin: str | None) -> CycleState:
    state = CycleState()
    state.put(TOKEN_IDS, tokens)
    state.put(PROMPT_CHAIN, (B, chain_hashes(tokens, B)))
    state.put(PREFIX_MATCH, PrefixMatch(len(tokens), held, {}, True))
    if session is not None:
        state.put(SESSION_KEY, session)
        if pin is not None:
            state.put(SESSION_PIN, pin)  # the session table's pin, shared in Redis
    return state


def best(s: KvPlacementScorer, state: CycleState) -> str:
    scores = s.score(req(), state, EPS)
    return max(scores, key=lambda e: scores[e])


# (case, session header?, memory shared?, engine the next turn goes to)
ROUND_ROBIN = [
    ("with headers, shared: the session's growth told by the other replica is its own", True,
     True, "e0"),
    ("with headers, not shared: the other replica reads it as e0's turnover and moves it",
     True, False, "e1"),
    ("without headers, shared: the conversation the other replica saw is recognised", False,
     True, "e0"),
    ("without headers, not shared: a conversation it never saw, on a busy engine: moved",
     False, False, "e1"),
]


@pytest.mark.parametrize(("case", "headers", "shared", "expected"), ROUND_ROBIN,
                         ids=[c[0] for c in ROUND_ROBIN])
def test_a_session_spread_over_replicas_stays_on_its_engine(
        case: str, headers: bool, shared: bool, expected: str) -> None:
    replicas = [scorer(), scorer()]
    if shared:
        bus(replicas)
    for s in replicas:  # each has scored once: it knows the engines' capacities
        s.score(req(), state_of(list(range(B)), {}, None, None), EPS)
    session = "s" if headers else None
    tokens: list[int] = list(range(100_000, 100_040))
    for turn in range(3):  # three turns of 3,000 new tokens, alternating replicas, all on e0
        k = turn % 2
        held = {"e0": len(tokens) if turn else 0, "e1": 0}
        tokens = tokens + list(range(len(tokens), len(tokens) + 3000))
        state = state_of(tokens, held, session, "e0" if turn else None)
        replicas[k].score(req(), state, EPS)
        asyncio.run(replicas[k].before_dispatch(req(body={"max_tokens": 0}), state,
                                                RoutingDecision(target=EPS[0])))
        deliver(replicas, k, float(len(tokens) - held["e0"]), "e0")
    # the next turn, on replica 1 (which routed only the second): staying inserts 3,000 where
    # the session inserted 9,040 (if it were others' turnover, ~12x the idle engine's: 36k
    # tokens against moving's 12,040); shared, the whole 9,040 is the session's own
    nxt = tokens + list(range(len(tokens), len(tokens) + 3000))
    assert best(replicas[1], state_of(nxt, {"e0": len(tokens), "e1": 0}, session, "e0")) == \
        expected


# (case, item, what it parses to: None when malformed)
ITEMS: list[tuple[str, Any, object]] = [
    ("session", ["s", "ab12", "e0", 300], SessionTold("ab12", "e0", 300.0)),
    ("conversation", ["c", "e1", 12.5, -7, 40, 9, 48, 3, None],
     ConversationTold(Turn("e1", 12.5, 0.0, 40, 9, -7, 48, 3), None)),
    ("conversation continuing another", ["c", "e1", 1, 2, 40, 9, 48, 3, 5],
     ConversationTold(Turn("e1", 1.0, 0.0, 40, 9, 2, 48, 3), 5)),
    ("negative tokens", ["s", "ab12", "e0", -1], None),
    ("infinite tokens (JSON's Infinity)", ["s", "ab12", "e0", float("inf")], None),
    ("NaN tokens", ["c", "e1", float("nan"), 2, 40, 9, 48, 3, None], None),
    ("engine not a string", ["s", "ab12", 3, 1], None),
    ("a hash that is not an int", ["c", "e1", 1, "2", 40, 9, 48, 3, None], None),
    ("a float where an int belongs", ["c", "e1", 1, 2, 40.0, 9, 48, 3, None], None),
    ("too short", ["c", "e1", 1], None),
    ("unknown kind", ["x", "e0"], None),
    ("not a list", {"s": 1}, None),
    ("empty", [], None),
]


@pytest.mark.parametrize(("case", "item", "expected"), ITEMS, ids=[c[0] for c in ITEMS])
def test_items_are_validated(case: str, item: Any, expected: object) -> None:
    assert parse(item) == expected


def test_what_is_told_for_an_engine_this_replica_does_not_route_to_is_skipped() -> None:
    s = scorer()
    s.score(req(), state_of(list(range(B)), {}, None, None), EPS)
    assert not s.apply_shared(["s", "ab12", "elsewhere", 300])
    assert s.apply_shared(["s", "ab12", "e0", 300])
    assert s.metrics_view().own_sessions == 1


def test_a_replica_knows_the_fleet_before_its_first_request() -> None:
    """A replica started into a running fleet applies what the others tell of its engines
    from the start (the pool announces them), not only after it scored a request."""
    s = scorer()
    assert not s.apply_shared(["s", "ab12", "e0", 300])  # no engine known yet
    s.on_endpoints_changed(EPS, ())
    assert s.apply_shared(["s", "ab12", "e0", 300])
    s.on_endpoints_changed((), EPS[:1])
    assert not s.apply_shared(["s", "ab12", "e0", 300])


async def test_replicas_tell_each_other_through_redis(redis_server: RedisServer) -> None:
    """Replica A's dispatches (a session's, a header-less conversation's) reach replica B's
    memory through a real Redis, never come back to A, and an outage says ``degraded``."""
    a, b = scorer(redis_url=redis_server.url), scorer(redis_url=redis_server.url)
    await a.start()
    await b.start()
    try:
        for s in (a, b):
            s.score(req(), state_of(list(range(B)), {}, None, None), EPS)
        await asyncio.sleep(0.3)  # both subscribed
        for session in ("s", None):
            state = state_of(list(range(200, 600)), {"e0": 0, "e1": 0}, session, None)
            a.score(req(), state, EPS)
            await a.before_dispatch(req(body={"max_tokens": 0}), state,
                                    RoutingDecision(target=EPS[1]))
        assert b.shared is not None and a.shared is not None
        await until(lambda: b.metrics_view().own_sessions == 1
                    and b.metrics_view().conversations == 1, limit_s=10.0)
        assert b.shared.stats.received == 2 and a.shared.stats.received == 0
        assert b.health() == {"shared_placement": "ok"}
        await until(lambda: a.shared is not None and a.shared.stats.published == 2)
        registry = CollectorRegistry()
        registry.register(b.collector())
        text = generate_latest(registry).decode()
        assert 'kvgate_placement_shared_items_total{outcome="received"} 2.0' in text
        assert "kvgate_placement_shared_down 0.0" in text
        redis_server.stop()
        a.shared.send(["s", "cd34", "e0", 1])
        await until(lambda: a.shared is not None and a.shared.stats.down, limit_s=10.0)
        assert "degraded" in str(a.health()["shared_placement"])
    finally:
        await a.stop()
        await b.stop()

