"""The JobStore contract, table-driven over both backends: SQLite (a file) and Redis (a real
redis-server): idempotent enqueue, claim with leases, fair order (SQLite), first terminal
write wins, release with backoff, cancel, batches, reaping lapsed leases and deadlines."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from kvgate.asyncq.api import JobResult, JobState, JobStore
from kvgate.asyncq.store.redis_store import RedisJobStore
from kvgate.asyncq.store.sqlite_store import SqliteJobStore
from tests.asyncq_helpers import PersistentRedis, spec
from tests.servers import REDIS_SERVER

NOW = 1000.0
OK = JobResult(200, b'{"ok": true}', "application/json", "sim-0", NOW + 1)


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if REDIS_SERVER is None:
        pytest.skip("redis-server not installed")
    server = PersistentRedis(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(params=["sqlite", "redis"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[JobStore]:
    if request.param == "sqlite":
        s: JobStore = SqliteJobStore(tmp_path / "jobs.sqlite", max_jobs=50)
    else:
        url = request.getfixturevalue("redis_url")
        import redis.asyncio as aioredis
        flusher = aioredis.Redis.from_url(url)
        await flusher.flushdb()
        await flusher.aclose()
        s = RedisJobStore(url, max_jobs=50)
    await s.open()
    try:
        yield s
    finally:
        await s.close()


async def test_enqueue_is_idempotent_by_id(store: JobStore) -> None:
    assert await store.enqueue([spec("a"), spec("b")]) == 2
    assert await store.enqueue([spec("a"), spec("c")]) == 1
    job = await store.get("a")
    assert job is not None and job.state is JobState.QUEUED and job.attempts == 0
    assert job.spec == spec("a")
    assert await store.get("nope") is None
    assert await store.counts() == {("queued", JobState.QUEUED): 3}


async def test_claim_leases_each_job_to_one_consumer(store: JobStore) -> None:
    await store.enqueue([spec(f"j{i}", created_at=NOW + i) for i in range(5)])
    first = await store.claim("r1", 3, 30.0, NOW)
    second = await store.claim("r2", 10, 30.0, NOW)
    assert [j.spec.id for j in first] == ["j0", "j1", "j2"]
    assert [j.spec.id for j in second] == ["j3", "j4"]
    assert all(j.state is JobState.RUNNING and j.attempts == 1 for j in [*first, *second])
    assert {j.owner for j in first} == {"r1"}
    assert await store.claim("r3", 10, 30.0, NOW) == []


@pytest.mark.parametrize(("terminal", "second"), [
    (JobState.SUCCEEDED, JobState.FAILED), (JobState.FAILED, JobState.SUCCEEDED),
    (JobState.CANCELLED, JobState.SUCCEEDED)])
async def test_first_terminal_write_wins(store: JobStore, terminal: JobState,
                                         second: JobState) -> None:
    await store.enqueue([spec("a")])
    await store.claim("r1", 1, 30.0, NOW)
    assert await store.finish("a", terminal, OK) is True
    assert await store.finish("a", second, OK) is False
    job = await store.get("a")
    assert job is not None and job.state is terminal and job.result == OK
    assert await store.counts() == {}


async def test_release_with_backoff_then_claimable_again(store: JobStore) -> None:
    await store.enqueue([spec("a")])
    assert len(await store.claim("r1", 1, 30.0, NOW)) == 1
    assert await store.release("a", "r2") is False  # not its owner
    assert await store.release("a", "r1", delay_s=3600) is True
    import time
    now = time.time()
    assert await store.claim("r1", 1, 30.0, now) == []
    await store.reap(now + 3601)
    (again,) = await store.claim("r1", 1, 30.0, now + 3601)
    assert again.spec.id == "a" and again.attempts == 2


async def test_reap_requeues_lapsed_leases_and_expires_deadlines(store: JobStore) -> None:
    await store.enqueue([spec("held"), spec("late", deadline=NOW + 10, created_at=NOW + 1)])
    (held,) = await store.claim("dead-replica", 1, 5.0, NOW)
    assert held.spec.id == "held"
    await store.reap(NOW + 1)  # both still fine
    assert (await store.get("late")).state is JobState.QUEUED  # type: ignore[union-attr]
    import asyncio
    await asyncio.sleep(1.1)  # Redis hands pending entries over once idle past a second
    changed = {j.spec.id: j.state for j in await store.reap(NOW + 20)}
    assert changed == {"held": JobState.QUEUED, "late": JobState.EXPIRED}
    late = await store.get("late")
    assert late is not None and late.result is not None and late.result.status == 408
    (again,) = await store.claim("r2", 5, 30.0, NOW + 20)
    assert again.spec.id == "held" and again.attempts == 2 and again.owner == "r2"


async def test_renewed_lease_is_not_reaped(store: JobStore) -> None:
    await store.enqueue([spec("a")])
    await store.claim("r1", 1, 5.0, NOW)
    await store.renew("r1", ["a"], 60.0, NOW + 4)
    import asyncio
    await asyncio.sleep(1.1)
    assert await store.reap(NOW + 10) == []
    assert (await store.get("a")).state is JobState.RUNNING  # type: ignore[union-attr]


async def test_cancel_and_batches(store: JobStore) -> None:
    await store.enqueue([spec(f"b{i}", batch_id="batch_1", created_at=NOW + i)
                         for i in range(4)] + [spec("other", batch_id="batch_2")])
    await store.claim("r1", 1, 30.0, NOW)  # b0 running
    await store.finish("b0", JobState.SUCCEEDED, OK)
    cancelled = await store.cancel("b1", NOW)
    assert cancelled is not None and cancelled.state is JobState.CANCELLED
    assert await store.cancel("nope", NOW) is None
    assert await store.cancel_batch("batch_1", NOW) == 2
    assert await store.batch_counts("batch_1") == {JobState.SUCCEEDED: 1,
                                                   JobState.CANCELLED: 3}
    assert [j.spec.id for j in await store.batch_jobs("batch_1")] == ["b0", "b1", "b2", "b3"]
    assert [j.spec.custom_id for j in await store.batch_jobs("batch_2")] == ["c-other"]


async def test_enqueue_past_max_jobs_is_refused(store: JobStore) -> None:
    from kvgate.middleware.framework.errors import RateLimited
    await store.enqueue([spec(f"j{i}") for i in range(50)])
    with pytest.raises(RateLimited):
        await store.enqueue([spec("one-more")])


async def test_sqlite_claims_round_robin_between_tenants_after_priority(tmp_path: Path) -> None:
    store = SqliteJobStore(tmp_path / "jobs.sqlite")
    await store.open()
    try:
        await store.enqueue([spec(f"a{i}", tenant="a", created_at=NOW + i) for i in range(4)]
                            + [spec(f"b{i}", tenant="b", created_at=NOW + 10 + i)
                               for i in range(2)]
                            + [spec("urgent", tenant="a", created_at=NOW + 50, priority=5)])
        order = [j.spec.id for j in await store.claim("r", 10, 30.0, NOW)]
    finally:
        await store.close()
    # a tenant's urgent job is its first turn: b gets the next one
    assert order == ["urgent", "b0", "a0", "b1", "a1", "a2", "a3"]


async def test_sqlite_survives_reopen(tmp_path: Path) -> None:
    path = tmp_path / "jobs.sqlite"
    first = SqliteJobStore(path)
    await first.open()
    await first.enqueue([spec("a"), spec("b")])
    await first.claim("r", 1, 30.0, NOW)
    await first.finish("a", JobState.SUCCEEDED, OK)
    await first.close()
    second = SqliteJobStore(path)
    await second.open()
    try:
        assert (await second.get("a")).result == OK  # type: ignore[union-attr]
        assert (await second.get("b")).state is JobState.QUEUED  # type: ignore[union-attr]
    finally:
        await second.close()
