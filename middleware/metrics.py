"""Prometheus metrics, one registry per app (no global state).

Label cardinality is bounded: ``model`` is a served model name or ``other``; ``engine`` is a
configured engine name; ``api``, ``status`` and ``kind`` take a handful of values; ``plugin``
is a configured plugin instance, ``hook`` one of a dozen extension-point methods, ``holder`` and
``counter`` the attribute and field names of a plugin's counters (:class:`PluginCounters`).
"""

from __future__ import annotations

import dataclasses
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping
from itertools import accumulate
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from middleware.plugin import Plugin
from middleware.types import Endpoint

# Latency buckets (s): from 1 ms (gateway-only errors) to 10 min (long generations).
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 600)
# Plugin hook buckets (s): a scorer takes microseconds, a hook that awaits Redis milliseconds,
# a tokenizer on a long prompt tens of milliseconds; past 1 s something is wrong.
_HOOK_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 0.001, 0.0025, 0.005, 0.01, 0.025,
                 0.05, 0.1, 0.25, 1)
#: A dict holder with more keys than this is not exported (it is keyed by something unbounded:
#: tenants, sessions), so one plugin cannot blow up the label set.
MAX_HOLDER_KEYS = 64
_Number = (int, float)
#: Labelled children memoised by :meth:`GatewayMetrics.child` (label sets are bounded by the
#: configuration: APIs x served models x statuses; 4,096 is far above any real one).
MAX_CHILDREN = 4096


def _numbers(value: object) -> dict[str, float] | None:
    """A dict of str -> number (bools excluded) as floats, else None."""
    if not isinstance(value, dict) or not value or len(value) > MAX_HOLDER_KEYS:
        return None
    out: dict[str, float] = {}
    for key, item in value.items():
        if not isinstance(key, str) or isinstance(item, bool) or not isinstance(item, _Number):
            return None
        out[key] = float(item)
    return out


def counter_values(value: object) -> dict[str, float] | None:
    """The counters a holder carries, by name, or None when ``value`` is not a holder: a
    (not frozen) dataclass instance whose number fields (and str -> number dict fields, as
    ``field.key``) are its counters, or a str -> number dict (at most
    :data:`MAX_HOLDER_KEYS` keys)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        if type(value).__dataclass_params__.frozen:  # type: ignore[attr-defined]
            return None  # settings (thresholds, params), not counters: counters change
        out: dict[str, float] = {}
        for f in dataclasses.fields(value):
            item = getattr(value, f.name)
            if isinstance(item, _Number) and not isinstance(item, bool):
                out[f.name] = float(item)
            elif (nested := _numbers(item)) is not None:
                out.update((f"{f.name}.{k}", v) for k, v in nested.items())
        return out or None
    return _numbers(value)


def counter_holders(plugin: object, depth: int = 1) -> dict[str, dict[str, float]]:
    """A plugin's counter holders by public attribute path (``stats``, ``counts``, and one
    level down, e.g. ``index.stats`` of a helper object it owns; other plugins it refers to are
    not entered: they export their own)."""
    out: dict[str, dict[str, float]] = {}
    for name, value in getattr(plugin, "__dict__", {}).items():
        if name.startswith("_") or isinstance(value, (type, Plugin)):
            continue
        found = counter_values(value)
        if found is not None:
            out[name] = found
        elif depth > 0 and hasattr(value, "__dict__"):
            out.update((f"{name}.{k}", v) for k, v in counter_holders(value, depth - 1).items())
    return out


class PluginCounters(Collector):
    """Every plugin's counters, found generically at scrape time (:func:`counter_holders`):
    ``kvgate_plugin_counter{plugin, holder, counter}``. A gauge, as the plugin holds it: most
    are monotonic counts (use ``rate()``), a few are current sizes."""

    def __init__(self, plugins: Mapping[str, object]) -> None:
        self._plugins = plugins

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "kvgate_plugin_counter", "Every plugin's counters (attribute holder, field counter)",
            labels=["plugin", "holder", "counter"])
        for name, plugin in self._plugins.items():
            for holder, values in counter_holders(plugin).items():
                for counter, value in values.items():
                    family.add_metric([name, holder, counter], value)
        yield family


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


class HookTimings(Collector):
    """``kvgate_plugin_hook_duration_seconds{plugin, hook}``: a histogram kept as plain lists.

    A hook call is timed several times per request; prometheus_client's ``Histogram.observe``
    takes a lock twice and walks the buckets in Python (with the labelled children, ~9 % of the
    gateway's CPU per 1 KiB request in a py-spy profile). Here one observation is a
    ``bisect`` and two list updates on the event loop's thread (the only writer), turned into
    the same histogram family at scrape time. Series: one per (plugin instance, hook), bounded
    by the configuration; none is ever evicted.
    """

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.bounds = list(buckets)
        #: (plugin, hook) -> per-bucket counts (not cumulative), the +Inf count, then the sum
        self._series: dict[tuple[str, str], list[float]] = {}

    def series(self, plugin: str, hook: str) -> list[float]:
        """The mutable series of one (plugin, hook): ``[count per bucket..., +Inf, sum]``."""
        found = self._series.get((plugin, hook))
        if found is None:
            found = self._series[(plugin, hook)] = [0.0] * (len(self.bounds) + 2)
        return found

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(
            "kvgate_plugin_hook_duration_seconds", "Time in one plugin hook call",
            labels=["plugin", "hook"])
        edges = [repr(float(b)) for b in self.bounds] + ["+Inf"]  # as prometheus_client
        for (plugin, hook), series in self._series.items():
            cumulative = list(accumulate(series[:-1]))
            family.add_metric([plugin, hook], list(zip(edges, cumulative, strict=True)),
                              sum_value=series[-1])
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
        self.hook_seconds = HookTimings(_HOOK_BUCKETS)
        r.register(self.hook_seconds)
        self._hook_series: dict[tuple[int, str], list[float]] = {}
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self._plugin_names: dict[int, str] = {}
        r.register(_PoolCollector(snapshot))

    def add_plugins(self, plugins: Mapping[str, object]) -> None:
        """Export the plugins' counters and name their hook timings (once, at build)."""
        self._plugin_names = {id(p): name for name, p in plugins.items()}
        self.registry.register(PluginCounters(plugins))

    def child(self, metric: Counter | Histogram, *values: str) -> Any:
        """``metric.labels(*values)``, memoised (``labels`` validates and locks on every call:
        a few per request). At most :data:`MAX_CHILDREN` kept; past that, not memoised."""
        key = (id(metric), values)
        found = self._children.get(key)
        if found is None:
            found = metric.labels(*values)
            if len(self._children) < MAX_CHILDREN:
                self._children[key] = found
        return found

    def observe_hook(self, plugin: object, hook: str, since: float) -> None:
        """One call of ``plugin``'s ``hook`` that began at ``since`` (``time.perf_counter``)."""
        elapsed = time.perf_counter() - since
        key = (id(plugin), hook)
        series = self._hook_series.get(key)
        if series is None:
            name = self._plugin_names.get(id(plugin), type(plugin).__name__)
            series = self._hook_series[key] = self.hook_seconds.series(name, hook)
        series[bisect_left(self.hook_seconds.bounds, elapsed)] += 1
        series[-1] += elapsed

    def render(self) -> bytes:
        return generate_latest(self.registry)
