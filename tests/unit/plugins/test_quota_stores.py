"""The two quota stores (in-process, and Redis against a real ``redis-server``) held to the same
table of scenarios: token buckets, tenant and key scopes, concurrency leases, budgets with
reservations, settlement with the real usage, lease expiry, seeding.

Time is each store's own (Redis's ``TIME`` for the shared one): the scenarios only use
refills too slow to matter within a test (limits per minute, tests last milliseconds).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import pytest

from kvgate.plugins.quotas.local import LocalStore
from kvgate.plugins.quotas.model import Ask, QuotaStore, ScopeLimits, Settlement, Verdict
from kvgate.plugins.quotas.redis_store import RedisStore, Unseeded, connect
from tests.servers import REDIS_SERVER, RedisServer, redis_running

_ids = itertools.count()


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer | None]:
    if REDIS_SERVER is None:
        yield None
        return
    with redis_running() as server:
        yield server


@pytest.fixture(params=["local", "redis"])
async def store(request: pytest.FixtureRequest,
                redis_server: RedisServer | None) -> AsyncIterator[QuotaStore]:
    if request.param == "local":
        yield LocalStore()
        return
    if redis_server is None:
        pytest.skip("redis-server not installed (apt-get install -y redis-server)")
    pytest.importorskip("redis")
    shared = RedisStore(connect(redis_server.url, 2.0), prefix=f"t{next(_ids)}:",
                        timeout_s=2.0)
    try:
        yield shared
    finally:
        await shared.close()


def _now() -> int:
    import time

    return int(time.time() * 1000)


@dataclass(frozen=True)
class Step:
    """Admit (``settle`` None) or settle the ``ask``-th admitted request with ``settle``."""

    ok: bool | None = None
    dimension: str = ""
    scope: str = ""
    inp: int = 10
    out: int = 10
    cost: int = 0
    settle: tuple[int, Settlement] | None = None


KEY, TENANT = "key:k", "tenant:t"
CASES: list[tuple[str, tuple[ScopeLimits, ...], list[Step]]] = [
    ("requests per minute", (ScopeLimits(KEY, requests_per_min=3),),
     [Step(True), Step(True), Step(True), Step(False, "requests", KEY)]),
    ("the tenant's tighter limit", (ScopeLimits(KEY, requests_per_min=10),
                                    ScopeLimits(TENANT, requests_per_min=2)),
     [Step(True), Step(True), Step(False, "requests", TENANT)]),
    ("concurrency, released by settlement", (ScopeLimits(KEY, max_concurrent=2),),
     [Step(True), Step(True), Step(False, "concurrent", KEY),
      Step(settle=(0, Settlement(10, 10, 0))), Step(True), Step(False, "concurrent", KEY)]),
    ("output tokens corrected by real usage", (ScopeLimits(KEY, output_tokens_per_min=1000),),
     [Step(True, out=600), Step(False, "output_tokens", KEY, out=600),
      Step(settle=(0, Settlement(10, 100, 0))), Step(True, out=600)]),
    ("a request larger than the limit passes a full bucket",
     (ScopeLimits(KEY, input_tokens_per_min=100),),
     [Step(True, inp=500), Step(False, "input_tokens", KEY, inp=1)]),
    ("budget: reservations count, settlement replaces them",
     (ScopeLimits(KEY, budget_units=100),),
     [Step(True, cost=60), Step(True, cost=60), Step(False, "budget", KEY, cost=1),
      Step(settle=(0, Settlement(10, 10, 30))), Step(settle=(1, Settlement(10, 10, 30))),
      Step(True, cost=60), Step(False, "budget", KEY, cost=1)]),
    ("the tenant's budget binds every key", (ScopeLimits(KEY),
                                             ScopeLimits(TENANT, budget_units=50)),
     [Step(True, cost=50), Step(False, "budget", TENANT, cost=1),
      Step(settle=(0, Settlement(1, 1, 10))), Step(True, cost=10)]),
    ("a refused request reserves nothing", (ScopeLimits(KEY, requests_per_min=2),
                                            ScopeLimits(TENANT, max_concurrent=1)),
     [Step(True), Step(False, "concurrent", TENANT), Step(False, "concurrent", TENANT),
      Step(settle=(0, Settlement(1, 1, 0))), Step(True), Step(False, "requests", KEY)]),
]


@pytest.mark.parametrize(("name", "scopes", "steps"), CASES, ids=[c[0] for c in CASES])
async def test_scenarios(store: QuotaStore, name: str, scopes: tuple[ScopeLimits, ...],
                         steps: list[Step]) -> None:
    await store.seed({s.scope: 0 for s in scopes if s.has_budget})
    admitted: list[Ask] = []
    for i, step in enumerate(steps):
        if step.settle is not None:
            index, used = step.settle
            await store.settle(admitted[index], used, _now())
            continue
        ask = Ask(f"r{i}", scopes, step.inp, step.out, step.cost, 60_000)
        verdict = await store.admit(ask, _now())
        assert (verdict.ok, verdict.dimension, verdict.scope) == (
            step.ok, step.dimension, step.scope), (name, i, verdict)
        if verdict.ok:
            admitted.append(ask)
        else:
            assert verdict.dimension == "budget" or verdict.retry_ms > 0, (name, i)


async def test_headers_report_the_tightest_bucket(store: QuotaStore) -> None:
    scopes = (ScopeLimits(KEY, requests_per_min=10, output_tokens_per_min=1000),
              ScopeLimits(TENANT, requests_per_min=4, input_tokens_per_min=100_000))
    verdicts: list[Verdict] = []
    for i in range(3):
        verdicts.append(await store.admit(Ask(f"h{i}", scopes, 10, 100, 0, 60_000), _now()))
    assert [(v.requests.limit, v.requests.remaining) for v in verdicts if v.requests] == [
        (4, 3), (4, 2), (4, 1)]
    tokens = verdicts[-1].tokens
    assert tokens is not None and (tokens.limit, tokens.remaining) == (1000, 700)
    assert 0 < tokens.reset_ms <= 60_000 * 300 // 1000 + 1


async def test_an_expired_lease_is_released(store: QuotaStore) -> None:
    """A replica that died mid-request: its lease (and reservation) lapse at the deadline."""
    scopes = (ScopeLimits(KEY, max_concurrent=1, budget_units=10),)
    await store.seed({KEY: 0})
    assert (await store.admit(Ask("dead", scopes, 1, 1, 10, 1), _now())).ok
    await asyncio.sleep(0.02)
    assert (await store.admit(Ask("next", scopes, 1, 1, 5, 60_000), _now())).ok


async def test_seeding_keeps_what_the_store_has(store: QuotaStore) -> None:
    scopes = (ScopeLimits(KEY, budget_units=100),)
    await store.seed({KEY: 99})
    await store.seed({KEY: 0})  # a second replica seeding from an older ledger total
    assert (await store.admit(Ask("a", scopes, 1, 1, 1, 60_000), _now())).ok
    assert not (await store.admit(Ask("b", scopes, 1, 1, 1, 60_000), _now())).ok


async def test_redis_asks_for_a_seed(redis_server: RedisServer | None) -> None:
    if redis_server is None:
        pytest.skip("redis-server not installed")
    shared = RedisStore(connect(redis_server.url, 2.0), prefix="seedtest:", timeout_s=2.0)
    try:
        ask = Ask("s", (ScopeLimits(KEY, budget_units=10),), 1, 1, 1, 60_000)
        with pytest.raises(Unseeded) as missing:
            await shared.admit(ask, _now())
        assert missing.value.scope == KEY
        await shared.seed({KEY: 3})
        assert (await shared.admit(ask, _now())).ok
    finally:
        await shared.close()
