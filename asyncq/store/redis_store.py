"""``redis://host:port/db``: the job store shared by several gateway replicas.

Layout (prefix ``kvgate:aq``):

* ``job:{id}`` -- a hash: the spec, ``state``, ``attempts``, ``owner``, ``lease_until``,
  ``started_at``, ``entry`` (its stream entry) and, once terminal, the result. Terminal jobs
  expire after ``retention_s``.
* ``stream`` with consumer group ``runners`` -- one entry per job ready to run. A replica claims
  with ``XREADGROUP`` (each entry goes to one consumer); entries a dead replica held stay in
  the group's pending list and are taken over with ``XAUTOCLAIM`` once idle past the lease, and
  the job re-queued if its ``lease_until`` has passed (a live replica renews it).
* ``delayed`` (sorted set, by when) -- jobs waiting out a retry backoff; ``deadlines`` (sorted
  set) -- queued jobs with a deadline; ``batch:{id}`` (set) -- a batch's job ids; ``counts``
  (hash ``kind|state`` -> n) -- unfinished jobs, for metrics and ``max_jobs``.

Every state change is one Lua script (atomic on the server): a job is claimed by one replica,
and the first terminal write wins (``finish`` returns False to the later ones), so a job run
twice (at-least-once after a crash) has one result -- and, its id being the ledger's request
id, one ledger record.

Order: the stream is FIFO; priorities and tenant round-robin apply within each claimed window
(the runner's ordering), not across the whole queue as with SQLite.

Outage: any connection error or timeout is :class:`QueueUnavailable` (a submit gets 503 in
OpenAI's shape; the runner pauses pulling and logs once); nothing accepted is lost as long as
Redis itself keeps its data (run it with ``appendonly yes``; ``appendfsync always`` for no
loss on a power cut).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from kvgate.asyncq.api import TERMINAL, Job, JobResult, JobSpec, JobState, QueueUnavailable
from kvgate.asyncq.store.sqlite_store import cancelled_result, expired_result
from kvgate.middleware.framework.errors import RateLimited
from kvgate.plugins.common.redis_retry import stale_connection_retry

P = "kvgate:aq"
GROUP = "runners"
_ACTIVE = ("queued", "running")

# KEYS: job, stream, counts, deadlines, batch  ARGV: id, kind, deadline|'', retention, then
# field/value pairs. New job: hash, stream entry, counts, deadline, batch membership.
_ENQUEUE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local fields = {}
for i = 5, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], unpack(fields))
local entry = redis.call('XADD', KEYS[2], '*', 'id', ARGV[1])
redis.call('HSET', KEYS[1], 'state', 'queued', 'attempts', 0, 'entry', entry)
redis.call('HINCRBY', KEYS[3], ARGV[2] .. '|queued', 1)
if ARGV[3] ~= '' then redis.call('ZADD', KEYS[4], ARGV[3], ARGV[1]) end
if KEYS[5] ~= '' then redis.call('SADD', KEYS[5], ARGV[1]) end
return 1
"""

# KEYS: job, stream, counts, deadlines  ARGV: entry, consumer, lease_until, now
_CLAIM = """
local st = redis.call('HGET', KEYS[1], 'state')
if st ~= 'queued' or redis.call('HGET', KEYS[1], 'entry') ~= ARGV[1] then
  redis.call('XACK', KEYS[2], 'runners', ARGV[1])
  redis.call('XDEL', KEYS[2], ARGV[1])
  return 0
end
local kind = redis.call('HGET', KEYS[1], 'kind')
redis.call('HSET', KEYS[1], 'state', 'running', 'owner', ARGV[2], 'lease_until', ARGV[3],
           'started_at', ARGV[4])
redis.call('HINCRBY', KEYS[1], 'attempts', 1)
redis.call('HINCRBY', KEYS[3], kind .. '|queued', -1)
redis.call('HINCRBY', KEYS[3], kind .. '|running', 1)
redis.call('ZREM', KEYS[4], redis.call('HGET', KEYS[1], 'id'))
return 1
"""

# KEYS: job, stream, counts, deadlines  ARGV: state, retention, only_if ('' | state),
# then result field/value pairs. Terminal write, first one wins.
_FINISH = """
local st = redis.call('HGET', KEYS[1], 'state')
if st ~= 'queued' and st ~= 'running' then return 0 end
if ARGV[3] ~= '' and st ~= ARGV[3] then return 0 end
local kind = redis.call('HGET', KEYS[1], 'kind')
local fields = {'state', ARGV[1]}
for i = 4, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('HDEL', KEYS[1], 'owner', 'lease_until')
local entry = redis.call('HGET', KEYS[1], 'entry')
if entry then
  redis.call('XACK', KEYS[2], 'runners', entry)
  redis.call('XDEL', KEYS[2], entry)
end
redis.call('HINCRBY', KEYS[3], kind .. '|' .. st, -1)
redis.call('ZREM', KEYS[4], redis.call('HGET', KEYS[1], 'id'))
redis.call('EXPIRE', KEYS[1], ARGV[2])
return 1
"""

