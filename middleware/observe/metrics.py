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

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvgate.middleware.framework.plugin import Plugin
from kvgate.middleware.framework.types import Endpoint

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


#: Series one :class:`LabelledCounter` or :class:`LabelledHistogram` keeps (label sets are
#: bounded by the configuration: APIs x served models x statuses, plugins x hooks; 4,096 is far
#: above any real one). Past it a new label set counts in the one whose labels are all
#: ``other``: nothing is dropped, nothing grows.
MAX_SERIES = 4096
_OVERFLOW = "other"


class _Labelled(Collector):
    """Series by label values, each a plain ``list[float]`` the event loop's thread (the only
    writer) updates in place, turned into a metric family at scrape time.

    prometheus_client's ``labels(...).inc()`` validates, then takes a lock per update (and a
    histogram's ``observe`` twice, walking the buckets in Python): four to six Python calls
    per update, several updates per request. Here an update is one call, a dict lookup and a
    list store."""

    def __init__(self, name: str, documentation: str, labels: list[str], width: int) -> None:
        self.name, self.documentation, self.labels = name, documentation, labels
        self._width = width
        self._series: dict[tuple[str, ...], list[float]] = {}

    def series(self, *values: str) -> list[float]:
        """The mutable series of one label set (created at 0; see :data:`MAX_SERIES`)."""
        found = self._series.get(values)
        if found is None:
            if len(self._series) >= MAX_SERIES:
                values = (_OVERFLOW,) * len(self.labels)
                found = self._series.get(values)
            if found is None:
                found = self._series[values] = [0.0] * self._width
        return found


class LabelledCounter(_Labelled):
    """A counter family (``<name>_total``): :meth:`inc` adds to one label set."""

    def __init__(self, name: str, documentation: str, labels: list[str]) -> None:
        super().__init__(name, documentation, labels, 1)

    def inc(self, values: tuple[str, ...], amount: float = 1.0) -> None:
        series = self._series.get(values)
        if series is None:
            series = self.series(*values)
        series[0] += amount

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labels)
        for values, series in self._series.items():
            family.add_metric(list(values), series[0])
        yield family


class LabelledHistogram(_Labelled):
    """A histogram family; a series is ``[count per bucket (not cumulative)..., +Inf count,
    sum]``, so an observation is a ``bisect`` and two list updates."""

    def __init__(self, name: str, documentation: str, labels: list[str],
                 buckets: tuple[float, ...]) -> None:
        super().__init__(name, documentation, labels, len(buckets) + 2)
        self.bounds = list(buckets)

    def observe(self, values: tuple[str, ...], seconds: float) -> None:
        series = self._series.get(values)
        if series is None:
            series = self.series(*values)
        series[bisect_left(self.bounds, seconds)] += 1
        series[-1] += seconds

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labels)
        edges = [repr(float(b)) for b in self.bounds] + ["+Inf"]  # as prometheus_client
        for values, series in self._series.items():
            cumulative = list(accumulate(series[:-1]))
            family.add_metric(list(values), list(zip(edges, cumulative, strict=True)),
                              sum_value=series[-1])
        yield family


class HookTimer:
    """Times plugin hook calls into ``kvgate_plugin_hook_duration_seconds``, sampled.

    :meth:`tick` runs as each API request starts; :attr:`on` is True while the latest request
    to start is one of every ``every`` (1: always, 0: never). A hook site reads :attr:`on`
    before the call and only then reads the clock, so an untimed call costs one attribute
    read. Requests interleave on the event loop, so the calls timed are those made while a
    sampled request was the latest to start: about one call in ``every`` of each hook, chosen
    before the call, whatever it then takes (the distribution is not biased)."""

    def __init__(self, histogram: LabelledHistogram, every: int) -> None:
        self.histogram = histogram
        self.every = every
        self.on = every == 1
        self._ticks = 0
        #: (plugin instance, hook) -> its labels (the plugin's configured name, the hook)
        self._labels: dict[tuple[int, str], tuple[str, str]] = {}
        self.names: dict[int, str] = {}

    def tick(self) -> None:
        if self.every > 1:
            self._ticks += 1
            self.on = self._ticks % self.every == 1

    def observe(self, plugin: object, hook: str, since: float) -> None:
        """One call of ``plugin``'s ``hook`` that began at ``since`` (``time.perf_counter``)."""
        elapsed = time.perf_counter() - since
        key = (id(plugin), hook)
        labels = self._labels.get(key)
        if labels is None:
            labels = self._labels[key] = (self.names.get(id(plugin), type(plugin).__name__), hook)
        self.histogram.observe(labels, elapsed)


class GatewayMetrics:
    """The gateway's metrics; ``render()`` is what ``GET /metrics`` returns."""

    def __init__(self, snapshot: Callable[[], tuple[Endpoint, ...]],
                 hook_timing_every: int = 1) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        #: Updated per request: lockless families (:class:`LabelledCounter`).
        self.requests = LabelledCounter(
            "kvgate_requests", "Requests answered", ["api", "model", "status"])
        self.latency = LabelledHistogram(
            "kvgate_request_duration_seconds", "Time from request to last byte", ["api"],
            _BUCKETS)
        self.ttft = LabelledHistogram(
            "kvgate_time_to_first_byte_seconds", "Time from request to first upstream byte",
            ["api", "stream"], _BUCKETS)
        self.tokens = LabelledCounter(
            "kvgate_tokens", "Tokens reported by engines", ["model", "kind"])
        for family in (self.requests, self.latency, self.ttft, self.tokens):
            r.register(family)
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
        self.hook_seconds = LabelledHistogram(
            "kvgate_plugin_hook_duration_seconds", "Time in one plugin hook call",
            ["plugin", "hook"], _HOOK_BUCKETS)
        r.register(self.hook_seconds)
        self.hooks = HookTimer(self.hook_seconds, hook_timing_every)
        r.register(_PoolCollector(snapshot))

    def add_plugins(self, plugins: Mapping[str, object]) -> None:
        """Export the plugins' counters and name their hook timings (once, at build)."""
        self.hooks.names = {id(p): name for name, p in plugins.items()}
        self.registry.register(PluginCounters(plugins))

    def render(self) -> bytes:
        return generate_latest(self.registry)
