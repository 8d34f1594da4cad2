"""``flow-control``: overload without victims -- a gateway-side queue while the fleet is
saturated, priority bands, and fairness across tenants (by tokens) and agent sessions.

(AdmissionGate, Filter, DispatchHook, UsageHook, RequestEndHook, NeedsLoopback, Lifecycle,
MetricsSource, HealthSource.) Reference it in each profile (after the health and model
filters) so that the scheduler picks among the engines with a free slot; the quick-start
presets do.

Per request, before any engine is chosen (the dispatcher asks :meth:`FlowControl.admit`, and
awaits the wait it returns when the request must queue, before the data producers and the
scheduler: late binding, the engine is picked when the request leaves the queue, e.g. the one
that holds its prefix by then):

1. its **band**: ``x-kvgate-priority`` (interactive, standard, batch), else its key's
   ``priority``, else ``default_band``; capped by its key's ``max_priority`` (else
   ``max_band``); deferred work run through the loopback (queued requests, background
   responses, batch lines) is ``background``, below every live band;
2. the fleet's free slots (plugins/flow/saturation.py) minus the requests admitted here and not
   dispatched yet; with a free slot and nobody queued (a slot past its engine's reserve, or
   the tenant under its fair share) it goes on at once;
3. otherwise it waits in the queue (plugins/flow/queue.py) until :meth:`_pump` admits it (on
   every request end, and every ``poll_s``), or its band's TTL passes (429 ``flow_ttl`` when
   its tenant holds more than its fair share, else 503 ``overloaded``), or the band is full
   (429 ``queue_full``), each with ``Retry-After``, in the request's API's own error shape
   (the gateway renders every HTTPError through the API adapter); a client that leaves while
   queued is taken out of the queue at once (the dispatcher races the wait against the
   disconnect).

Nothing admitted is lost: the gate only delays or refuses *before* dispatch; once admitted a
request is dispatched exactly as without flow control (one ledger record, by the dispatcher).
The tenant's virtual token counter is charged the prompt estimate on admission and corrected
with the real usage (``on_usage``); the session's served tokens likewise.

The access log line gets ``flow_band``, ``flow_wait_ms`` and, when refused, ``flow_shed``;
the answer carries ``x-kvgate-priority`` with the band used. docs/flow-control.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from importlib.util import find_spec
from typing import Any, ClassVar

from prometheus_client.registry import Collector

from kvgate.middleware.framework.errors import (
    BadRequest,
    ConfigError,
    HTTPError,
    Overloaded,
    RateLimited,
)
from kvgate.middleware.framework.plugin import LoopbackCaller, Plugin, PluginLookup
from kvgate.middleware.framework.tasks import cancel_and_wait
from kvgate.middleware.framework.types import (
    CycleState,
    Endpoint,
    InferenceRequest,
    RoutingDecision,
    StateKey,
    Usage,
    add_log_field,
    add_response_header,
)
from kvgate.plugins.flow.fairness import Fairness
from kvgate.plugins.flow.metrics import FlowMetrics, TenantLabels
from kvgate.plugins.flow.params import (
    BACKGROUND,
    BANDS,
    LIVE_BANDS,
    UNRESERVED_BANDS,
    FlowParams,
    band_rank,
)
from kvgate.plugins.flow.queue import FlowQueue, Waiter
from kvgate.plugins.flow.saturation import FleetView, Saturation
from kvgate.plugins.flow.shared import Demand, FlowShare
from kvgate.plugins.load.session_table import session_digest

log = logging.getLogger("kvgate.flow")
ANONYMOUS = "anonymous"


@dataclass(slots=True, eq=False)
class Ticket:
    """One request's passage through flow control (in its CycleState)."""

    band: str
    tenant: str
    session: str | None
    tokens: int
    arrived: float
    admitted: bool = False
    dispatched: bool = False
    corrected: bool = False
    #: Admitted over its tenant's fair share with pacing on: paces the engine it is sent to.
    paced: bool = False


