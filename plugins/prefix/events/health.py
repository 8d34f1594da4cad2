"""Per-engine state of the KV index: ``exact``, ``degraded``, ``approximate`` or ``off``.

The ``kv-events`` plugin owns one :class:`IndexHealth` and reports what it sees on the wire
(events arriving, sequence gaps being replayed, messages it cannot attribute); the
``prefix-cache-producer`` reports what it routed (a request served with uncached blocks, which
should produce a ``BlockStored`` soon) and how its prediction compared with the engine's own
``cached_tokens``. From those facts each engine gets one state:

``exact``
    KV events are configured for the engine, arrive attributed to it, and predictions agree.
``degraded``
    Events are configured but something is wrong (first cause found, in this order): a
    sequence gap being replayed; the request's token ids are not the engine's (a
    pseudo-tokenizer); messages nobody can be attributed to arrive on the socket the engine
    publishes on and the engine itself has sent nothing attributed for ``unknown_topic_hold_s``;
    requests with uncached full blocks were served but no event came for ``silence_s`` (an idle
    engine is never silent); over the last ``window`` checked requests (at least
    ``min_checks``), the share of predictions within one block of the engine's
    ``cached_tokens``, or of prompts the engine counted as many tokens as the gateway, fell
    below ``agreement`` (kept until a new window agrees on both).
``approximate``
    Routing uses the gateway's own record: no events are configured for the engine, or (mode
    ``auto``) it has been degraded for ``fallback_after_s``.
``off``
    No prefix routing for it (mode ``precise`` and no events configured for it).

Every change of state (or of the cause within ``degraded``) is logged as a WARNING naming the
engine, old -> new state and the reason. Nothing here does I/O; time comes from the injected
clocks. Bounded: one record per configured engine with a ``window``-long deque of results.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger("kvgate.kv_index")

Source = Literal["connect", "bound", "none"]
Policy = Literal["events", "precise", "auto", "approximate"]
#: ``speculative``: off by more than a block only because of speculative entries (blocks a
#: request dispatched moments earlier was expected to store, not computed yet when this one was
#: admitted); the event-confirmed part was within a block. Such checks say nothing about the
#: index and are kept out of the window that judges it.
RESULTS = ("within_block", "over", "under", "speculative", "evicted")


class IndexState(enum.StrEnum):
    EXACT = "exact"
    DEGRADED = "degraded"
    APPROXIMATE = "approximate"
    OFF = "off"


@dataclass(frozen=True, slots=True)
class HealthParams:
    """Thresholds (documented with their reasons in docs/plugins/kv-events.md)."""

    #: Seconds a served request with uncached full blocks may wait for any event of its engine.
    silence_s: float = 5.0
    #: Seconds an unattributable message keeps the bound socket's silent engines degraded.
    unknown_topic_hold_s: float = 30.0
    #: Prediction results kept per engine, and the least judged.
    window: int = 50
    min_checks: int = 20
    #: Least share of predictions within one block for ``exact``.
    agreement: float = 0.8
    #: Hysteresis: the share a new window must reach to clear a disagreement (above
    #: ``agreement``, so a share hovering at the threshold cannot flip the state each window).
    recover_agreement: float = 0.9
    #: Hysteresis: seconds a judged cause (disagreeing predictions, silence) must stay clear
    #: before the engine is ``exact`` again; definitive facts (a gap filled, exact ids, the
    #: unknown topics' own hold) clear at once.
    recover_hold_s: float = 10.0
    #: Seconds an unexplained ``over`` waits for the engine's next event batch before it is
    #: judged (the removals of the step that admitted the request may trail its usage).
    settle_s: float = 2.0
    #: Mode ``auto``: seconds ``degraded`` lasts before it is reported as ``approximate``.
    fallback_after_s: float = 10.0


@dataclass(slots=True)
class _Engine:
    source: Source
    address: str
    state: IndexState = IndexState.EXACT
    reason: str = "KV events configured; none received yet (idle)"
    since: float = 0.0  # wall clock of the last state change
    entered: float = 0.0  # monotonic clock of the last state change
    last_event: float | None = None
    pending_since: float | None = None  # a served request awaits an event since then
    gap: str | None = None
    inexact_tokens: str | None = None
    window: deque[bool] = field(default_factory=deque)
    tokens_agree: deque[bool] = field(default_factory=deque)
    bad_predictions: str | None = None
    #: Hysteresis: a judged cause cleared; exact again at ``recovering[0]`` (monotonic).
    recovering: tuple[float, str] | None = None
    #: ``over`` results awaiting the engine's next event batch: (deadline, whether the engine
    #: removed the blocks after the dispatch, tokens_agree); at most ``window``.
    pending: list[tuple[float, Callable[[], bool], bool]] = field(default_factory=list)
    results: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RESULTS, 0))
    changes: dict[str, int] = field(default_factory=lambda: {s.value: 0 for s in IndexState})


class IndexHealth:
    """Per-engine index states (see the module docstring)."""

    def __init__(
        self, params: HealthParams | None = None, *, policy: Policy = "events",
        clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
    ) -> None:
        self.p = params or HealthParams()
        self.policy: Policy = policy
        self.clock, self.wall = clock, wall
        self._engines: dict[str, _Engine] = {}
        self._unknown_at: float | None = None  # last unattributable message on the bound socket
        self._unknown_topic = ""
        #: Why no engine has events at all (e.g. no kv-events plugin), for the reasons shown.
        self.no_events_reason = "no KV events configured for this engine"

    # -- configuration -------------------------------------------------------------------
    def configure(self, engine: str, source: Source, address: str = "") -> None:
        """Add an engine (or change where its events come from) and evaluate it."""
        rec = self._engines.get(engine)
        if rec is not None:
            rec.source, rec.address = source, address
            self._evaluate(engine, rec, self.clock())
            return
        now = self.clock()
        rec = self._engines[engine] = _Engine(source, address, since=self.wall(), entered=now)
        rec.window = deque(maxlen=self.p.window)
        rec.tokens_agree = deque(maxlen=self.p.window)
        rec.state, rec.reason = self._target(rec, now)
        rec.changes[rec.state.value] += 1
        quiet = rec.state is IndexState.EXACT or self.policy == "approximate"  # as configured
        level = logging.INFO if quiet else logging.WARNING
        log.log(level, "kv index: engine %s starts %s: %s", engine, rec.state.value, rec.reason)

    def forget(self, engine: str) -> None:
        self._engines.pop(engine, None)

    def set_policy(self, policy: Policy, fallback_after_s: float | None = None) -> None:
        """The producer's mode decides what a degraded engine falls back to."""
        self.policy = policy
        if fallback_after_s is not None:
            self.p = replace(self.p, fallback_after_s=fallback_after_s)
        self.tick()

    # -- reading ---------------------------------------------------------------------------
    def engines(self) -> tuple[str, ...]:
        return tuple(self._engines)

    def state(self, engine: str) -> IndexState | None:
        rec = self._engines.get(engine)
        return None if rec is None else rec.state

    def reason(self, engine: str) -> str:
        rec = self._engines.get(engine)
        return "" if rec is None else rec.reason

    def precise(self, engine: str) -> bool:
        """Whether routing for ``engine`` may trust the KV-event index right now."""
        rec = self._engines.get(engine)
        return rec is not None and rec.state is IndexState.EXACT

    def last_event(self, engine: str) -> float | None:
        """Clock time of the engine's last attributed batch (None: none yet)."""
        rec = self._engines.get(engine)
        return None if rec is None else rec.last_event

    def within_share(self, engine: str) -> float | None:
        rec = self._engines.get(engine)
        if rec is None or not rec.window:
            return None
        return sum(rec.window) / len(rec.window)

    def results(self, engine: str) -> Mapping[str, int]:
        rec = self._engines.get(engine)
        return {} if rec is None else dict(rec.results)

    def routing(self, engine: str) -> str:
        """How the producer routes this engine: ``precise``, ``approximate`` or ``none``."""
        rec = self._engines.get(engine)
        if rec is None or rec.state is IndexState.OFF or self.policy == "events":
            return "none"
        if self.policy == "precise" or (self.policy == "auto" and rec.state is IndexState.EXACT):
            return "precise"
        return "approximate"

    def health(self) -> dict[str, object]:
        """The ``/health`` section: per engine state, reason, since (Unix seconds), routing."""
        self.tick()
        engines: dict[str, object] = {}
        for name, rec in self._engines.items():
            share = self.within_share(name)
            engines[name] = {
                "state": rec.state.value, "reason": rec.reason, "since": round(rec.since, 3),
                "routing": self.routing(name), "events": rec.source,
                "predictions_checked": len(rec.window),
                "predictions_within_block": None if share is None else round(share, 3),
            }
        return {"policy": self.policy, "engines": engines}

    # -- facts from the wire -----------------------------------------------------------------
    def event(self, engine: str) -> None:
        """An attributed batch arrived from ``engine``."""
        rec = self._engines.get(engine)
        if rec is None:
            return
        now = rec.last_event = self.clock()
        if rec.pending_since is not None and now - rec.pending_since >= self.p.silence_s:
            self._hold(rec, now, "silence")
        rec.pending_since = None
        self._evaluate(engine, rec, now)

    def gap_opened(self, engine: str, detail: str) -> None:
        self._set(engine, "gap", detail)

    def gap_closed(self, engine: str) -> None:
        self._set(engine, "gap", None)

    def unknown_topic(self, topic: str) -> None:
        """An unattributable message arrived on the bound socket. Engines are re-evaluated
        when this starts a new episode (or names another topic); later ones only move the
        hold on (the ticker catches engines whose own events age out meanwhile)."""
        now = self.clock()
        fresh = (self._unknown_at is None or topic != self._unknown_topic
                 or now - self._unknown_at >= self.p.unknown_topic_hold_s)
        self._unknown_at, self._unknown_topic = now, topic
        if fresh:
            self.tick()

    def _set(self, engine: str, attr: Literal["gap", "inexact_tokens"], value: str | None) -> None:
        rec = self._engines.get(engine)
        if rec is not None and getattr(rec, attr) != value:
            setattr(rec, attr, value)
            self._evaluate(engine, rec, self.clock())

    # -- facts from routing ------------------------------------------------------------------
    def served(self, engine: str, dispatched_at: float, expects_event: bool) -> None:
        """A request dispatched at ``dispatched_at`` was served; ``expects_event``: it had
        uncached full blocks, so the engine stored blocks and publishes a ``BlockStored``."""
        rec = self._engines.get(engine)
        if rec is None or not expects_event:
            return
        if rec.last_event is not None and rec.last_event >= dispatched_at:
            return  # an event came after the dispatch: the engine is not silent
        if rec.pending_since is None:
            rec.pending_since = self.clock()

    def token_ids_inexact(self, engine: str, why: str | None) -> None:
        """``why``: the request's token ids cannot match the engine's blocks; None: they can."""
        self._set(engine, "inexact_tokens", why)

    def prediction(self, engine: str, predicted: int, reported: int, block_size: int,
                   tokens_agree: bool, confirmed: int | None = None,
                   evicted: bool = False, recheck: Callable[[], bool] | None = None) -> str:
        """Record one predicted-vs-reported comparison; returns its result name (``confirmed``:
        the part of ``predicted`` known from the engine's events; None: all of it;
        ``evicted``: the engine's events removed a block of the difference after dispatch;
        ``recheck``: asks that again, for an ``over`` judged at the next batch: ``pending``)."""
        rec = self._engines.get(engine)
        diff = predicted - reported
        result = "within_block" if abs(diff) <= block_size else "over" if diff > 0 else "under"
        if (result == "over" and confirmed is not None and confirmed < predicted
                and abs(confirmed - reported) <= block_size):
            result = "speculative"
        elif result == "over" and evicted:
            result = "evicted"  # the index was right when it routed: not judged (kv_removals)
        if rec is None:
            return result
        if result == "over" and recheck is not None and len(rec.pending) < self.p.window:
            rec.pending.append((self.clock() + self.p.settle_s, recheck, tokens_agree))
            return "pending"
        return self._record(engine, rec, result, tokens_agree)

    def settle(self, engine: str) -> None:
        """A batch of ``engine``'s events was applied: judge its pending ``over`` results
        (``evicted`` when the batch removed their blocks, else ``over``)."""
        rec = self._engines.get(engine)
        if rec is None or not rec.pending:
            return
        pending, rec.pending = rec.pending, []
        for _, recheck, tokens_agree in pending:
            self._record(engine, rec, "evicted" if recheck() else "over", tokens_agree)

    def _record(self, engine: str, rec: _Engine, result: str, tokens_agree: bool) -> str:
        rec.results[result] += 1
        if result in ("speculative", "evicted"):
            return result
        rec.window.append(result == "within_block")
        rec.tokens_agree.append(tokens_agree)
        now = self.clock()
        self._judge_window(rec, now)
        self._evaluate(engine, rec, now)
        return result

    def _judge_window(self, rec: _Engine, now: float) -> None:
        """Latch ``bad_predictions`` when the window's share of predictions within one block,
        or of prompts the engine counted as many tokens as the gateway, is below
        ``agreement``; unlatch when a new window reaches ``recover_agreement`` for both (and
        hold the state ``recover_hold_s`` longer)."""
        p = self.p
        n = len(rec.window)
        if n < p.min_checks:
            return
        within, counted = sum(rec.window) / n, sum(rec.tokens_agree) / n
        if rec.bad_predictions is None and min(within, counted) < p.agreement:
            rec.bad_predictions = _disagreement(n, within, counted, p.agreement)
            rec.recovering = None
            rec.window.clear()  # recovery needs a new window that agrees
            rec.tokens_agree.clear()
        elif rec.bad_predictions is not None and min(within, counted) >= p.recover_agreement:
            rec.bad_predictions = None
            self._hold(rec, now, f"predictions agree again ({round(within * n)} of {n})")

    def _hold(self, rec: _Engine, now: float, what: str) -> None:
        """A judged cause cleared at ``now``: the state waits ``recover_hold_s`` (hysteresis)."""
        if rec.state is not IndexState.EXACT and self.p.recover_hold_s > 0:
            rec.recovering = (now + self.p.recover_hold_s, what)

    # -- evaluation ----------------------------------------------------------------------------
    def tick(self) -> None:
        """Re-evaluate time-based causes (silence, hold expiry, fallback) for every engine."""
        now = self.clock()
        for name, rec in self._engines.items():
            if rec.pending and rec.pending[0][0] <= now:  # no batch came: judged as they are
                self.settle(name)
            self._evaluate(name, rec, now)

    def _cause(self, rec: _Engine, now: float) -> str | None:
        p = self.p
        if rec.gap is not None:
            return rec.gap
        if rec.inexact_tokens is not None:
            return rec.inexact_tokens
        if (rec.source == "bound" and self._unknown_at is not None
                and now - self._unknown_at < p.unknown_topic_hold_s
                and (rec.last_event is None or now - rec.last_event >= p.unknown_topic_hold_s)):
            return (f"unattributable KV events on the gateway's bound socket (topic "
                    f"{self._unknown_topic!r}) and none attributed to this engine: its topic "
                    "must name it (kv@<engine>[@model])")
        if rec.pending_since is not None and now - rec.pending_since >= p.silence_s:
            return (f"silent: requests with uncached blocks were served, no KV event for "
                    f"{p.silence_s:g} s")
        if rec.bad_predictions is not None:
            return rec.bad_predictions
        if rec.recovering is not None:
            until, what = rec.recovering
            if now < until:
                return f"recovering: {what}; exact after {p.recover_hold_s:g} s clear"
            rec.recovering = None
        return None

    def _target(self, rec: _Engine, now: float) -> tuple[IndexState, str]:
        if self.policy == "approximate":
            return IndexState.APPROXIMATE, "mode approximate: the gateway's own record"
        if rec.source == "none":
            if self.policy in ("precise", "events"):
                return IndexState.OFF, f"{self.no_events_reason}; no prefix routing for it"
            return IndexState.APPROXIMATE, f"{self.no_events_reason}: the gateway's own record"
        cause = self._cause(rec, now)
        if cause is None:
            if rec.last_event is None:
                return IndexState.EXACT, f"KV events configured ({rec.source}); none received yet"
            if rec.window:
                return IndexState.EXACT, "KV events arrive attributed; predictions agree"
            return IndexState.EXACT, "KV events arrive attributed"
        if self.policy == "auto":
            fallen = (rec.state is IndexState.APPROXIMATE or (
                rec.state is IndexState.DEGRADED and now - rec.entered >= self.p.fallback_after_s))
            if fallen:
                return IndexState.APPROXIMATE, f"fallen back to the gateway's record: {cause}"
            return IndexState.DEGRADED, f"{cause}; routing on the gateway's record"
        return IndexState.DEGRADED, cause

    def _evaluate(self, engine: str, rec: _Engine, now: float) -> None:
        state, reason = self._target(rec, now)
        if state is rec.state and reason == rec.reason:
            return
        old = rec.state
        if state is not old:
            rec.since, rec.entered = self.wall(), now
            rec.changes[state.value] += 1
        rec.state, rec.reason = state, reason
        if state is old and state is not IndexState.DEGRADED:
            return  # a reworded exact/approximate/off reason is no news
        log.warning("kv index: engine %s %s -> %s: %s", engine, old.value, state.value, reason)

    # -- metrics ---------------------------------------------------------------------------------
    def collector(self) -> Collector:
        return _HealthCollector(self)


