"""The session table shared between replicas (Redis, ``--redis``): a session's pinned engine as
``SET <prefix><digest> <engine> PX <ttl>`` behind a failure breaker, so that a Redis outage
costs one log line and falls back to rendezvous hashing (session_affinity.py)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from kvgate.middleware.framework.types import EndpointId
from kvgate.plugins.common.redis_retry import redis_errors, stale_connection_retry

log = logging.getLogger("kvgate.plugins.session_affinity")


@dataclass(slots=True)
class SessionStats:
    """Counters for tests and operators (read-only outside this module)."""

    sessions: int = 0
    rejected: int = 0
    table_hits: int = 0
    table_misses: int = 0
    table_errors: int = 0
    table_skipped: int = 0
    table_writes: int = 0
    writes_dropped: int = 0


class RedisLike(Protocol):
    """The three calls of ``redis.asyncio.Redis`` this plugin uses (a seam for tests)."""

    def get(self, name: str) -> Awaitable[bytes | str | None]: ...

    def set(self, name: str, value: str, *, px: int) -> Awaitable[object]: ...

    def aclose(self) -> Awaitable[None]: ...


def session_digest(key: str) -> str:
    """A session's scoped key as 32 hex digits (blake2b-128): what leaves the process for Redis,
    so no tenant or session id is stored or sent in clear."""
    return hashlib.blake2b(key.encode(), digest_size=16).hexdigest()


def table_key(prefix: str, key: str) -> str:
    """The Redis key of a session: a digest (:func:`session_digest`)."""
    return prefix + session_digest(key)


@dataclass(slots=True)
class _Breaker:
    """After a failure, Redis is not called again for ``retry_s``; one log line per outage."""

    retry_s: float
    down: bool = False
    retry_at: float = -math.inf

    def allows(self, now: float) -> bool:
        return now >= self.retry_at

    def failed(self, now: float) -> bool:
        """Record a failure; True when it starts an outage (log it)."""
        first = not self.down
        self.down = True
        self.retry_at = now + self.retry_s
        return first

    def succeeded(self) -> bool:
        """Record a success; True when it ends an outage."""
        ended = self.down
        self.down = False
        self.retry_at = -math.inf
        return ended


def _redis_errors() -> tuple[type[BaseException], ...]:
    return redis_errors()


class SessionTable:
    """Session pins in Redis (``SET key engine PX ttl``), behind a failure breaker.

    Background writes are tracked in a set capped at ``max_pending``; ``stop`` cancels them.
    """

    def __init__(
        self, client: RedisLike, *, prefix: str, ttl_s: float, timeout_s: float,
        retry_s: float, max_pending: int, stats: SessionStats,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self._prefix = prefix
        self._ttl_ms = max(1, round(ttl_s * 1000))
        self._timeout_s = timeout_s
        self._max_pending = max_pending
        self._breaker = _Breaker(retry_s)
        self._pending: set[asyncio.Task[None]] = set()
        self._errors = _redis_errors()
        self.stats = stats
        self.clock = clock

    async def get(self, key: str) -> EndpointId | None:
        """The pinned engine, or None (no pin, or Redis unavailable: fall back to HRW)."""
        if not self._breaker.allows(self.clock()):
            self.stats.table_skipped += 1
            return None
        try:
            raw = await asyncio.wait_for(
                self._client.get(table_key(self._prefix, key)), self._timeout_s
            )
        except self._errors as exc:
            self._failed("read", exc)
            return None
        self._succeeded()
        if raw is None:
            self.stats.table_misses += 1
            return None
        self.stats.table_hits += 1
        return raw if isinstance(raw, str) else raw.decode("utf-8", "replace")

    def put_later(self, key: str, engine: EndpointId) -> None:
        """Write the pin in the background so the request does not wait for Redis."""
        if not self._breaker.allows(self.clock()):
            self.stats.table_skipped += 1
            return
        if len(self._pending) >= self._max_pending:
            self.stats.writes_dropped += 1
            return
        task = asyncio.get_running_loop().create_task(self.put(key, engine))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def put(self, key: str, engine: EndpointId) -> None:
        try:
            await asyncio.wait_for(
                self._client.set(table_key(self._prefix, key), engine, px=self._ttl_ms),
                self._timeout_s,
            )
        except self._errors as exc:
            self._failed("write", exc)
            return
        self._succeeded()
        self.stats.table_writes += 1

    async def flush(self) -> None:
        """Wait for the background writes started so far (tests, shutdown)."""
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)

    async def close(self) -> None:
        for task in self._pending:
            task.cancel()
        await self.flush()
        await self._client.aclose()

    def _failed(self, what: str, exc: BaseException) -> None:
        self.stats.table_errors += 1
        if self._breaker.failed(self.clock()):
            # The URL may hold a password: name the error type only.
            log.warning(
                "session table unavailable (%s failed: %s); using rendezvous hashing only, "
                "retrying Redis every %.1f s", what, type(exc).__name__, self._breaker.retry_s,
            )

    def _succeeded(self) -> None:
        if self._breaker.succeeded():
            log.info("session table reachable again")

    @property
    def down(self) -> bool:
        return self._breaker.down


# -- the plugin --------------------------------------------------------------------------------


def connect_table(url: str, timeout_s: float) -> RedisLike:
    """A Redis client that does not retry (the breaker decides when to try again).

    Connecting is lazy: nothing happens on the network until the first command.
    """
    from redis.asyncio import Redis

    client: RedisLike = Redis.from_url(
        url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
        retry=stale_connection_retry(),
    )
    return client
