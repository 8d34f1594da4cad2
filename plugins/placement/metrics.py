"""``/metrics`` of the placement scorer (plugins/placement/scorer.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvgate.plugins.common.broadcast import broadcast_families
from kvgate.plugins.placement.state import PlacementView


class PlacementCollector(Collector):
    """Reads a :class:`PlacementView` the scorer builds at each scrape."""

    def __init__(self, view: Callable[[], PlacementView]) -> None:
        self._view = view

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        s = self._view()
        decisions = CounterMetricFamily(
            "kvgate_placement_decisions", "Placement decisions by kind", labels=["kind"]
        )
        for kind, count in s.stats.decisions.items():
            decisions.add_metric([kind], count)
        yield decisions
        yield CounterMetricFamily("kvgate_placement_pins_used", "Session pins consulted",
                                  value=s.stats.pins_used)
        yield CounterMetricFamily("kvgate_placement_pins_evicted",
                                  "Session pins evicted (max_sessions)",
                                  value=s.stats.pins_evicted)
        yield CounterMetricFamily("kvgate_placement_inserted_tokens",
                                  "KV tokens charged as inserted", value=s.stats.inserted_tokens)
        yield CounterMetricFamily("kvgate_placement_remote_inserted_tokens",
                                  "KV tokens other replicas charged (shared through Redis)",
                                  value=s.stats.remote_inserted_tokens)
        yield GaugeMetricFamily("kvgate_placement_sessions", "Session pins held",
                                value=s.sessions)
        yield GaugeMetricFamily("kvgate_placement_own_insertion_sessions", "Sessions whose "
                                "own recent insertions are tracked", value=s.own_sessions)
        yield GaugeMetricFamily("kvgate_placement_conversations", "Prompts remembered to "
                                "recognise later turns without session headers",
                                value=s.conversations)
        yield CounterMetricFamily("kvgate_placement_conversation_turns_found", "Requests "
                                  "without session header recognised as a later turn",
                                  value=s.conversation_turns_found)
        yield CounterMetricFamily("kvgate_placement_conversations_evicted", "Remembered "
                                  "prompts evicted (max_sessions)",
                                  value=s.conversations_evicted)
        yield CounterMetricFamily(
            "kvgate_placement_restored_hints_used",
            "Sessions placed on the engine a restored pin says holds their prefix",
            value=s.stats.hints_used)
        yield GaugeMetricFamily("kvgate_placement_restored_hints",
                                "Restored pins not yet used by their session",
                                value=s.hints)
        pressure = GaugeMetricFamily(
            "kvgate_placement_pressure",
            "Recent KV insertions per token of capacity (decayed by fleet insertions)",
            labels=["engine"],
        )
        capacity = GaugeMetricFamily("kvgate_placement_capacity_tokens",
                                     "KV capacity used for placement", labels=["engine"])
        for engine, value in sorted(s.pressures.items()):
            pressure.add_metric([engine], value)
            capacity.add_metric([engine], s.capacities[engine])
        yield pressure
        yield capacity
        if s.shared is not None:
            yield from broadcast_families("kvgate_placement_shared", s.shared)
