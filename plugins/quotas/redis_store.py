"""The shared quota store: Redis, one Lua script per admission and one per settlement.

A script runs atomically on the server, so the admission of a request checks every scope
(its key and its tenant) and every dimension, then reserves in all of them, with no other
replica's admission in between: a budget's last dollar or a bucket's last token goes to one
request, whichever replica it came through.

Keys per scope ``S`` (``key:<id>``, ``tenant:<name>``), under ``prefix`` (default
``kvgate:{quota}:``; the ``{quota}`` hash tag keeps them in one Redis Cluster slot, as the
scripts need):

* ``b:S`` hash — the three token buckets (``r``/``i``/``o`` + ``l`` level, ``t`` time in ms);
  expires 120 s after its last use (an idle bucket is full after 60 s: forgetting it is exact).
* ``f:S`` sorted set — in-flight leases: request id scored by its deadline (ms); a lease past
  its deadline (a replica died mid-request) is swept by the next admission. ``a:S`` hash —
  the cost units each lease reserved. Both expire a minute after the latest lease.
* ``d:S`` hash — ``spent`` and ``reserved`` cost units (1e-10 USD). Never expires (money);
  ``spent`` absent means "not seeded": the admission answers so and the caller seeds it from
  the ledger with ``HSETNX`` (several replicas seeding at once agree: the first one wins).

Time is Redis's own clock (``TIME`` in the scripts): replicas on hosts whose clocks differ
still share one bucket refill. Redis errors and timeouts raise :class:`StoreDown`; the caller
applies the outage policy.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import Any, Protocol

from kvgate.plugins.common.redis_retry import redis_errors, stale_connection_retry
from kvgate.plugins.quotas.model import Ask, Quota, Settlement, Verdict

ADMIT_LUA = """
local now, rid, deadline, n, bttl = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3]),
  tonumber(ARGV[4]), tonumber(ARGV[5])
if redis.replicate_commands then redis.replicate_commands() end
local clock = redis.call('TIME')
now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
deadline = now + deadline
local dims, names = {'r', 'i', 'o'}, {'requests', 'input_tokens', 'output_tokens'}
local levels = {}
for s = 0, n - 1 do
  local a, kb, kf, ka, kd = 6 + s * 9, KEYS[s*4+1], KEYS[s*4+2], KEYS[s*4+3], KEYS[s*4+4]
  for d = 1, 3 do
    local lim = tonumber(ARGV[a + d - 1])
    if lim > 0 then
      local v = redis.call('HMGET', kb, dims[d] .. 'l', dims[d] .. 't')
      local level, at = tonumber(v[1]), tonumber(v[2])
      if level == nil then level, at = lim, now end
      level = math.min(lim, level + (now - at) * lim / 60000)
      local amt = 1
      if d > 1 then amt = tonumber(ARGV[a + 3 + d]) end
      local need = math.min(amt, lim)
      if level < need then
        return {0, s, names[d], math.ceil((need - level) * 60000 / lim)}
      end
      levels[s * 3 + d] = {level, amt, lim}
    end
  end
  local expired = redis.call('ZRANGEBYSCORE', kf, '-inf', now, 'LIMIT', 0, 64)
  for _, m in ipairs(expired) do
    local amt = redis.call('HGET', ka, m)
    if amt then
      redis.call('HINCRBY', kd, 'reserved', -tonumber(amt))
      redis.call('HDEL', ka, m)
    end
    redis.call('ZREM', kf, m)
  end
  local conc = tonumber(ARGV[a + 3])
  if conc > 0 and redis.call('ZCARD', kf) >= conc then return {0, s, 'concurrent', 1000} end
  local budget = tonumber(ARGV[a + 4])
  if budget >= 0 then
    local v = redis.call('HMGET', kd, 'spent', 'reserved')
    if v[1] == false then return {-1, s} end
    if tonumber(v[1]) + tonumber(v[2] or '0') >= budget then return {0, s, 'budget', 0} end
  end
end
local out = {1, 0, 0, 0, 0, 0, 0}
for s = 0, n - 1 do
  local a, kb, kf, ka, kd = 6 + s * 9, KEYS[s*4+1], KEYS[s*4+2], KEYS[s*4+3], KEYS[s*4+4]
  for d = 1, 3 do
    local e = levels[s * 3 + d]
    if e then
      local level, lim = e[1] - e[2], e[3]
      redis.call('HSET', kb, dims[d] .. 'l', level, dims[d] .. 't', now)
      local rem, reset = math.max(0, math.floor(level)), math.ceil((lim - level) * 60000 / lim)
      local o = 2
      if d > 1 then o = 5 end
      if out[o] == 0 or rem / lim < out[o + 1] / out[o] then
        out[o], out[o + 1], out[o + 2] = lim, rem, reset
      end
    end
  end
  redis.call('PEXPIRE', kb, bttl)
  if ARGV[a + 8] == '1' then
    redis.call('ZADD', kf, deadline, rid)
    redis.call('PEXPIRE', kf, deadline - now + 60000)
    if tonumber(ARGV[a + 4]) >= 0 then
      redis.call('HSET', ka, rid, ARGV[a + 7])
      redis.call('PEXPIRE', ka, deadline - now + 60000)
      redis.call('HINCRBY', kd, 'reserved', ARGV[a + 7])
    end
  end
