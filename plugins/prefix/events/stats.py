"""The ``kv-events`` subscriber's counters (:class:`KvEventsStats`) and their Prometheus
collector (:class:`StatsCollector`: the counters, the index's size and stats, the engines'
index states), apart from the subscriber itself (plugins/prefix/events/subscriber.py)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvgate.plugins.prefix.events.health import IndexHealth
from kvgate.plugins.prefix.index.index import KvIndex
from kvgate.plugins.prefix.shared_tier import SHARED_HOLDER


@dataclass(slots=True)
class KvEventsStats:
    """Monotonic counters of the subscriber (messages are ZMQ multipart messages = batches)."""

    messages: int = 0
    malformed_messages: int = 0
    malformed_events: int = 0
    unknown_events: int = 0
    unknown_topics: int = 0
    sequence_gaps: int = 0
    sequence_restarts: int = 0
    events_applied: dict[str, int] = field(
        default_factory=lambda: {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}
    )
    #: Gaps asked for on a replay socket, by result (``filled`` or ``failed``: entries reset).
    replays: dict[str, int] = field(default_factory=lambda: {"filled": 0, "failed": 0})
    #: History asked for at first contact, by result (``caught_up``; ``failed``: the index
    #: starts from the first live batch).
    history: dict[str, int] = field(default_factory=lambda: {"caught_up": 0, "failed": 0})

    @property
    def total_applied(self) -> int:
        return sum(self.events_applied.values())


class StatsCollector(Collector):
    """A Prometheus collector of the subscriber's counters, its index and the engines' states."""

    def __init__(self, stats: KvEventsStats, index: KvIndex, health: IndexHealth) -> None:
        self._stats = stats
        self._index = index
        self._health = health.collector()

    def collect(self) -> Iterator[Metric]:
        stats = self._stats
        for name, doc, label, counts in (
            ("applied", "KV events applied to the index", "type", stats.events_applied),
            ("replays", "Sequence gaps asked for on a replay socket, by result", "result",
             stats.replays),
            ("history", "Histories asked for on a replay socket at first contact, by result",
             "result", stats.history),
        ):
            family = CounterMetricFamily(f"kvgate_kv_events_{name}", doc, labels=[label])
            for kind, count in counts.items():
                family.add_metric([kind], count)
            yield family
        for name, value in asdict(stats).items():
            if isinstance(value, int):
                yield CounterMetricFamily(f"kvgate_kv_events_{name}", f"KV events: {name}",
                                          value=value)
        for name, value in asdict(self._index.stats).items():
            yield CounterMetricFamily(f"kvgate_kv_index_{name}", f"KV index: {name}", value=value)
        yield GaugeMetricFamily("kvgate_kv_index_blocks", "(engine, block) pairs indexed",
                                value=len(self._index))
        yield GaugeMetricFamily("kvgate_kv_index_shared_tier_blocks",
                                "Blocks indexed in the fleet's shared tier (locality REMOTE)",
                                value=self._index.blocks_of(SHARED_HOLDER))
        yield from self._health.collect()


__all__ = ["KvEventsStats", "StatsCollector"]
