"""flow-control's Prometheus metrics (the plugin's ``MetricsSource``).

Label cardinality is bounded: ``band`` (4 values), ``reason`` (a handful), ``engine`` (the
configured engines), ``pool`` (2) and ``tenant``: the first ``max_tenant_labels`` tenants seen
get their own value, every later one counts as ``other`` (:class:`TenantLabels`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from kvgate.plugins.flow.saturation import FleetView
from kvgate.plugins.flow.shared import FlowShare

#: Wait buckets [s]: from the fast path's sub-millisecond to the 60 s TTL.
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class TenantLabels:
    """The ``tenant`` label value: the tenant itself for the first ``limit`` seen, else
    ``other`` (bounded: ``limit`` entries, never evicted, so a series never changes meaning)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._named: set[str] = set()

    def __call__(self, tenant: str) -> str:
        if tenant in self._named:
            return tenant
        if len(self._named) < self.limit and tenant != "other":
            self._named.add(tenant)
            return tenant
        return "other"


class FlowMetrics(Collector):
    """Counters and the wait histogram (children bound once per band and path: every request
    increments them), and the fleet's view read at scrape time."""

    def __init__(self, view: Callable[[], FleetView | None],
                 queued: Callable[[str], int], bands: tuple[str, ...],
                 evictions: Callable[[], dict[str, int]],
                 shared: Callable[[], FlowShare | None]) -> None:
        self._view = view
        self._shared = shared
        self._evictions = evictions
        self._queued = queued
        self._bands = bands
        self.admitted = Counter("kvgate_flow_admitted", "Requests admitted by flow control, "
                                "by band and path (direct: no wait; queued: after a wait)",
                                ["band", "path"], registry=None)
        self.wait = Histogram("kvgate_flow_wait_seconds", "Time a request waited in the "
                              "gateway's flow-control queue before dispatch (admitted ones)",
                              ["band"], buckets=WAIT_BUCKETS, registry=None)
        self._admitted: dict[tuple[str, str], Counter] = {}
        self._waits: dict[str, Histogram] = {}
        self.shed = Counter("kvgate_flow_shed", "Requests refused by flow control, by band, "
                            "tenant (bounded) and reason (queue_full 429, ttl_over_share 429, "
                            "ttl 503)", ["band", "tenant", "reason"], registry=None)
        self.gone = Counter("kvgate_flow_client_gone", "Queued requests whose client left "
                            "(removed from the queue)", ["band"], registry=None)
        self.capped = Counter("kvgate_flow_priority_capped", "Requests asking for a band above "
                              "their key's max_priority (served in the key's highest band)",
                              registry=None)
        self.limit_changes = Counter("kvgate_flow_limit_changes", "Learned engine limit "
                                     "changes (cut: the engine queued; probe: +1)",
                                     ["direction"], registry=None)

    def admitted_child(self, band: str, path: str) -> Counter:
        child = self._admitted.get((band, path))
        if child is None:
            child = self._admitted[band, path] = self.admitted.labels(band, path)
        return child

    def wait_child(self, band: str) -> Histogram:
        child = self._waits.get(band)
        if child is None:
            child = self._waits[band] = self.wait.labels(band)
        return child

    def collect(self) -> Iterator[Metric]:
        for m in (self.admitted, self.wait, self.shed, self.gone, self.capped,
                  self.limit_changes):
            yield from m.collect()
        evicted = CounterMetricFamily("kvgate_flow_events", "Fairness entries evicted by the "
                                      "max_tenants / max_sessions bounds (tenant, session); "
                                      "schedulings that found every candidate engine "
                                      "saturated (filter_kept_all)", labels=["what"])
        for what, n in sorted(self._evictions().items()):
            evicted.add_metric([what], n)
        yield evicted
        shared = self._shared()
        if shared is not None:
            yield from shared.families()
        queued = GaugeMetricFamily("kvgate_flow_queued", "Requests waiting in the gateway's "
                                   "flow-control queue now", labels=["band"])
        for band in self._bands:
            queued.add_metric([band], self._queued(band))
        yield queued
        view = self._view()
        if view is None:
            return
        limit = GaugeMetricFamily("kvgate_flow_engine_limit", "Requests this gateway keeps in "
                                  "flight on the engine at most (learned; with share_limits "
                                  "its share of the fleet's)", labels=["engine"])
        learned = GaugeMetricFamily("kvgate_flow_engine_learned_limit", "The engine's learned "
                                    "limit: this replica's own, or the fleet's with "
                                    "share_limits and other replicas", labels=["engine"])
        sat = GaugeMetricFamily("kvgate_flow_engine_saturated", "1 while the engine takes no "
                                "new request, by reason", labels=["engine", "reason"])
        for e in view.engines:
            limit.add_metric([e.id], e.limit)
            learned.add_metric([e.id], e.learned)
            sat.add_metric([e.id, e.saturated or "none"], int(e.saturated is not None))
        pool = GaugeMetricFamily("kvgate_flow_pool_saturated", "1 while the pool has no free "
                                 "slot (serving: both/decode engines; prefill)", labels=["pool"])
        for name, value in view.pool_saturated().items():
            pool.add_metric([name], int(value))
        yield limit
        yield learned
        yield sat
        yield pool
        yield GaugeMetricFamily("kvgate_flow_capacity", "The serving pool's request slots "
                                "(sum of the healthy engines' limits)", value=view.capacity)
        yield GaugeMetricFamily("kvgate_flow_stale_engines", "Engines whose scraped metrics are "
                                "older than metrics_stale_s (saturation from gateway counters "
                                "only)", value=len(view.stale))
        yield GaugeMetricFamily("kvgate_flow_blind_engines", "Engines that report no "
                                "running/waiting metrics (limit max_in_flight_per_engine, not "
                                "learned)", value=len(view.blind))


__all__ = ["WAIT_BUCKETS", "FlowMetrics", "TenantLabels"]
