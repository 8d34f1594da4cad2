"""Per-engine circuit breaker: an engine that keeps failing requests leaves rotation until a
health probe passes and one trial request succeeds.

States and transitions (pure and synchronous; the pool owns one :class:`Breaker` per engine,
logs every change at WARNING and counts it in ``kvgate_engine_breaker_transitions_total``):

* ``closed``: routable. Each request failure (timeout, 5xx, connection error, a stream broken
  off) adds one to a run of consecutive failures; a success resets it. ``failures`` in a row
  (``pool.breaker_failures``) open the breaker; a connection that cannot be made at all opens it
  at once (:meth:`Breaker.trip`): an engine that refuses connections will refuse the next one.
* ``open``: out of rotation; no request is sent. The pool's next successful health probe moves it
  to ``half_open`` (the probe interval, ``pool.health_interval_s``, is the back-off).
* ``half_open``: routable for one trial request at a time. Its success closes the breaker; its
  failure opens it again, until the next successful probe.

Why a trial request and not the probe alone: an engine can answer ``GET /health`` while its
inference path hangs (a stuck scheduler, a full KV cache that never drains); only a request
proves the engine serves. Why one trial: a half-open engine that takes the whole load back at
once would time out every request routed to it in the meantime.

Engine answers that are the client's fault (4xx) and load (408, 429: the engine works, it is
busy) are neither failures nor successes. A failure is counted only once the request's retry
has judged it (middleware/fleet/pool.py ``suspect``, ``settle``): a request that a second engine
fails too is the request's fault, counted against neither (docs/security.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from enum import StrEnum

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class BreakerState(StrEnum):
    CLOSED = "closed"
    HALF_OPEN = "half_open"
    OPEN = "open"


#: Gauge values of ``kvgate_engine_breaker_state`` (ordered by how closed the breaker is).
STATE_VALUE = {BreakerState.CLOSED: 0.0, BreakerState.HALF_OPEN: 1.0, BreakerState.OPEN: 2.0}


class Breaker:
    """One engine's breaker. Methods return the new state when they changed it, else None."""

    __slots__ = ("failures", "state", "threshold", "trial")

    def __init__(self, threshold: int) -> None:
        self.threshold = threshold
        self.state = BreakerState.CLOSED
        #: Consecutive request failures while closed.
        self.failures = 0
        #: A half-open trial request is in flight.
        self.trial = False

    def allows(self) -> bool:
        """Whether the scheduler may route a new request to the engine."""
        if self.state is BreakerState.CLOSED:
            return True
        return self.state is BreakerState.HALF_OPEN and not self.trial

    def on_dispatch(self) -> None:
        """A request was sent: in half-open it is the trial."""
        if self.state is BreakerState.HALF_OPEN:
            self.trial = True

    def on_release(self) -> None:
        """The request ended without a verdict (e.g. the client left): free the trial slot."""
        self.trial = False

    def on_success(self) -> BreakerState | None:
        self.failures, self.trial = 0, False
        return self._move(BreakerState.CLOSED)

    def on_failure(self) -> BreakerState | None:
        self.trial = False
        if self.state is BreakerState.CLOSED:
            self.failures += 1
            if self.failures < self.threshold:
                return None
        return self._move(BreakerState.OPEN)

    def trip(self) -> BreakerState | None:
        """Open at once (the engine cannot be reached)."""
        self.trial = False
        return self._move(BreakerState.OPEN)

    def on_probe_ok(self) -> BreakerState | None:
        if self.state is BreakerState.OPEN:
            self.failures = 0
            return self._move(BreakerState.HALF_OPEN)
        return None

    def _move(self, to: BreakerState) -> BreakerState | None:
        if self.state is to:
            return None
        self.state = to
        return to


class BreakerCollector(Collector):
    """``kvgate_engine_breaker_state`` (0 closed, 1 half-open, 2 open) and
    ``kvgate_engine_breaker_transitions_total`` by engine and new state, read at scrape time."""

    def __init__(self, states: Callable[[], Mapping[str, float]],
                 transitions: Mapping[tuple[str, str], int]) -> None:
        self._states = states
        self._transitions = transitions

    def collect(self) -> Iterator[Metric]:
        gauge = GaugeMetricFamily(
            "kvgate_engine_breaker_state",
            "circuit breaker of the engine: 0 closed, 1 half-open, 2 open", labels=["engine"])
        for engine, value in self._states().items():
            gauge.add_metric([engine], value)
        yield gauge
        counter = CounterMetricFamily(
            "kvgate_engine_breaker_transitions", "circuit breaker changes by new state",
            labels=["engine", "state"])
        for (engine, state), count in sorted(self._transitions.items()):
            counter.add_metric([engine, state], float(count))
        yield counter


__all__ = ["STATE_VALUE", "Breaker", "BreakerCollector", "BreakerState"]
