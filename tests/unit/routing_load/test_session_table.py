"""The Redis-backed shared session table, against a real ``redis-server`` started per test on a
free loopback port: pins, TTL expiry, failover to rendezvous hashing when Redis stops, recovery.

Skipped when the ``redis-server`` binary or the ``redis`` package is missing
(``apt-get install -y redis-server``; ``pip install 'kvgate[redis]'``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest

from kvgate.middleware.framework.types import CycleState, Endpoint, RoutingDecision
from kvgate.plugins.load.session_affinity import SessionAffinityScorer, hrw_order, session_key
from tests.servers import REDIS_SERVER, RedisServer, free_port
from tests.unit.routing_load.helpers import FakeClock, ep, fleet, req, session_scorer

#: Bound on one Redis call against the live test server: generous, because CI machines are
#: loaded (the 50 ms production default is about LAN round trips, not a busy 2-core VM).
LIVE_TIMEOUT_S = 2.0

pytest.importorskip("redis", reason="the 'redis' package is not installed (kvgate[redis])")
pytestmark = pytest.mark.skipif(
    REDIS_SERVER is None, reason="redis-server not installed (apt-get install -y redis-server)"
)

SES = "ses_table_test"


@pytest.fixture
async def scorer(redis_server: RedisServer) -> AsyncIterator[SessionAffinityScorer]:
    plugin = session_scorer(redis_url=redis_server.url, ttl_s=0.5, redis_retry_s=5.0,
                            redis_timeout_s=LIVE_TIMEOUT_S)
    await plugin.start()
    try:
        yield plugin
    finally:
        await plugin.stop()


async def _route(scorer: SessionAffinityScorer, eps: list[Endpoint],
                 target: str | None = None) -> str | None:
    """One request of the session: hooks, scoring, then dispatch to ``target`` (or the choice)."""
    r = req({"x-session-affinity": SES})
    state = CycleState()
    await scorer.on_request(r, state)
    await scorer.prepare(r, state, eps)
    scores = scorer.score(r, state, eps)
    choice = next((k for k, v in scores.items() if v == 1.0), None)
    chosen = target or choice
    if chosen is not None:
        await scorer.before_dispatch(r, state, RoutingDecision(target=ep(chosen)))
        assert scorer.table is not None
        await scorer.table.flush()
    return choice


def _ranked(n: int) -> list[str]:
    return [e.id for e in hrw_order(session_key(None, "m", SES), fleet(n))]


async def test_pin_follows_the_actual_placement(scorer: SessionAffinityScorer) -> None:
    ranked = _ranked(4)
    eps = fleet(4)
    assert await _route(scorer, eps) == ranked[0]  # nothing pinned yet: HRW
    assert scorer.stats.table_misses == 1
    # another scorer (say prefix-cache) sent it elsewhere: the table follows
    await _route(scorer, eps, target=ranked[2])
    assert await _route(scorer, eps) == ranked[2]
    assert scorer.stats.table_hits >= 1
    assert scorer.stats.table_errors == 0


async def test_pin_shared_by_replicas(redis_server: RedisServer) -> None:
    a = session_scorer(redis_url=redis_server.url, redis_timeout_s=LIVE_TIMEOUT_S)
    b = session_scorer(redis_url=redis_server.url, redis_timeout_s=LIVE_TIMEOUT_S)
    await a.start()
    await b.start()
    try:
        ranked = _ranked(4)
        await _route(a, fleet(4), target=ranked[3])
        assert await _route(b, fleet(4)) == ranked[3]
    finally:
        await a.stop()
        await b.stop()


async def test_overloaded_pin_is_soft(scorer: SessionAffinityScorer) -> None:
    ranked = _ranked(4)
    await _route(scorer, fleet(4), target=ranked[2])
    busy = [ep(name, in_flight=30 if name == ranked[2] else 0) for name in ranked]
    assert await _route(scorer, busy) == ranked[0]  # pinned engine over the load bound
    assert await _route(scorer, fleet(4)) == ranked[0]  # and the pin followed the request


async def test_pinned_engine_gone_falls_back_to_hrw(scorer: SessionAffinityScorer) -> None:
    ranked = _ranked(4)
    await _route(scorer, fleet(4), target=ranked[2])
    remaining = [ep(name) for name in ranked if name != ranked[2]]
    assert await _route(scorer, remaining) == ranked[0]


async def test_ttl_expiry(scorer: SessionAffinityScorer) -> None:
    ranked = _ranked(4)
    await _route(scorer, fleet(4), target=ranked[1])
    assert await _route(scorer, fleet(4), target=ranked[1]) == ranked[1]  # renews the TTL
    await asyncio.sleep(0.8)  # ttl_s = 0.5
    assert await _route(scorer, fleet(4)) == ranked[0]
    assert scorer.stats.table_misses == 2


async def test_failover_when_redis_stops_and_recovery(
    scorer: SessionAffinityScorer, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvgate.plugins.session_affinity")
    assert scorer.table is not None
    clock = FakeClock()
    scorer.table.clock = clock
    ranked = _ranked(4)
    await _route(scorer, fleet(4), target=ranked[3])
    assert await _route(scorer, fleet(4)) == ranked[3]

    redis_server.stop()
    assert await _route(scorer, fleet(4)) == ranked[0]  # read fails: plain HRW
    assert scorer.stats.table_errors == 1
    for _ in range(5):  # within redis_retry_s: Redis is not even tried
        assert await _route(scorer, fleet(4)) == ranked[0]
    assert scorer.stats.table_errors == 1
    assert scorer.stats.table_skipped >= 5
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "session table unavailable" in warnings[0].getMessage()
    assert redis_server.url not in caplog.text

    clock.now += 6.0  # past redis_retry_s, still down: one more error, no second log line
    assert await _route(scorer, fleet(4)) == ranked[0]
    assert scorer.stats.table_errors == 2
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1

    redis_server.start()  # same port, empty (no persistence)
    clock.now += 6.0
    assert await _route(scorer, fleet(4), target=ranked[2]) == ranked[0]
    assert await _route(scorer, fleet(4)) == ranked[2]
    assert "reachable again" in caplog.text


async def test_unreachable_redis_never_fails_requests() -> None:
    plugin = session_scorer(redis_url=f"redis://127.0.0.1:{free_port()}/0")
    await plugin.start()
    try:
        assert await _route(plugin, fleet(3)) == _ranked(3)[0]
        assert plugin.stats.table_errors == 1
    finally:
        await plugin.stop()


async def test_pending_writes_are_bounded(redis_server: RedisServer) -> None:
    plugin = session_scorer(redis_url=redis_server.url, max_pending_writes=2,
                            redis_timeout_s=LIVE_TIMEOUT_S)
    await plugin.start()
    try:
        assert plugin.table is not None
        for i in range(5):
            plugin.table.put_later(f"k{i}", "e0")
        assert plugin.stats.writes_dropped == 3
        await plugin.table.flush()
        assert plugin.stats.table_writes == 2
    finally:
        await plugin.stop()


async def test_no_tenant_or_session_in_redis_keys(scorer: SessionAffinityScorer,
                                                  redis_server: RedisServer) -> None:
    import redis.asyncio as aredis

    await _route(scorer, fleet(2), target="e1")
    client = aredis.Redis.from_url(redis_server.url)
    try:
        keys = [k.decode() if isinstance(k, bytes) else k for k in await client.keys("*")]
    finally:
        await client.aclose()
    assert len(keys) == 1
    assert keys[0].startswith("kvgate:session:")
    assert SES not in keys[0]
