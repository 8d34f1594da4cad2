"""Prometheus metrics, one registry per app (no global state).

Label cardinality is bounded: ``model`` is a served model name or ``other``; ``engine`` is a
configured engine name; ``api``, ``status`` and ``kind`` take a handful of values.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from middleware.types import Endpoint

# Latency buckets (s): from 1 ms (gateway-only errors) to 10 min (long generations).
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 600)


class _PoolCollector(Collector):
    """Per-engine gauges read from the pool snapshot at scrape time."""

    def __init__(self, snapshot: Callable[[], tuple[Endpoint, ...]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[GaugeMetricFamily]:
        eps = self._snapshot()
        specs: list[tuple[str, str, Callable[[Endpoint], float | None]]] = [
            ("kvgate_engine_healthy", "1 if the engine is in rotation", lambda e: float(e.healthy)),
            ("kvgate_engine_in_flight_requests", "requests in flight through the gateway",
             lambda e: float(e.in_flight_requests)),
            ("kvgate_engine_in_flight_tokens", "estimated prompt tokens in flight",
             lambda e: float(e.in_flight_tokens)),
            ("kvgate_engine_running", "engine-reported running requests",
             lambda e: e.metrics.running),
            ("kvgate_engine_waiting", "engine-reported waiting requests",
             lambda e: e.metrics.waiting),
            ("kvgate_engine_kv_usage", "engine-reported KV cache usage (0..1)",
             lambda e: e.metrics.kv_usage),
            ("kvgate_engine_prefix_cache_hits", "engine-reported prefix cache hits (tokens)",
             lambda e: e.metrics.prefix_cache_hits),
            ("kvgate_engine_prefix_cache_queries", "engine-reported prefix cache queries (tokens)",
             lambda e: e.metrics.prefix_cache_queries),
        ]
        for name, doc, get in specs:
            family = GaugeMetricFamily(name, doc, labels=["engine"])
            for ep in eps:
                value = get(ep)
                if value is not None:
                    family.add_metric([ep.id], value)
            yield family


class GatewayMetrics:
    """The gateway's metrics; ``render()`` is what ``GET /metrics`` returns."""

    def __init__(self, snapshot: Callable[[], tuple[Endpoint, ...]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "kvgate_requests", "Requests answered", ["api", "model", "status"], registry=r
        )
        self.latency = Histogram(
            "kvgate_request_duration_seconds", "Time from request to last byte", ["api"],
            buckets=_BUCKETS, registry=r,
        )
        self.ttft = Histogram(
            "kvgate_time_to_first_byte_seconds", "Time from request to first upstream byte",
            ["api", "stream"], buckets=_BUCKETS, registry=r,
        )
        self.tokens = Counter(
            "kvgate_tokens", "Tokens reported by engines", ["model", "kind"], registry=r
        )
        self.retries = Counter(
            "kvgate_upstream_retries", "Requests retried on another engine", ["engine"], registry=r
        )
        self.upstream_errors = Counter(
            "kvgate_upstream_errors", "Upstream failures", ["engine", "stage"], registry=r
        )
        self.pd_requests = Counter(
            "kvgate_pd_requests", "Requests routed with a prefill hop, by how the hop went "
            "(two_hop, fallback: decoded locally, prefill_cancelled)", ["result"], registry=r
        )
        r.register(_PoolCollector(snapshot))

    def render(self) -> bytes:
        return generate_latest(self.registry)