end
return out
"""

SETTLE_LUA = """
local now, rid, n = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3])
if redis.replicate_commands then redis.replicate_commands() end
local clock = redis.call('TIME')
now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local dims = {'r', 'i', 'o'}
for s = 0, n - 1 do
  local a, kb, kf, ka, kd = 4 + s * 5, KEYS[s*4+1], KEYS[s*4+2], KEYS[s*4+3], KEYS[s*4+4]
  for d = 2, 3 do
    local lim, delta = tonumber(ARGV[a + d - 2]), tonumber(ARGV[a + d])
    if lim > 0 and delta ~= 0 then
      local v = redis.call('HMGET', kb, dims[d] .. 'l', dims[d] .. 't')
      if v[1] then
        local level = math.min(lim, tonumber(v[1]) + (now - tonumber(v[2])) * lim / 60000)
        redis.call('HSET', kb, dims[d] .. 'l', math.min(lim, level - delta), dims[d] .. 't', now)
      end
    end
  end
  redis.call('ZREM', kf, rid)
  local amt = redis.call('HGET', ka, rid)
  if amt then
    redis.call('HDEL', ka, rid)
    redis.call('HINCRBY', kd, 'reserved', -tonumber(amt))
  end
  if ARGV[a + 4] ~= '0' and redis.call('HEXISTS', kd, 'spent') == 1 then
    redis.call('HINCRBY', kd, 'spent', ARGV[a + 4])
  end
end
return 1
"""

#: An idle bucket is full after one window (60 s); kept twice that, then forgotten.
BUCKET_TTL_MS = 120_000


class StoreDown(Exception):
    """Redis did not answer (error or timeout): the caller's outage policy applies."""


class Unseeded(Exception):
    """A budgeted scope has no spend in Redis yet: seed it from the ledger, then retry."""

    def __init__(self, scope: str) -> None:
        super().__init__(scope)
        self.scope = scope


class ScriptClient(Protocol):
    """What the store needs of ``redis.asyncio.Redis`` (a seam for tests)."""

    def register_script(self, script: str) -> Any: ...

    def hsetnx(self, name: str, key: str, value: str) -> Awaitable[Any]: ...

    def ping(self) -> Awaitable[Any]: ...

    def aclose(self) -> Awaitable[None]: ...


class RedisStore:
    """See the module docstring. Every call is bounded by ``timeout_s``."""

    def __init__(self, client: ScriptClient, *, prefix: str, timeout_s: float) -> None:
        self._client = client
        self.prefix = prefix
        self.timeout_s = timeout_s
        self._admit = client.register_script(ADMIT_LUA)
        self._settle = client.register_script(SETTLE_LUA)
        self._errors = _redis_errors()

    def _keys(self, ask: Ask) -> list[str]:
        return [f"{self.prefix}{kind}:{lim.scope}" for lim in ask.scopes for kind in "bfad"]

    async def _call(self, aw: Awaitable[Any]) -> Any:
        try:
            return await asyncio.wait_for(aw, self.timeout_s)
        except self._errors as exc:
            raise StoreDown(f"{type(exc).__name__}: {str(exc)[:200]}") from None

    async def admit(self, ask: Ask, now_ms: int) -> Verdict:
        args: list[str | int] = [now_ms, ask.request_id, ask.lease_ms, len(ask.scopes),
                                 BUCKET_TTL_MS]
        for lim in ask.scopes:
            args += [*lim.bucket_limits, lim.max_concurrent, lim.budget_units, ask.input_tokens,
                     ask.output_tokens, ask.cost_units if lim.has_budget else 0,
                     int(lim.needs_lease)]
        out = await self._call(self._admit(keys=self._keys(ask), args=args))
        return _verdict(ask, out)

    async def settle(self, ask: Ask, used: Settlement, now_ms: int) -> None:
        args: list[str | int] = [now_ms, ask.request_id, len(ask.scopes)]
        for lim in ask.scopes:
            _, in_lim, out_lim = lim.bucket_limits
            args += [in_lim, out_lim, used.input_tokens - ask.input_tokens,
                     used.output_tokens - ask.output_tokens, used.cost_units]
        await self._call(self._settle(keys=self._keys(ask), args=args))

    async def seed(self, spent_units: dict[str, int]) -> None:
        for scope, units in spent_units.items():
            await self._call(self._client.hsetnx(f"{self.prefix}d:{scope}", "spent", str(units)))

    async def ping(self) -> None:
        await self._call(self._client.ping())

    async def close(self) -> None:
        await self._client.aclose()


def _verdict(ask: Ask, out: Sequence[Any]) -> Verdict:
    code = int(out[0])
    if code == -1:
        raise Unseeded(ask.scopes[int(out[1])].scope)
    if code == 0:
        dim = out[2].decode() if isinstance(out[2], bytes) else str(out[2])
        return Verdict(False, ask.scopes[int(out[1])].scope, dim, int(out[3]))
    vals = [int(v) for v in out[1:7]]
    reqs = Quota(*vals[0:3]) if vals[0] > 0 else None
    toks = Quota(*vals[3:6]) if vals[3] > 0 else None
    return Verdict(True, requests=reqs, tokens=toks)


def _redis_errors() -> tuple[type[BaseException], ...]:
    return redis_errors()


def connect(url: str, timeout_s: float) -> ScriptClient:
    """A client that does not retry (the caller's breaker decides when to try again);
    connecting is lazy."""
    from redis.asyncio import Redis

    client: ScriptClient = Redis.from_url(
        url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
        retry=stale_connection_retry())
    return client
