"""The approximate prefix record shared between gateway replicas (``prefix-cache-producer`` with
``redis_url`` in mode ``approximate`` / ``auto``).

Without KV events each replica's record holds only what *it* routed: with requests spread over
three replicas a replica misses two thirds of the prefixes the fleet holds (measured on the
synthetic replay, 8 x 4,096 blocks: hit ratio 0.335 with one replica, 0.195 with three before
sharing). So every record insertion is also published: :meth:`RecordShare.publish` queues
``(engine, block hashes)`` (the hashes already carry the record's scope: cache salt, tenant,
LoRA) on the channel ``<prefix>record`` of a :class:`~kvgate.plugins.common.broadcast.Broadcast`
(batched every ``flush_s``; its module says how it behaves when Redis is slow or down), and
every other replica's insertions reach ``apply`` (the record inserts them as if routed here,
with the record's TTL). A replica that starts later learns from the traffic from then on, and
from the engines' reported ``cached_tokens``.

A prompt already sent for an engine (same last block) is not sent again for
``repeat_s`` (60 s: a tenth of the record's 600 s TTL, so the others' copies never lapse while
it is in use); the ``max_recent`` (65,536) last sends are remembered, least recent forgotten.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from kvgate.middleware.framework.types import EndpointId
from kvgate.plugins.common.broadcast import (
    FLUSH_S,
    MAX_PENDING,
    RETRY_S,
    TIMEOUT_S,
    Broadcast,
    Channel,
    broadcast_families,
    connect_pair,
    items_of,
)
from kvgate.plugins.load.shared_load import replica_id

Apply = Callable[[EndpointId, list[int]], None]


def valid_item(item: Any) -> tuple[EndpointId, list[int]] | None:
    """One published insertion as (engine, hashes), or None when malformed."""
    if (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)
            and isinstance(item[1], list) and all(type(h) is int for h in item[1])):
        return item[0], item[1]
    return None


def decode(raw: Any, me: str) -> list[tuple[EndpointId, list[int]]]:
    """Another replica's message as (engine, hashes) pairs; [] for ours or malformed ones."""
    return [pair for pair in map(valid_item, items_of(raw, me)) if pair is not None]


class RecordShare(Broadcast):
    """Publishes this replica's record insertions and applies the others' (module docstring)."""

    def __init__(
        self, publisher: Any, subscriber: Any, apply: Apply, *, prefix: str, flush_s: float,
        timeout_s: float, retry_s: float, max_pending: int, me: str | None = None,
        repeat_s: float = 60.0, max_recent: int = 65_536,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        channel = Channel(prefix + "record", "shared_record", "shared prefix record",
                          "this replica's own record")
        super().__init__(publisher, subscriber, self._receive_item, channel,
                         me=me or replica_id(), flush_s=flush_s, timeout_s=timeout_s,
                         retry_s=retry_s, max_pending=max_pending)
        self._apply = apply
        self._repeat_s = repeat_s
        self._max_recent = max_recent
        self._recent: OrderedDict[tuple[EndpointId, int], float] = OrderedDict()
        self.clock = clock

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
        self.send((engine, [int(h) for h in hashes]))

    def _receive_item(self, item: Any) -> bool:
        pair = valid_item(item)
        if pair is None:
            return False
        self._apply(*pair)
        return True


class RecordMetrics(Collector):
    """The producer's own metrics, then the shared record's ``kvgate_prefix_record_shared_*``
    (items published, skipped as repeats, received, dropped; errors; down) while it runs."""

    def __init__(self, own: Collector, share: Callable[[], RecordShare | None]) -> None:
        self._own = own
        self._share = share

    def collect(self) -> Iterator[Metric]:
        yield from self._own.collect()
        share = self._share()
        if share is not None:
            yield from broadcast_families("kvgate_prefix_record_shared", share.stats)


def start_record_share(url: str, apply: Apply, prefix: str = "kvgate:") -> RecordShare:
    """A started :class:`RecordShare` on ``url`` with the broadcast's defaults."""
    pub, sub = connect_pair(url, TIMEOUT_S)
    share = RecordShare(pub, sub, apply, prefix=prefix, flush_s=FLUSH_S, timeout_s=TIMEOUT_S,
                        retry_s=RETRY_S, max_pending=MAX_PENDING)
    share.start()
    return share


__all__ = ["RecordMetrics", "RecordShare", "connect_pair", "decode", "start_record_share"]