def _disagreement(n: int, within: float, counted: float, threshold: float) -> str:
    if counted < threshold:
        return (f"token ids are not the engine's: only {round(counted * n)} of the last {n} "
                "prompts had the prompt_tokens the engine reported (is the gateway's tokenizer "
                "the engine's?), so KV events can never match")
    return (f"predictions disagree with the engine's cached_tokens: {round(within * n)} of the "
            f"last {n} within one block (threshold {threshold:g})")


class _HealthCollector(Collector):
    def __init__(self, health: IndexHealth) -> None:
        self._h = health

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        h = self._h
        h.tick()
        state = GaugeMetricFamily("kvgate_kv_index_state", "1 for the engine's KV index state",
                                  labels=["engine", "state"])
        changes = CounterMetricFamily("kvgate_kv_index_state_changes",
                                      "Times the engine's KV index entered a state",
                                      labels=["engine", "state"])
        checks = CounterMetricFamily("kvgate_kv_predictions",
                                     "Predicted vs engine-reported cached tokens",
                                     labels=["engine", "result"])
        share = GaugeMetricFamily("kvgate_kv_predictions_within_block_ratio",
                                  "Share of recent predictions within one block",
                                  labels=["engine"])
        for name, rec in h._engines.items():
            for s in IndexState:
                state.add_metric([name, s.value], 1.0 if rec.state is s else 0.0)
                changes.add_metric([name, s.value], rec.changes[s.value])
            for result, count in rec.results.items():
                checks.add_metric([name, result], count)
            ratio = h.within_share(name)
            if ratio is not None:
                share.add_metric([name], ratio)
        yield from (state, changes, checks, share)