# KEYS: job, stream, delayed, counts  ARGV: consumer ('' = any), available_at, now,
# only_if_lease_lapsed ('1'/'0'), pending entry ('' = none). Back to queued: a new stream
# entry now, or delayed. A queued job whose entry was delivered to a replica that died before
# claiming it gets a new entry.
_REQUEUE = """
local st = redis.call('HGET', KEYS[1], 'state')
if st == 'queued' and ARGV[5] ~= '' and redis.call('HGET', KEYS[1], 'entry') == ARGV[5] then
  redis.call('XACK', KEYS[2], 'runners', ARGV[5])
  redis.call('XDEL', KEYS[2], ARGV[5])
  local fresh = redis.call('XADD', KEYS[2], '*', 'id', redis.call('HGET', KEYS[1], 'id'))
  redis.call('HSET', KEYS[1], 'entry', fresh)
  return 1
end
if st ~= 'running' then return 0 end
if ARGV[1] ~= '' and redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
if ARGV[4] == '1' and tonumber(redis.call('HGET', KEYS[1], 'lease_until') or '0')
    >= tonumber(ARGV[3]) then return 0 end
local id = redis.call('HGET', KEYS[1], 'id')
local kind = redis.call('HGET', KEYS[1], 'kind')
local old = redis.call('HGET', KEYS[1], 'entry')
if old then
  redis.call('XACK', KEYS[2], 'runners', old)
  redis.call('XDEL', KEYS[2], old)
end
redis.call('HSET', KEYS[1], 'state', 'queued', 'entry', '')
redis.call('HDEL', KEYS[1], 'owner', 'lease_until')
redis.call('HINCRBY', KEYS[4], kind .. '|running', -1)
redis.call('HINCRBY', KEYS[4], kind .. '|queued', 1)
if tonumber(ARGV[2]) > tonumber(ARGV[3]) then
  redis.call('ZADD', KEYS[3], ARGV[2], id)
else
  local entry = redis.call('XADD', KEYS[2], '*', 'id', id)
  redis.call('HSET', KEYS[1], 'entry', entry)
end
return 1
"""

# KEYS: job, stream, delayed  ARGV: id. A delayed job whose backoff is over: a stream entry.
_UNDELAY = """
redis.call('ZREM', KEYS[3], ARGV[1])
if redis.call('HGET', KEYS[1], 'state') ~= 'queued' then return 0 end
local entry = redis.call('XADD', KEYS[2], '*', 'id', ARGV[1])
redis.call('HSET', KEYS[1], 'entry', entry)
return 1
"""


def _k(kind: str, *parts: str) -> str:
    return ":".join((P, kind, *parts))


def _s(raw: Mapping[bytes, bytes], name: str) -> str | None:
    value = raw.get(name.encode())
    return None if value is None or value == b"" else value.decode()


def _f(raw: Mapping[bytes, bytes], name: str) -> float | None:
    value = _s(raw, name)
    return None if value is None else float(value)


def _job(raw: Mapping[bytes, bytes]) -> Job:
    spec = JobSpec(
        id=_s(raw, "id") or "", kind=_s(raw, "kind") or "", method=_s(raw, "method") or "",
        path=_s(raw, "path") or "", body=raw.get(b"body", b""), tenant=_s(raw, "tenant"),
        key_id=_s(raw, "key_id"), created_at=_f(raw, "created_at") or 0.0,
        deadline=_f(raw, "deadline"), priority=int(_s(raw, "priority") or 0),
        batch_id=_s(raw, "batch_id"), custom_id=_s(raw, "custom_id"),
        prefix_key=_s(raw, "prefix_key") or "")
    result = None
    status = _s(raw, "res_status")
    if status is not None:
        result = JobResult(int(status), raw.get(b"res_body", b""),
                           _s(raw, "res_ct") or "application/json", _s(raw, "res_engine"),
                           _f(raw, "finished_at") or 0.0)
    return Job(spec, JobState(_s(raw, "state") or "queued"), int(_s(raw, "attempts") or 0),
               result, _f(raw, "started_at"), _s(raw, "owner"))


def _spec_fields(s: JobSpec) -> list[Any]:
    fields: list[Any] = ["id", s.id, "kind", s.kind, "method", s.method, "path", s.path,
                         "body", s.body, "created_at", repr(s.created_at),
                         "priority", s.priority, "prefix_key", s.prefix_key]
    for name, value in (("tenant", s.tenant), ("key_id", s.key_id),
                        ("batch_id", s.batch_id), ("custom_id", s.custom_id)):
        if value is not None:
            fields += [name, value]
    if s.deadline is not None:
        fields += ["deadline", repr(s.deadline)]
    return fields


