"""The lockless metric families (middleware/observe/metrics.py) render exactly what prometheus_client's
own Counter and Histogram render for the same updates, and stay bounded."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvgate.middleware.observe import metrics as metrics_module
from kvgate.middleware.observe.metrics import LabelledCounter, LabelledHistogram

BUCKETS = (0.001, 0.01, 0.1, 1.0)


def _samples(registry: CollectorRegistry) -> list[tuple[str, list[tuple[str, str]], float]]:
    """Every sample but prometheus_client's ``_created`` timestamps, sorted."""
    text = generate_latest(registry).decode()
    return sorted((s.name, sorted(s.labels.items()), s.value)
                  for family in text_string_to_metric_families(text)
                  for s in family.samples if not s.name.endswith("_created"))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_same_exposition_as_prometheus_client(seed: int) -> None:
    rng = random.Random(seed)
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    counter = LabelledCounter("t_requests", "Requests", ["api", "status"])
    histogram = LabelledHistogram("t_seconds", "Latency", ["api"], BUCKETS)
    ours.register(counter)
    ours.register(histogram)
    ref_counter = Counter("t_requests", "Requests", ["api", "status"], registry=theirs)
    ref_histogram = Histogram("t_seconds", "Latency", ["api"], buckets=BUCKETS,
                              registry=theirs)
    for _ in range(200):
        api, status = rng.choice(["chat", "messages"]), rng.choice(["200", "429", "500"])
        amount = float(rng.randint(1, 5))
        counter.inc((api, status), amount)
        ref_counter.labels(api, status).inc(amount)
        seconds = rng.choice([0.001, 0.0005, 0.05, 2.0, 0.1])  # on and between the edges
        histogram.observe((api,), seconds)
        ref_histogram.labels(api).observe(seconds)
    assert _samples(ours) == _samples(theirs)


def test_series_are_bounded_and_overflow_counts_under_other(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics_module, "MAX_SERIES", 3)
    counter = LabelledCounter("t_tokens", "Tokens", ["model", "kind"])
    for i in range(10):
        counter.inc((f"model-{i}", "prompt"), 2.0)
    family = next(iter(counter.collect()))
    values = {tuple(s.labels.values()): s.value for s in family.samples}
    assert len(values) == 4  # three kept, one overflow series
    assert values[("other", "other")] == 14.0  # seven label sets past the bound, nothing lost
    assert sum(values.values()) == 20.0
