"""In-flight token load shared between replicas (plugins/load/shared_load.py), against a real
``redis-server``: two token-load scorers on one Redis see each other's load, a stopped replica's
load expires, Redis stopped -> each routes on its own load and says so; the merge is pure."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvgate.middleware.framework.types import CycleState, Outcome, OutcomeKind, RoutingDecision
from kvgate.plugins.load.loads import EngineLoad
from kvgate.plugins.load.shared_load import (
    GaugeShare,
    LoadExchange,
    connect,
    merge_loads,
    sum_gauges,
)
from kvgate.plugins.load.token_load import TokenLoadScorer
from tests.servers import REDIS_SERVER, RedisServer
from tests.unit.routing_load.helpers import ep, load_scorer, req, until

pytest.importorskip("redis", reason="the 'redis' package is not installed (kvgate[redis])")
pytestmark = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server not installed")

INTERVAL_S = 0.05


@pytest.mark.parametrize(("raws", "expected"), [
    ([], {}),
    ([None], {}),
    ([b'{"e0":[10,20,1]}', b'{"e0":[1,2,1],"e1":[5,0,1]}'],
     {"e0": EngineLoad(11, 22, 2), "e1": EngineLoad(5, 0, 1)}),
    ([b"not json", b"[1,2]", b'{"e0":[1,2]}', b'{"e0":[-1,0,0]}', b'{"e0":[1,true,0]}'], {}),
    ([json.dumps({"e2": [0, 7, 3]}).encode(), None], {"e2": EngineLoad(0, 7, 3)}),
])
def test_merge_loads(raws: list[bytes | None], expected: dict[str, EngineLoad]) -> None:
    assert merge_loads(raws) == expected


def scorer(url: str) -> TokenLoadScorer:
    """A replica's scorer; the generous timeout is for loaded CI machines."""
    return load_scorer(redis_url=url, share_interval_s=INTERVAL_S, share_ttl_s=0.5,
                       redis_timeout_s=2.0)


async def charge(s: TokenLoadScorer, engine: str, max_tokens: int) -> CycleState:
    r = req(body={"prompt": "x", "max_tokens": max_tokens})
    state = CycleState()
    await s.before_dispatch(r, state, RoutingDecision(target=ep(engine)))
    return state


async def test_replicas_see_each_others_load(redis_server: RedisServer) -> None:
    a, b = scorer(redis_server.url), scorer(redis_server.url)
    await a.start()
    await b.start()
    try:
        state = await charge(a, "e0", 1000)
        await until(lambda: b.load("e0").decode_tokens == 1000)
        assert b.tracker.load("e0") == EngineLoad()  # b's own view stays its own
        assert b.health()["other_replicas"] == 1
        await b.before_dispatch(req(body={"max_tokens": 10}), CycleState(),
                                RoutingDecision(target=ep("e0")))
        assert b.load("e0").decode_tokens == 1010  # own + the others'
        ids = ["e0", "e1", "e9"]  # works(): each engine's work(), the others' share included
        assert b.works(ids) == {e: b.work(e) for e in ids}
        await a.on_complete(req(), state, ep("e0"), Outcome(OutcomeKind.DONE, 200))
        await until(lambda: b.load("e0").decode_tokens == 10)
        await charge(a, "e1", 500)
        await until(lambda: b.load("e1").decode_tokens == 500)
        await a.stop()  # a stopped replica's entry is deleted (or expires after share_ttl_s)
        await until(lambda: b.load("e1").decode_tokens == 0)
    finally:
        await a.stop()
        await b.stop()


async def test_redis_down_falls_back_to_own_load(redis_server: RedisServer) -> None:
    a, b = scorer(redis_server.url), scorer(redis_server.url)
    await a.start()
    await b.start()
    try:
        await charge(a, "e0", 1000)
        await until(lambda: b.load("e0").decode_tokens == 1000)
        redis_server.stop()
        assert b.shared is not None
        await until(lambda: b.shared is not None and b.shared.stats.down)
        assert b.load("e0") == EngineLoad()  # the others' stale load is dropped, not kept
        assert "degraded" in str(b.health()["shared_load"])
        redis_server.start()  # same port: the next round reconnects
        await until(lambda: b.shared is not None and not b.shared.stats.down
                    and b.load("e0").decode_tokens == 1000)
    finally:
        await a.stop()
        await b.stop()