class FlowControl(Plugin):
    """Flow control: priority bands, a bounded gateway-side queue while the fleet is saturated,
    weighted fairness across tenants by tokens served (VTC) and across agent sessions (least
    attained service). Algorithm and parameters: plugins/flow/README.md,
    docs/flow-control.md."""

    type_name: ClassVar[str] = "flow-control"
    Params = FlowParams
    example_params: ClassVar[Mapping[str, object]] = {
        "default_band": "standard", "bands": {"batch": {"ttl_s": 30, "max_queued": 100}},
        "tenant_weights": {"acme": 2.0},
    }

    def __init__(self, name: str, params: FlowParams, plugins: PluginLookup) -> None:
        super().__init__(name, params, plugins)
        if params.redis_url is not None and find_spec("redis") is None:
            raise ConfigError("redis_url needs the 'redis' package (pip install 'kvgate[redis]')")
        self.p = params
        self.fair = Fairness(params)
        self.queue = FlowQueue(params, self.fair)
        self.saturation = Saturation(params, lambda: self.queue.queued() + self.pending)
        self._ticket: StateKey[Ticket] = StateKey(f"{name}/ticket")
        self._futures: dict[int, asyncio.Future[None]] = {}
        self._errors: dict[int, HTTPError] = {}
        self._endpoints: Callable[[], Sequence[Endpoint]] | None = None
        self._last_eps: Sequence[Endpoint] = ()
        #: Requests admitted here and not dispatched yet (their engine slot is not taken yet).
        self.pending = 0
        #: Of those, the paced ones (over their tenant's share): each will pace an engine.
        self.pending_paced = 0
        #: The fleet's capacity at the last admission or pump (the filter's fair shares).
        self._seen_capacity = 0
        self._task: asyncio.Task[None] | None = None
        self._labels = TenantLabels(params.max_tenant_labels)
        self._cuts = self._probes = 0
        #: The fairness shared with the other replicas (``redis_url``), once started.
        self.shared: FlowShare | None = None
        #: Schedulings where every candidate engine was saturated (the filter kept them all).
        self.unfiltered = 0
        self.metrics = FlowMetrics(
            self.current_view, self.queue.queued, BANDS,
            lambda: {"tenant": self.fair.evicted_tenants, "session": self.fair.evicted_sessions,
                     "filter_kept_all": self.unfiltered},
            lambda: self.shared)

    # -- AdmissionGate ---------------------------------------------------------------------
    def queued(self) -> int:
        return self.queue.queued()

    def admit(self, req: InferenceRequest, state: CycleState,
              eps: Sequence[Endpoint]) -> Coroutine[Any, Any, None] | None:
        if state.get(self._ticket) is not None:  # a fallback step of the same request
            return None
        for ep in eps:
            if ep.healthy:
                break
        else:  # nothing to wait for: the dispatcher's 503
            return None
        now = time.monotonic()
        self._last_eps = eps
        band = self._band(req)
        ticket = Ticket(band, req.tenant or ANONYMOUS, self._session(req),
                        req.prompt_token_estimate, now)
        state.put(self._ticket, ticket)
        add_log_field(state, "flow_band", band)
        if band != BACKGROUND:
            add_response_header(state, self.p.header, band)
        if self.queue.is_empty() and self._fits(eps, ticket, now):
            self.queue.admit_now(ticket.tenant, ticket.tokens, now)
            self.pending += 1
            self._admitted(ticket, state, now, "direct")
            return None
        waiter = self.queue.enqueue(band, ticket.tenant, ticket.session, ticket.tokens, now)
        if waiter is None:
            self._shed(ticket, state, "queue_full")
            raise RateLimited(f"the {band} queue is full ({self.p.bands[band].max_queued} "
                              "requests wait for a saturated fleet); retry later",
                              code="queue_full", headers=self._retry_after())
        return self._wait(waiter, ticket, state)

    def _fits(self, eps: Sequence[Endpoint], ticket: Ticket, now: float) -> bool:
        """A free slot for ``ticket``'s request now: any free slot for a tenant under its fair
        share (batch and background: never a reserved one), one past an engine's reserve
        otherwise, and then (pacing on) on an engine not paced. Marks the ticket paced."""
        free, opened, capacity = self._headroom(eps, now)
        if free <= 0:
            return False
        over = self.queue.over_share(ticket.tenant, capacity, now)
        if not over:
            return opened > 0 or ticket.band not in UNRESERVED_BANDS
        left = self._pace_left(eps, now)
        if opened <= 0 or (left is not None and left <= 0):
            return False
        self._mark_paced(ticket, left is not None)
        return True

    def _pace_left(self, eps: Sequence[Endpoint], now: float) -> int | None:
        """Over-share requests that may be admitted now (None: pacing off)."""
        unpaced = self.saturation.unpaced_open(eps, now)
        return None if unpaced is None else unpaced - self.pending_paced

    def _mark_paced(self, ticket: Ticket, paced: bool) -> None:
        if paced and not ticket.paced:
            ticket.paced = True
            self.pending_paced += 1

    async def _wait(self, waiter: Waiter, ticket: Ticket, state: CycleState) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._futures[waiter.seq] = future
        self._pump()
        try:
            await future
        except asyncio.CancelledError:  # the client left (or the server stops)
            self._futures.pop(waiter.seq, None)
            if self.queue.remove(waiter, "gone"):
                self.metrics.gone.labels(ticket.band).inc()
                add_log_field(state, "flow_shed", "client_gone")
            elif waiter.state == "admitted":
                ticket.paced = self._paced_waiter(waiter)
                self._admitted(ticket, state, time.monotonic(), "queued")
            raise
        err = self._errors.pop(waiter.seq, None)
        if err is not None:
            self._shed(ticket, state, err.code or "shed")
            raise err
        ticket.paced = self._paced_waiter(waiter)
        self._admitted(ticket, state, time.monotonic(), "queued")

    def _paced_waiter(self, waiter: Waiter) -> bool:
        """Whether an admitted waiter paces its engine (the pump counted it pending)."""
        return waiter.over_share and self.p.over_share_pace_s > 0

    def _admitted(self, ticket: Ticket, state: CycleState, now: float, path: str) -> None:
        if ticket.admitted:
            return
        ticket.admitted = True
        waited = now - ticket.arrived
        self.metrics.admitted_child(ticket.band, path).inc()
        self.metrics.wait_child(ticket.band).observe(waited)
        add_log_field(state, "flow_wait_ms", round(waited * 1000, 3))

    def _shed(self, ticket: Ticket, state: CycleState, reason: str) -> None:
        self.metrics.shed.labels(ticket.band, self._labels(ticket.tenant), reason).inc()
        add_log_field(state, "flow_shed", reason)
        add_log_field(state, "flow_wait_ms", round((time.monotonic() - ticket.arrived) * 1000,
                                                   3))

    def _retry_after(self) -> dict[str, str]:
        return {"Retry-After": str(max(1, round(self.p.retry_after_s)))}

    # -- band and session ------------------------------------------------------------------
    def _band(self, req: InferenceRequest) -> str:
        if req.service_tier is not None:  # deferred work through the loopback
            return BACKGROUND
        principal = req.principal
        default = getattr(principal, "priority", None) or self.p.default_band
        highest = getattr(principal, "max_priority", None) or self.p.max_band
        asked = req.headers.get(self.p.header)
        band = default
        if asked is not None:
            band = asked.strip().lower()
            if band not in LIVE_BANDS:
                raise BadRequest(f"{self.p.header} must be one of {', '.join(LIVE_BANDS)}",
                                 param=self.p.header)
        if band_rank(band) < band_rank(highest):
            if asked is not None:
                self.metrics.capped.inc()
            band = highest
        return band

    def _session(self, req: InferenceRequest) -> str | None:
        """The request's session as its digest (what the replicas tell each other)."""
        for name in self.p.session_headers:
            value = req.headers.get(name)
            if value:
                return session_digest(value[:256])
        return None

    # -- the pump --------------------------------------------------------------------------
    def _fleet(self) -> Sequence[Endpoint]:
        """The pool's engines now (the loopback's snapshot), else the last request's."""
        return self._endpoints() if self._endpoints is not None else self._last_eps

    def _view(self, now: float) -> FleetView:
        view = self.saturation.view(self._fleet(), now)
        self._count_limit_changes()
        return view

    def _headroom(self, eps: Sequence[Endpoint], now: float) -> tuple[int, int, int]:
        """Free slots and slots past the reserves, less the admitted requests not dispatched
        yet, and the capacity (remembered for the filter's fair shares)."""
        free, opened, capacity = self.saturation.headroom(eps, now)
        self._count_limit_changes()
        self._seen_capacity = capacity
        return free - self.pending, opened - self.pending, capacity

    def _count_limit_changes(self) -> None:
        s = self.saturation
        if s.cuts != self._cuts or s.probes != self._probes:
            self.metrics.limit_changes.labels("cut").inc(s.cuts - self._cuts)
            self.metrics.limit_changes.labels("probe").inc(s.probes - self._probes)
            self._cuts, self._probes = s.cuts, s.probes

    def _pump(self) -> None:
        """Refuse the expired, then admit waiters while the fleet has free slots."""
        now = time.monotonic()
        for w in self.queue.expire(now):
            self._refuse(w, now)
        if self.queue.is_empty():
            return
        fleet = self._fleet()
        free, opened, capacity = self._headroom(fleet, now)
        left = self._pace_left(fleet, now)
        for w in self.queue.pump(free, opened, capacity, now,
                                 None if left is None else max(0, left)):
            future = self._futures.pop(w.seq, None)
            if future is not None and not future.done():
                future.set_result(None)
            self.pending += 1  # counted now: the waiter's task resumes later
            self.pending_paced += self._paced_waiter(w)

    def _refuse(self, w: Waiter, now: float) -> None:
        band = self.p.bands[w.band]
        err: HTTPError
        if self.queue.over_share(w.tenant, self._capacity(), now):
            err = RateLimited(f"waited {band.ttl_s:g} s in the {w.band} queue while the fleet "
                              "was saturated and this tenant held more than its fair share",
                              code="flow_ttl", headers=self._retry_after())
        else:
            err = Overloaded(f"waited {band.ttl_s:g} s in the {w.band} queue: every engine is "
                             "at capacity", headers=self._retry_after())
        future = self._futures.pop(w.seq, None)
        if future is not None and not future.done():
            self._errors[w.seq] = err
            future.set_result(None)

    def _capacity(self) -> int:
        view = self.current_view()
        return view.capacity if view is not None else 0

    def current_view(self) -> FleetView | None:
        """The fleet's view now (/health, /metrics; None before any request or engine)."""
        if self._endpoints is None and not self._last_eps:
            return None
        return self._view(time.monotonic())

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.p.poll_s)
            self.saturation.pacers = self._replicas()
            self.saturation.peers = None if self.shared is None else self.shared.peers()
            if not self.queue.is_empty():
                self._pump()

    def _replicas(self) -> int:
        """Replicas sharing the fleet (1 without Redis or while it is down)."""
        return 1 if self.shared is None else self.shared.replicas()

    # -- Filter ----------------------------------------------------------------------------
    def filter(self, req: InferenceRequest, state: CycleState,
               eps: Sequence[Endpoint]) -> Sequence[Endpoint]:
        """Late binding keeps its promise: the scheduler picks among the engines with a free
        slot (the gate admitted the request because one has), so a request is not sent to a
        full engine's own queue for its prefix or session pin. Per role (a P/D profile's role
        filter may come after it): a role none of whose engines has a free slot keeps them all
        (then the engines queue, as without flow control)."""
        if not eps:
            return eps
        now = time.monotonic()
        opened = self.saturation.unsaturated(eps, now, past_reserve=True)
        ticket = state.get(self._ticket)
        paced = ticket is not None and ticket.paced and not ticket.dispatched
        if len(opened) == len(eps) and not paced:  # nothing to keep out
            return eps
        over = paced or (ticket is not None and ticket.band in UNRESERVED_BANDS) \
            or self.queue.over_share(req.tenant or ANONYMOUS, self._seen_capacity, now,
                                     excluding=1)
        if paced:  # and one over its share enters an engine not paced, if one is open
            opened = [ep for ep in opened if not self.saturation.paced(ep, now)] or opened
        # a request over its share leaves each engine's reserve to light tenants' turns
        free = set(map(id, opened)) if over and opened else set(
            map(id, self.saturation.unsaturated(eps, now)))
        if len(free) == len(eps):
            return eps
        kept: list[Endpoint] = []
        for role in {ep.role for ep in eps}:  # per role: a P/D profile's role filter follows
            mine = [ep for ep in eps if ep.role == role]
            open_ = [ep for ep in mine if id(ep) in free]
            if not open_:
                self.unfiltered += 1
            kept.extend(open_ or mine)
        return [ep for ep in eps if ep in kept]

    # -- hooks -----------------------------------------------------------------------------
    async def before_dispatch(self, req: InferenceRequest, state: CycleState,
                              decision: RoutingDecision) -> None:
        """The request takes its engine slot now (the pool's lease): no longer pending."""
        ticket = state.get(self._ticket)
        if ticket is not None and ticket.admitted and not ticket.dispatched:
            ticket.dispatched = True
            self.pending -= 1
            if ticket.paced:
                self.pending_paced -= 1
                self.saturation.pace(decision.target.id, time.monotonic())

    async def on_usage(self, req: InferenceRequest, state: CycleState, target: Endpoint,
                       usage: Usage) -> None:
        """The tenant's counter corrected from the prompt estimate to the real usage; the
        session's served tokens."""
        ticket = state.get(self._ticket)
        if ticket is None:
            return
        cost = self.fair.cost(usage.prompt_tokens, usage.completion_tokens)
        if not ticket.corrected:
            ticket.corrected = True
            cost -= self.fair.cost(ticket.tokens, 0)
        self.fair.served(ticket.tenant, cost)
        self.fair.used(ticket.tenant, self.fair.cost(usage.prompt_tokens,
                                                     usage.completion_tokens))
        tokens = usage.prompt_tokens + usage.completion_tokens
        self.fair.session_served(ticket.tenant, ticket.session, tokens)
        if self.shared is not None:
            self.shared.served(ticket.tenant, ticket.session, tokens)

    async def on_request_end(self, req: InferenceRequest, state: CycleState,
                             status: int) -> None:
        """Releases what admission took (the tenant's in-flight count, a pending slot), then
        lets the next waiters go."""
        ticket = state.get(self._ticket)
        if ticket is None or not ticket.admitted:
            return
        ticket.admitted = False
        if not ticket.dispatched:
            self.pending -= 1
            self.pending_paced -= ticket.paced
        self.queue.release(ticket.tenant, time.monotonic())
        if not self.queue.is_empty():
            self._pump()

    # -- plumbing --------------------------------------------------------------------------
    def bind_loopback(self, loopback: LoopbackCaller) -> None:
        """The pool's current snapshot, read on every pump (fresh in-flight counts)."""
        self._endpoints = loopback.endpoints

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._tick(), name=f"kvgate-flow-{self.name}")
        if self.shared is None:
            self.shared = FlowShare.started(self.p, self.fair, self.name,
                                            Demand(self._fleet, self.saturation))

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        shared, self.shared = self.shared, None
        if shared is not None:
            await shared.stop()
        for seq, future in list(self._futures.items()):  # shutting down: nobody is admitted
            with contextlib.suppress(asyncio.InvalidStateError):
                self._errors[seq] = Overloaded("the gateway is shutting down",
                                               headers=self._retry_after())
                future.set_result(None)
        self._futures.clear()

    def collector(self) -> Collector:
        return self.metrics

    def health(self) -> Mapping[str, object]:
        view = self.current_view()
        out: dict[str, object] = {
            "queued": {band: self.queue.queued(band) for band in BANDS},
            "pending": self.pending, "tenants": self.fair.tenants(),
            "sessions": self.fair.sessions(),
        }
        if self.shared is not None:
            out.update(self.shared.health())
        if view is not None:
            out["capacity"] = view.capacity
            out["free"] = view.free() - self.pending
            out["pools_saturated"] = view.pool_saturated()
            out["engine_limits"] = {e.id: e.limit for e in view.engines}
            if self.saturation.peers is not None:  # sharing the limits with other replicas
                out["fleet_limits"] = {e.id: e.learned for e in view.engines}
                out["demand"] = {"own": self.saturation.demand(self._fleet()),
                                 "others": self.saturation.peers.demand}
            if view.stale:
                out["stale_metrics"] = list(view.stale)
            if view.blind:
                out["no_queue_metrics"] = list(view.blind)
        return out


__all__ = ["FlowControl", "Ticket"]