def _result_fields(r: JobResult) -> list[Any]:
    return ["res_status", r.status, "res_body", r.body, "res_ct", r.content_type,
            "res_engine", r.engine or "", "finished_at", repr(r.finished_at)]


class RedisJobStore:
    """See the module docstring. ``timeout_s`` bounds every call (an outage is noticed within
    it): 2 s, far above a healthy Redis round trip, short enough that a submit fails fast."""

    backend = "redis"

    def __init__(self, url: str, *, retention_s: float = 30 * 86400,
                 max_jobs: int = 1_000_000, timeout_s: float = 2.0) -> None:
        self.url = url
        self.retention_s = int(retention_s)
        self.max_jobs = max_jobs
        #: Typed Any: redis-py's stubs type replies as bytes | str for either decode mode.
        #: A pooled connection Redis closed (a restart) is retried once on a fresh one, as the
        #: gateway's other Redis clients do: one outage is one outage, not one per stale socket.
        self._r: Any = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=stale_connection_retry())
        self._error: str | None = None
        self._group_ready = False
        self._enqueue = self._r.register_script(_ENQUEUE)
        self._claim = self._r.register_script(_CLAIM)
        self._finish = self._r.register_script(_FINISH)
        self._requeue = self._r.register_script(_REQUEUE)
        self._undelay = self._r.register_script(_UNDELAY)
        self.stream, self.counts_key = _k("stream"), _k("counts")
        self.delayed, self.deadlines = _k("delayed"), _k("deadlines")

    def _fail(self, exc: Exception) -> QueueUnavailable:
        self._error = f"{type(exc).__name__}: {exc}"
        self._group_ready = False
        return QueueUnavailable(f"job store (redis) unavailable: {self._error}")

    def _ok(self) -> None:
        self._error = None

    async def _group(self) -> None:
        if self._group_ready:
            return
        try:
            await self._r.xgroup_create(self.stream, GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._group_ready = True

    async def open(self) -> None:
        try:
            await self._group()
            self._ok()
        except RedisError as exc:
            self._fail(exc)  # started during an outage: the runner retries

    async def close(self) -> None:
        await self._r.aclose()

    async def enqueue(self, specs: Sequence[JobSpec]) -> int:
        try:
            await self._group()
            counts = await self._r.hgetall(self.counts_key)
            active = sum(int(v) for k, v in counts.items()
                         if k.decode().rsplit("|", 1)[-1] in _ACTIVE)
            if active + len(specs) > self.max_jobs:
                raise RateLimited(f"the queue holds {active} unfinished jobs (at most "
                                  f"{self.max_jobs}); retry later", code="queue_full")
            new = 0
            async with self._r.pipeline(transaction=False) as pipe:
                for s in specs:
                    keys = [_k("job", s.id), self.stream, self.counts_key, self.deadlines,
                            _k("batch", s.batch_id) if s.batch_id else ""]
                    args = [s.id, s.kind, "" if s.deadline is None else repr(s.deadline),
                            self.retention_s, *_spec_fields(s)]
                    await self._enqueue(keys=keys, args=args, client=pipe)
                new = sum(int(x) for x in await pipe.execute())
            self._ok()
            return new
        except RedisError as exc:
            raise self._fail(exc) from None

    async def claim(self, consumer: str, limit: int, lease_s: float,
                    now: float) -> Sequence[Job]:
        try:
            await self._group()
            found = await self._r.xreadgroup(GROUP, consumer, {self.stream: ">"}, count=limit)
            jobs: list[Job] = []
            for _, entries in found or []:
                for entry, fields in entries:
                    job_id = fields[b"id"].decode()
                    key = _k("job", job_id)
                    got = await self._claim(
                        keys=[key, self.stream, self.counts_key, self.deadlines],
                        args=[entry, consumer, repr(now + lease_s), repr(now)])
                    if got:
                        jobs.append(_job(await self._r.hgetall(key)))
            self._ok()
            return jobs
        except RedisError as exc:
            raise self._fail(exc) from None

    async def renew(self, consumer: str, job_ids: Sequence[str], lease_s: float,
                    now: float) -> None:
        try:
            async with self._r.pipeline(transaction=False) as pipe:
                for job_id in job_ids:
                    pipe.hset(_k("job", job_id), "lease_until", repr(now + lease_s))
                await pipe.execute()
            self._ok()
        except RedisError as exc:
            raise self._fail(exc) from None

    async def _terminal(self, job_id: str, state: JobState, result: JobResult | None,
                        only_if: str = "") -> bool:
        fields = [] if result is None else _result_fields(result)
        try:
            done = await self._finish(
                keys=[_k("job", job_id), self.stream, self.counts_key, self.deadlines],
                args=[str(state), self.retention_s, only_if, *fields])
            self._ok()
            return bool(done)
        except RedisError as exc:
            raise self._fail(exc) from None

    async def finish(self, job_id: str, state: JobState, result: JobResult | None) -> bool:
        assert state in TERMINAL
        return await self._terminal(job_id, state, result)

    async def release(self, job_id: str, consumer: str, delay_s: float = 0.0) -> bool:
        now = time.time()
        try:
            done = await self._requeue(
                keys=[_k("job", job_id), self.stream, self.delayed, self.counts_key],
                args=[consumer, repr(now + delay_s), repr(now), "0", ""])
            self._ok()
            return bool(done)
        except RedisError as exc:
            raise self._fail(exc) from None

    async def cancel(self, job_id: str, now: float) -> Job | None:
        await self._terminal(job_id, JobState.CANCELLED, cancelled_result(now))
        return await self.get(job_id)

    async def cancel_batch(self, batch_id: str, now: float) -> int:
        ids = await self._members(batch_id)
        n = 0
        for job_id in ids:
            n += int(await self._terminal(job_id, JobState.CANCELLED, cancelled_result(now)))
        return n

    async def get(self, job_id: str) -> Job | None:
        try:
            raw = await self._r.hgetall(_k("job", job_id))
            self._ok()
        except RedisError as exc:
            raise self._fail(exc) from None
        return _job(raw) if raw else None

    async def _members(self, batch_id: str) -> list[str]:
        try:
            return sorted(m.decode() for m in await self._r.smembers(_k("batch", batch_id)))
        except RedisError as exc:
            raise self._fail(exc) from None

    async def batch_jobs(self, batch_id: str) -> Sequence[Job]:
        ids = await self._members(batch_id)
        try:
            async with self._r.pipeline(transaction=False) as pipe:
                for job_id in ids:
                    pipe.hgetall(_k("job", job_id))
                rows = await pipe.execute()
        except RedisError as exc:
            raise self._fail(exc) from None
        jobs = [_job(r) for r in rows if r]
        return sorted(jobs, key=lambda j: (j.spec.created_at, j.spec.id))

    async def batch_counts(self, batch_id: str) -> Mapping[JobState, int]:
        out: dict[JobState, int] = {}
        for job in await self.batch_jobs(batch_id):
            out[job.state] = out.get(job.state, 0) + 1
        return out

    async def counts(self) -> Mapping[tuple[str, JobState], int]:
        try:
            raw = await self._r.hgetall(self.counts_key)
        except RedisError as exc:
            raise self._fail(exc) from None
        out: dict[tuple[str, JobState], int] = {}
        for k, v in raw.items():
            kind, _, state = k.decode().rpartition("|")
            if int(v) > 0:
                out[(kind, JobState(state))] = int(v)
        return out

    async def reap(self, now: float) -> Sequence[Job]:
        try:
            await self._group()
            changed = await self._reclaim(now)
            for raw_id in await self._r.zrangebyscore(self.delayed, "-inf", repr(now)):
                job_id = raw_id.decode()
                await self._undelay(keys=[_k("job", job_id), self.stream, self.delayed],
                                    args=[job_id])
            for raw_id in await self._r.zrangebyscore(self.deadlines, "-inf", repr(now)):
                job_id = raw_id.decode()
                if await self._terminal(job_id, JobState.EXPIRED, expired_result(now),
                                        only_if="queued"):
                    job = await self.get(job_id)
                    if job is not None:
                        changed.append(job)
                else:
                    await self._r.zrem(self.deadlines, job_id)
            self._ok()
            return changed
        except RedisError as exc:
            raise self._fail(exc) from None

    async def _reclaim(self, now: float) -> list[Job]:
        """Pending entries idle past a second whose job's lease lapsed: back to the queue."""
        changed: list[Job] = []
        start: Any = "0-0"
        while True:
            reply = await self._r.xautoclaim(self.stream, GROUP, "kvgate-reaper", 1000,
                                             start_id=start, count=100)
            start, entries = reply[0], reply[1]
            for entry, fields in entries:
                if not fields:  # deleted meanwhile
                    await self._r.xack(self.stream, GROUP, entry)
                    continue
                job_id = fields[b"id"].decode()
                if await self._requeue(
                        keys=[_k("job", job_id), self.stream, self.delayed, self.counts_key],
                        args=["", repr(now), repr(now), "1", entry]):
                    job = await self.get(job_id)
                    if job is not None:
                        changed.append(job)
            if start in (b"0-0", "0-0"):
                return changed

    def health(self) -> Mapping[str, object]:
        return {"backend": self.backend, "ok": self._error is None,
                **({"error": self._error} if self._error else {})}


__all__ = ["RedisJobStore"]
