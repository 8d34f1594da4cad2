"""A replica's small state changes told to the other replicas through Redis publish/subscribe
(the shared approximate record, plugins/prefix/shared_record.py; the placement's session
memory, plugins/placement/shared.py).

:meth:`Broadcast.send` queues one JSON-able item; a background task sends the queue every
``flush_s`` as one message ``{"from": <replica>, "items": [...]}`` on the channel
(``PUBLISH``), and a subscriber task hands every item of every *other* replica's messages to
``receive`` (which validates it: a malformed item is the receiver's to skip). Nothing is kept in
Redis: a replica that starts later learns from the traffic from then on.

Bounded: at most ``max_pending`` items wait to be sent (the oldest is dropped and counted when
Redis is slow). Redis down: items are dropped (counted), each replica keeps routing on its own
state, one WARNING per outage, ``health()`` says ``degraded``; the subscriber reconnects every
``retry_s``. Requests never wait for Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvgate.middleware.framework.tasks import cancel_and_wait
from kvgate.plugins.common.redis_retry import redis_errors, stale_connection_retry

log = logging.getLogger("kvgate.plugins.broadcast")

#: Takes one item of another replica; True when it was applied (counted as received).
Receive = Callable[[Any], bool]


@dataclass(slots=True)
class BroadcastStats:
    """Items published, skipped as repeats (by the sender's own rule), received from others,
    dropped; failed calls; outage flag."""

    published: int = 0
    repeats: int = 0
    received: int = 0
    dropped: int = 0
    errors: int = 0
    down: bool = False


@dataclass(frozen=True, slots=True)
class Channel:
    """Where and how: the channel's name, the health key, and what a replica does without it
    (the log line's and ``/health``'s words)."""

    name: str
    health_key: str
    label: str  # "shared prefix record"
    fallback: str  # "this replica's own record"


def items_of(raw: Any, me: str) -> list[Any]:
    """The items of another replica's message; [] for ours or a malformed one."""
    try:
        doc = json.loads(raw)
    except (ValueError, TypeError):
        return []
    if not isinstance(doc, dict) or doc.get("from") == me:
        return []
    items = doc.get("items")
    return items if isinstance(items, list) else []


class Broadcast:
    """Sends this replica's items and hands the others' to ``receive`` (module docstring)."""

    def __init__(
        self, publisher: Any, subscriber: Any, receive: Receive, channel: Channel, *,
        me: str, flush_s: float, timeout_s: float, retry_s: float, max_pending: int,
    ) -> None:
        self._pub = publisher
        self._sub = subscriber
        self._receive = receive
        self.channel = channel
        self.me = me
        self.flush_s = flush_s
        self._timeout_s = timeout_s
        self._retry_s = retry_s
        self._pending: deque[Any] = deque(maxlen=max_pending)
        self.stats = BroadcastStats()
        self._tasks: list[asyncio.Task[None]] = []
        self._errors: tuple[type[BaseException], ...] = redis_errors()

    def send(self, item: Any) -> None:
        """Queue ``item`` for the next flush (the oldest is dropped when full)."""
        if len(self._pending) == self._pending.maxlen:
            self.stats.dropped += 1
        self._pending.append(item)

    def drain(self) -> list[Any]:
        """What is queued, taken out (the next flush's items; a simulation's bus)."""
        items = list(self._pending)
        self._pending.clear()
        return items

    async def flush(self) -> None:
        """Send what is queued as one message."""
        if not self._pending:
            return
        items = self.drain()
        message = json.dumps({"from": self.me, "items": items}, separators=(",", ":"))
        try:
            await asyncio.wait_for(self._pub.publish(self.channel.name, message),
                                   self._timeout_s)
        except self._errors as exc:
            self.stats.dropped += len(items)
            self._failed(exc)
            return
        self.stats.published += len(items)
        self._recovered()

    async def _flusher(self) -> None:
        while True:
            await asyncio.sleep(self.flush_s)
            await self.flush()

    async def _listener(self) -> None:
        while True:
            try:
                await self._listen()
            except self._errors as exc:
                self._failed(exc)
            await asyncio.sleep(self._retry_s)

    async def _listen(self) -> None:
        pubsub = self._sub.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(self.channel.name)
            self._recovered()
            async for message in pubsub.listen():
                if message.get("type") != "message":
                    continue
                for item in items_of(message.get("data"), self.me):
                    if self._receive(item):
                        self.stats.received += 1
        finally:
            with contextlib.suppress(*self._errors):
                await pubsub.aclose()

    def _failed(self, exc: BaseException) -> None:
        self.stats.errors += 1
        if not self.stats.down:
            self.stats.down = True
            # The URL may hold a password: name the error type only.
            log.warning("%s: Redis unavailable (%s); %s until it answers again",
                        self.channel.label, type(exc).__name__, self.channel.fallback)

    def _recovered(self) -> None:
        if self.stats.down:
            self.stats.down = False
            log.warning("%s: Redis reachable again", self.channel.label)

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._flusher()), loop.create_task(self._listener())]

    async def stop(self) -> None:
        await cancel_and_wait(*self._tasks)
        self._tasks = []
        await self.flush()
        for client in (self._pub, self._sub):
            if client is not None:
                await client.aclose()

    def health(self) -> Mapping[str, object]:
        return {self.channel.health_key: f"degraded: Redis unavailable, {self.channel.fallback}"
                if self.stats.down else "ok"}


def broadcast_families(name: str, stats: BroadcastStats
                       ) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
    """``<name>_items_total{outcome}`` (published, repeats, received, dropped),
    ``<name>_errors_total`` and ``<name>_down`` for a broadcast's ``stats``."""
    items = CounterMetricFamily(f"{name}_items", "Items told to the other replicas (published, "
                                "skipped as repeats, dropped) or received from them",
                                labels=["outcome"])
    for outcome in ("published", "repeats", "received", "dropped"):
        items.add_metric([outcome], getattr(stats, outcome))
    yield items
    yield CounterMetricFamily(f"{name}_errors", "Redis calls of the broadcast that failed",
                              value=stats.errors)
    yield GaugeMetricFamily(f"{name}_down", "1 while Redis is unavailable (this replica's "
                            "own state only)", value=int(stats.down))


def connect_pair(url: str, timeout_s: float) -> tuple[Any, Any]:
    """A publishing client (bounded calls) and a subscribing one (no read timeout: it waits
    for messages), both without retries."""
    from redis.asyncio import Redis

    pub = Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                         retry=stale_connection_retry())
    sub = Redis.from_url(url, socket_connect_timeout=timeout_s, retry=stale_connection_retry())
    return pub, sub


#: Seconds between sends (0.05: a session's next turn comes seconds later; 20 messages a second
#: per replica), bound on one publish (0.5 s, as the shared load's round), pause before the
#: subscriber reconnects (1 s), items waiting to be sent (4,096 ≈ 20 s of a busy replica).
FLUSH_S, TIMEOUT_S, RETRY_S, MAX_PENDING = 0.05, 0.5, 1.0, 4096


__all__ = ["FLUSH_S", "MAX_PENDING", "RETRY_S", "TIMEOUT_S", "Broadcast", "BroadcastStats",
           "Channel", "Receive", "broadcast_families", "connect_pair", "items_of"]