async def test_record_insertions_reach_the_other_replicas(redis_server: RedisServer) -> None:
    """The approximate record's insertions on replica A are applied on B (not back on A)."""
    from kvgate.middleware.framework.plugin import NoMetrics
    from kvgate.plugins.prefix.shared_record import (
        RecordMetrics,
        RecordShare,
        connect_pair,
        decode,
    )

    got: dict[str, list[tuple[str, list[int]]]] = {"a": [], "b": []}
    shares = []
    def keeper(name: str) -> Callable[[str, list[int]], None]:
        return lambda engine, hashes: got[name].append((engine, hashes))

    for name in ("a", "b"):
        pub, sub = connect_pair(redis_server.url, 2.0)
        share = RecordShare(pub, sub, keeper(name),
                            prefix="test:", flush_s=0.02, timeout_s=2.0, retry_s=0.1,
                            max_pending=8, me=name)
        share.start()
        shares.append(share)
    a, b = shares
    try:
        await until(lambda: b.stats.received == 0 and not b.stats.down)
        await asyncio.sleep(0.3)  # both subscribed
        a.publish("e1", [1, 2, 2**63 + 5])
        await until(lambda: got["b"] == [("e1", [1, 2, 2**63 + 5])])
        assert got["a"] == [] and a.stats.published == 1
        registry = CollectorRegistry()
        registry.register(RecordMetrics(NoMetrics(), lambda: b))
        text = generate_latest(registry).decode()
        assert 'kvgate_prefix_record_shared_items_total{outcome="received"} 1.0' in text
        assert "kvgate_prefix_record_shared_down 0.0" in text
        assert decode(b'{"from":"x","items":[["e0",[1,"2"]],["e0",[3]],[1,[2]]]}', "b") == [
            ("e0", [3])]
        assert decode(b'{"from":"b","items":[["e0",[3]]]}', "b") == []  # its own
        redis_server.stop()
        a.publish("e1", [4])
        # publisher and subscriber (either may notice first; the publish is dropped)
        await until(lambda: a.stats.down and b.stats.down and a.stats.dropped >= 1)
        assert "degraded" in str(a.health()["shared_record"])
        redis_server.start()
        await until(lambda: not b.stats.down, limit_s=10)
    finally:
        for share in shares:
            await share.stop()


def test_record_share_skips_repeats_within_repeat_s() -> None:
    """A hot prompt is sent once per ``repeat_s`` per engine, not per request."""
    from kvgate.plugins.prefix.shared_record import RecordShare

    now = [0.0]
    share = RecordShare(None, None, lambda e, h: None, prefix="t:", flush_s=1, timeout_s=1,
                        retry_s=1, max_pending=8, repeat_s=60.0, max_recent=2,
                        clock=lambda: now[0])
    for engine, hashes, at in [("e0", [1, 2], 0.0), ("e0", [1, 2], 30.0), ("e1", [1, 2], 30.0),
                               ("e0", [1, 2], 61.0), ("e0", [1, 3], 61.0), ("e0", [], 62.0)]:
        now[0] = at
        share.publish(engine, hashes)
    assert share.stats.repeats == 1  # e0 [1, 2] at 30 s
    assert [e for e, _ in share._pending] == ["e0", "e1", "e0", "e0"]


@pytest.mark.parametrize(("raws", "expected"), [
    ([], {}),
    ([None, b"not json", b"[1]"], {}),
    ([b'{"demand":3}', b'{"demand":4.5,"other":1}', b'{"demand":-2,"x":"y"}'],
     {"demand": 7.5, "other": 1.0}),
    ([b'{"demand":Infinity}', b'{"demand":NaN}', b'{"demand":1e400}', b'{"demand":2}'],
     {"demand": 2.0}),
])
def test_sum_gauges(raws: list[bytes | None], expected: dict[str, float]) -> None:
    assert sum_gauges(raws) == expected


async def test_gauges_sum_over_the_other_replicas_and_drop_when_redis_fails(
        redis_server: RedisServer) -> None:
    """Three exchanges publishing a gauge on a real Redis: each hears the sum of the other two;
    Redis stopped: each is handed ``{}`` (the others' view dropped), and the sums come back
    with Redis."""
    heard: list[dict[str, float]] = [{}, {}, {}]

    def share(i: int) -> GaugeShare:
        def remote(sums: Mapping[str, float]) -> None:
            heard[i] = dict(sums)
        return GaugeShare(lambda: {"demand": float(10 ** i)}, remote)

    exchanges = [LoadExchange(connect(redis_server.url, 2.0), dict, prefix="t:",
                              interval_s=INTERVAL_S, ttl_s=5.0, timeout_s=2.0, max_replicas=8,
                              gauges=share(i)) for i in range(3)]
    try:
        for _ in range(2):
            for ex in exchanges:
                await ex.exchange()
        assert heard == [{"demand": 110.0}, {"demand": 101.0}, {"demand": 11.0}]
        redis_server.stop()
        await exchanges[0].exchange()
        assert heard[0] == {} and exchanges[0].stats.down
        redis_server.start()  # same port: the next rounds reconnect
        for _ in range(50):
            for ex in exchanges:
                await ex.exchange()
            if heard[0] == {"demand": 110.0}:
                break
            await asyncio.sleep(INTERVAL_S)
        assert heard[0] == {"demand": 110.0} and not exchanges[0].stats.down
    finally:
        for ex in exchanges:
            await ex.stop()
