"""The approximate prefix record shared between gateway replicas (``prefix-cache-producer`` with
``redis_url`` in mode ``approximate`` / ``auto``).

Without KV events each replica's record holds only what *it* routed: with requests spread over
three replicas a replica misses two thirds of the prefixes the fleet holds (measured on the
synthetic replay, 8 x 4,096 blocks: hit ratio 0.335 with one replica, 0.195 with three before
sharing). So every record insertion is also published: :meth:`RecordShare.publish` queues
``(engine, block hashes)`` (the hashes already carry the record's scope: cache salt, tenant,
LoRA), a background task sends the queue every ``flush_s`` as one JSON message on the Redis
channel ``<prefix>record`` (``PUBLISH``), and a subscriber task hands every other replica's
insertions to ``apply`` (the record inserts them as if routed here, with the record's TTL).
Publish/subscribe keeps nothing in Redis: a replica that starts later learns from the traffic
from then on, and from the engines' reported ``cached_tokens``.

Bounded: at most ``max_pending`` insertions wait to be sent (older ones are dropped and counted
when Redis is slow). A prompt already sent for an engine (same last block) is not sent again for
``repeat_s`` (60 s: a tenth of the record's 600 s TTL, so the others' copies never lapse while
it is in use); the ``max_recent`` (65,536) last sends are remembered, least recent forgotten.
Redis down: insertions are dropped (counted), each replica keeps routing
on its own record, one WARNING per outage, ``/health`` says ``degraded``; the subscriber
reconnects every ``retry_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvgate.middleware.framework.tasks import cancel_and_wait
from kvgate.middleware.framework.types import EndpointId
from kvgate.plugins.common.redis_retry import redis_errors, stale_connection_retry
from kvgate.plugins.load.shared_load import replica_id

log = logging.getLogger("kvgate.plugins.shared_record")

Apply = Callable[[EndpointId, list[int]], None]


@dataclass(slots=True)
class RecordShareStats:
    """Insertions published, received from others, dropped; failed calls; outage flag."""

    published: int = 0
    repeats: int = 0
    received: int = 0
    dropped: int = 0
    errors: int = 0
    down: bool = False


def decode(raw: Any, me: str) -> list[tuple[EndpointId, list[int]]]:
    """Another replica's message as (engine, hashes) pairs; [] for ours or malformed ones."""
    try:
        doc = json.loads(raw)
    except (ValueError, TypeError):
        return []
    if not isinstance(doc, dict) or doc.get("from") == me:
        return []
    out = []
    for item in doc.get("items", ()):
        if (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], list) and all(type(h) is int for h in item[1])):
            out.append((item[0], item[1]))
    return out


class RecordShare:
    """Publishes this replica's record insertions and applies the others' (module docstring)."""

    def __init__(
        self, publisher: Any, subscriber: Any, apply: Apply, *, prefix: str, flush_s: float,
        timeout_s: float, retry_s: float, max_pending: int, me: str | None = None,
        repeat_s: float = 60.0, max_recent: int = 65_536,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pub = publisher
        self._sub = subscriber
        self._apply = apply
        self.channel = prefix + "record"
        self.flush_s = flush_s
        self._timeout_s = timeout_s
        self._retry_s = retry_s
        self._pending: deque[tuple[EndpointId, list[int]]] = deque(maxlen=max_pending)
        self.me = me or replica_id()
        self.stats = RecordShareStats()
        self._repeat_s = repeat_s
        self._max_recent = max_recent
        self._recent: OrderedDict[tuple[EndpointId, int], float] = OrderedDict()
        self.clock = clock
        self._tasks: list[asyncio.Task[None]] = []
        self._errors: tuple[type[BaseException], ...] = redis_errors()

    def publish(self, engine: EndpointId, hashes: Sequence[int]) -> None:
        """Queue an insertion for the next flush (the oldest is dropped when full). The same
        prompt on the same engine (its last block) is sent again only after ``repeat_s``: a
        hot prefix would otherwise be re-sent, and re-inserted by every replica, per request."""
        if not hashes:
            return
        key, now = (engine, int(hashes[-1])), self.clock()
        sent = self._recent.get(key)
        if sent is not None and now - sent < self._repeat_s:
            self.stats.repeats += 1
            return
        self._recent[key] = now
        self._recent.move_to_end(key)
        if len(self._recent) > self._max_recent:
            self._recent.popitem(last=False)
        if len(self._pending) == self._pending.maxlen:
            self.stats.dropped += 1
        self._pending.append((engine, [int(h) for h in hashes]))

    async def flush(self) -> None:
        """Send what is queued as one message."""
        if not self._pending:
            return
        items = list(self._pending)
        self._pending.clear()
        message = json.dumps({"from": self.me, "items": items}, separators=(",", ":"))
        try:
            await asyncio.wait_for(self._pub.publish(self.channel, message), self._timeout_s)
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
            await pubsub.subscribe(self.channel)
            self._recovered()
            async for message in pubsub.listen():
                if message.get("type") != "message":
                    continue
                for engine, hashes in decode(message.get("data"), self.me):
                    self._apply(engine, hashes)
                    self.stats.received += 1
        finally:
            with contextlib.suppress(*self._errors):
                await pubsub.aclose()

    def _failed(self, exc: BaseException) -> None:
        self.stats.errors += 1
        if not self.stats.down:
            self.stats.down = True
            log.warning("shared prefix record: Redis unavailable (%s); each replica routes on "
                        "its own record until it answers again", type(exc).__name__)

    def _recovered(self) -> None:
        if self.stats.down:
            self.stats.down = False
            log.warning("shared prefix record: Redis reachable again")

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._flusher()), loop.create_task(self._listener())]

    async def stop(self) -> None:
        await cancel_and_wait(*self._tasks)
        self._tasks = []
        await self.flush()
        for client in (self._pub, self._sub):
            await client.aclose()

    def health(self) -> Mapping[str, object]:
        return {"shared_record": "degraded: Redis unavailable, this replica's own record"
                if self.stats.down else "ok"}


#: Seconds between sends (0.05: a session's next turn comes seconds later; 20 messages a second
#: per replica), bound on one publish (0.5 s, as the shared load's round), pause before the
#: subscriber reconnects (1 s), insertions waiting to be sent (4,096 ≈ 20 s of a busy replica).
FLUSH_S, TIMEOUT_S, RETRY_S, MAX_PENDING = 0.05, 0.5, 1.0, 4096


def start_record_share(url: str, apply: Apply, prefix: str = "kvgate:") -> RecordShare:
    """A started :class:`RecordShare` on ``url`` with the defaults above."""
    pub, sub = connect_pair(url, TIMEOUT_S)
    share = RecordShare(pub, sub, apply, prefix=prefix, flush_s=FLUSH_S, timeout_s=TIMEOUT_S,
                        retry_s=RETRY_S, max_pending=MAX_PENDING)
    share.start()
    return share


def connect_pair(url: str, timeout_s: float) -> tuple[Any, Any]:
    """A publishing client (bounded calls) and a subscribing one (no read timeout: it waits
    for messages), both without retries."""
    from redis.asyncio import Redis

    pub = Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                         retry=stale_connection_retry())
    sub = Redis.from_url(url, socket_connect_timeout=timeout_s, retry=stale_connection_retry())
    return pub, sub
