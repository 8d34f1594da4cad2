"""State ids shared between replicas through Redis (``kvgate serve --redis URL`` or
``shared_state.redis_url``): docs/security.md, "Ids a client sends".

Each id the gateway hands out (an OpenAI Responses ``id``) is written as the Redis string
``kvgate:state:<id>`` = ``{"e": engine, "t": tenant}`` with ``PX`` = ``state_ids_ttl_s``
(default 24 h): so a client's next turn, landing on another replica or ``--workers`` process,
is pinned to the engine that holds its state and refused to every other tenant. Bounded by the
TTL (about 150 bytes of Redis memory per id while it lives); each process's
:class:`~kvgate.middleware.serving.states.StateMap` stays the cache in front (ownership never
changes, so a cached entry never goes stale).

Redis down (an error or no answer within ``TIMEOUT_S``): reads raise :class:`StateStoreDown`
(the caller fails closed for ids it does not hold itself: a 503, ``state_store_unavailable``,
when API keys are on); writes are kept in a bounded queue (``MAX_PENDING``, the oldest dropped
and counted) that a task sends once Redis answers again. Redis is not asked again for
``RETRY_S`` after a failure (no request waits on a dead Redis more than once a second). One
WARNING per outage, one INFO when it ends; ``/health`` (``state_ids``) and ``/metrics``
(``kvgate_state_ids_shared_up``) say so meanwhile.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvgate.middleware.framework.errors import ConfigError

log = logging.getLogger("kvgate.states")

#: Default lifetime of an id in Redis [s]: a conversation continued within a day resolves
#: on every replica; later, only on the replicas whose cache still holds it.
DEFAULT_TTL_S = 86_400.0
KEY_PREFIX = "kvgate:state:"
#: Bound on one Redis call [s], and how long Redis is left alone after a failure [s].
TIMEOUT_S = 0.5
RETRY_S = 1.0
#: Writes kept while Redis is down (the oldest dropped first).
MAX_PENDING = 10_000
#: Longer ids are never looked up (no engine hands them out; a client's junk stays local).
MAX_ID_CHARS = 256


class StateStoreDown(Exception):
    """Redis did not answer a read (or is resting after a failure)."""


@dataclass(slots=True)
class SharedStats:
    """Counters for /metrics and the outage for /health."""

    written: int = 0
    found: int = 0
    missing: int = 0
    read_errors: int = 0
    write_errors: int = 0
    dropped: int = 0
    down_since: float | None = None
    error: str | None = None


def encode(engine: str, tenant: str | None) -> str:
    return json.dumps({"e": engine, "t": tenant}, separators=(",", ":"))


def decode(raw: Any) -> tuple[str, str | None] | None:
    """(engine, tenant) of a stored value; None if absent or malformed."""
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
    except (ValueError, TypeError):
        return None
    engine, tenant = (doc.get("e"), doc.get("t")) if isinstance(doc, dict) else (None, None)
    if not isinstance(engine, str) or not (tenant is None or isinstance(tenant, str)):
        return None
    return engine, tenant


def connect(url: str, timeout_s: float) -> tuple[Any, tuple[type[BaseException], ...]]:
    """A Redis client bounded by ``timeout_s`` per call (a stale pooled connection retried
    once, at once), and what its failures raise."""
    try:
        from redis.asyncio import Redis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff
        from redis.exceptions import ConnectionError as RedisConnectionError
        from redis.exceptions import RedisError
    except ImportError:
        raise ConfigError("shared_state.redis_url needs the 'redis' package "
                          "(pip install 'kvgate[redis]')") from None
    client = Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                            retry=Retry(NoBackoff(), 1), retry_on_error=[RedisConnectionError])
    return client, (RedisError, OSError, TimeoutError, RuntimeError)


class SharedStates:
    """The Redis side of the state-id map (module docstring)."""

    def __init__(self, url: str, ttl_s: float = DEFAULT_TTL_S, *, prefix: str = KEY_PREFIX,
                 timeout_s: float = TIMEOUT_S, retry_s: float = RETRY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._client, self._errors = connect(url, timeout_s)
        self.ttl_s = ttl_s
        self._prefix = prefix
        self._retry_s = retry_s
        self._clock = clock
        self._retry_at = 0.0
        self._pending: deque[tuple[str, str]] = deque(maxlen=MAX_PENDING)
        self._flush: asyncio.Task[None] | None = None
        self.stats = SharedStats()

    @property
    def up(self) -> bool:
        return self.stats.down_since is None

    def _resting(self) -> bool:
        return not self.up and self._clock() < self._retry_at

    async def put(self, state_id: str, engine: str, tenant: str | None) -> None:
        """Record an id (never raises: while Redis is down it waits in the queue)."""
        value = encode(engine, tenant)
        if self._resting():
            self._queue(state_id, value)
            return
        try:
            await self._client.set(self._prefix + state_id, value, px=int(self.ttl_s * 1000))
        except self._errors as exc:
            self.stats.write_errors += 1
            self._queue(state_id, value)
            self._failed(exc)
            return
        self.stats.written += 1
        self._recovered()

    async def get(self, state_id: str) -> tuple[str, str | None] | None:
        """(engine, tenant) of ``state_id`` if some replica recorded it (StateStoreDown)."""
        if len(state_id) > MAX_ID_CHARS:
            return None
        if self._resting():
            raise StateStoreDown()
        try:
            raw = await self._client.get(self._prefix + state_id)
        except self._errors as exc:
            self.stats.read_errors += 1
            self._failed(exc)
            raise StateStoreDown() from None
        self._recovered()
        found = decode(raw)
        if found is None:
            self.stats.missing += 1
        else:
            self.stats.found += 1
        return found

    def _queue(self, state_id: str, value: str) -> None:
        """Keep a write for later; a task sends the queue as soon as Redis answers."""
        if len(self._pending) == self._pending.maxlen:
            self.stats.dropped += 1
        self._pending.append((state_id, value))
        if self._flush is None or self._flush.done():
            self._flush = asyncio.create_task(self._drain(), name="kvgate-state-ids")

    def _failed(self, exc: BaseException) -> None:
        self._retry_at = self._clock() + self._retry_s
        self.stats.error = type(exc).__name__
        if self.stats.down_since is None:
            self.stats.down_since = time.time()
            log.warning("state ids: Redis is unavailable (%s): ids not held by this process "
                        "are refused (503) until it is back; new ids wait to be written",
                        type(exc).__name__)

    def _recovered(self) -> None:
        if self.stats.down_since is not None:
            self.stats.down_since = self.stats.error = None
            log.info("state ids: Redis is back; writing %d queued ids", len(self._pending))

    async def _drain(self) -> None:
        """Send the queued writes (in batches of 500), waiting out each failure's rest."""
        ttl_ms = int(self.ttl_s * 1000)
        while self._pending:
            await asyncio.sleep(max(0.0, self._retry_at - self._clock()))
            batch = [self._pending.popleft() for _ in range(min(500, len(self._pending)))]
            try:
                async with self._client.pipeline(transaction=False) as pipe:
                    for state_id, value in batch:
                        pipe.set(self._prefix + state_id, value, px=ttl_ms)
                    await pipe.execute()
            except self._errors as exc:
                self.stats.write_errors += 1
                self._pending.extendleft(reversed(batch))
                self._failed(exc)
                continue
            self.stats.written += len(batch)
            self._recovered()

    def health(self) -> dict[str, object]:
        s = self.stats
        out: dict[str, object] = {"shared": "redis", "ok": self.up, "ttl_s": self.ttl_s,
                                  "pending_writes": len(self._pending)}
        if s.down_since is not None:
            out.update(down_since=s.down_since, error=f"Redis unavailable ({s.error}): ids "
                       "not held by this process are refused (503)")
        return out

    async def close(self) -> None:
        task, self._flush = self._flush, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await self._client.aclose()


__all__ = ["DEFAULT_TTL_S", "KEY_PREFIX", "SharedStates", "StateStoreDown", "decode", "encode"]
