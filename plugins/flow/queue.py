"""The flow-control queue (pure, synchronous): requests waiting in the gateway while the fleet
is saturated, by priority band, tenant and session, and the choice of the next one.

Order (:meth:`FlowQueue.pump`): strict priority between bands (interactive, standard, batch,
then background); within a band the tenant with the smallest virtual token counter
(plugins/flow/fairness.py); within the tenant the request with the smallest
``session's served tokens - wait x aging_tokens_per_s`` (least attained service, aged).

Reserve: each engine keeps ``reserve_fraction`` of its limit (rounded down) for tenants under
their fair share (capacity x weight / active tenants' weights): while no free slot is left past
the engines' reserves (``opened``), only such tenants get one, and never for a request of the
batch or background band. A tenant is *active* while it
has requests queued or in flight, or had one within ``active_window_s``.

Bounded: at most ``max_queued`` waiters per band (then :meth:`enqueue` refuses); heaps hold
removed waiters lazily and are compacted past twice their live size; the per-tenant activity
maps are dropped for tenants idle past the active window.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

from kvgate.plugins.flow.fairness import Fairness
from kvgate.plugins.flow.params import BANDS, UNRESERVED_BANDS, FlowParams


@dataclass(eq=False, slots=True)
class Waiter:
    """One queued request. ``state``: queued, admitted, expired, gone (client left)."""

    seq: int
    band: str
    tenant: str
    session: str | None
    tokens: int
    enqueued_at: float
    rank: float = 0.0
    state: str = "queued"
    #: Admitted while its tenant held its fair share or more (paced: ``over_share_pace_s``).
    over_share: bool = False


@dataclass(slots=True)
class _Band:
    by_tenant: dict[str, list[tuple[float, int, Waiter]]] = field(default_factory=dict)
    live: dict[str, int] = field(default_factory=dict)
    arrivals: deque[Waiter] = field(default_factory=deque)
    count: int = 0


class FlowQueue:
    """The bands' queues and the tenants' activity (admitted and in flight here)."""

    def __init__(self, params: FlowParams, fairness: Fairness) -> None:
        self.p = params
        self.fair = fairness
        self._bands = {band: _Band() for band in BANDS}
        self._seq = 0
        #: Waiters queued in all bands (is_empty on every request: O(1)).
        self._total = 0
        #: Requests admitted and not ended, by tenant; last activity by tenant.
        self.in_flight: dict[str, int] = {}
        self._last_active: dict[str, float] = {}

    # -- state ---------------------------------------------------------------------------
    def queued(self, band: str | None = None) -> int:
        if band is not None:
            return self._bands[band].count
        return sum(b.count for b in self._bands.values())

    def tenant_queued(self, tenant: str) -> int:
        return sum(b.live.get(tenant, 0) for b in self._bands.values())

    def is_empty(self) -> bool:
        return self._total == 0

    # -- requests ------------------------------------------------------------------------
    def enqueue(self, band: str, tenant: str, session: str | None, tokens: int,
                now: float) -> Waiter | None:
        """A new waiter, or None when ``band`` holds ``max_queued`` already."""
        b = self._bands[band]
        if b.count >= self.p.bands[band].max_queued:
            return None
        if not self.tenant_queued(tenant):
            self.fair.lift(tenant, self._backlogged_min())
        self._seq += 1
        rank = (self.fair.attained(tenant, session) + now * self.p.aging_tokens_per_s
                if self.p.session_order == "las" else float(self._seq))
        w = Waiter(self._seq, band, tenant, session, tokens, now, rank)
        heapq.heappush(b.by_tenant.setdefault(tenant, []), (rank, w.seq, w))
        b.live[tenant] = b.live.get(tenant, 0) + 1
        b.arrivals.append(w)
        b.count += 1
        self._total += 1
        self._last_active[tenant] = now
        return w

    def remove(self, w: Waiter, state: str) -> bool:
        """Take a queued waiter out (``state``: gone, expired); False if it was not queued."""
        if w.state != "queued":
            return False
        w.state = state
        b = self._bands[w.band]
        b.count -= 1
        self._total -= 1
        left = b.live[w.tenant] - 1
        heap = b.by_tenant[w.tenant]
        if left == 0:
            del b.live[w.tenant], b.by_tenant[w.tenant]
        else:
            b.live[w.tenant] = left
            if len(heap) > 2 * left + 16:
                b.by_tenant[w.tenant] = [e for e in heap if e[2].state == "queued"]
                heapq.heapify(b.by_tenant[w.tenant])
        return True

    def admit_now(self, tenant: str, tokens: int, now: float) -> None:
        """Account a request admitted without queueing (the fast path)."""
        if self._total == 0:
            self.fair.lift(tenant, None)
        elif not self.tenant_queued(tenant):
            self.fair.lift(tenant, self._backlogged_min())
        self._admitted(tenant, tokens, now)

    def release(self, tenant: str, now: float) -> None:
        """An admitted request of ``tenant`` ended."""
        left = self.in_flight.get(tenant, 0) - 1
        if left > 0:
            self.in_flight[tenant] = left
        else:
            self.in_flight.pop(tenant, None)
        self._last_active[tenant] = now

    def expire(self, now: float) -> list[Waiter]:
        """Waiters past their band's TTL, taken out (state ``expired``)."""
        out: list[Waiter] = []
        for band, b in self._bands.items():
            ttl = self.p.bands[band].ttl_s
            while b.arrivals:
                head = b.arrivals[0]
                if head.state != "queued":
                    b.arrivals.popleft()
                elif now - head.enqueued_at >= ttl:
                    b.arrivals.popleft()
                    self.remove(head, "expired")
                    out.append(head)
                else:
                    break
        return out

    # -- choice --------------------------------------------------------------------------
    def pump(self, free: int, opened: int, capacity: int, now: float,
             paced: int | None = None) -> list[Waiter]:
        """Admit waiters while ``free`` slots last; past ``opened`` (the free slots beyond the
        engines' reserves) only tenants under their fair share of ``capacity``, and tenants over
        it only ``paced`` at most (None: no bound; the engines not paced now); returns them in
        admission order (state ``admitted``; ``over_share`` set on those over their share)."""
        out: list[Waiter] = []
        if free <= 0 or self.is_empty():
            return out
        shares = self._shares(capacity, now)
        while free > 0:
            w = self._next(opened <= 0, shares, paced is None or paced > 0)
            if w is None:
                break
            w.over_share = self.in_flight.get(w.tenant, 0) >= shares.get(w.tenant, 0.0)
            self._take(w, now)
            out.append(w)
            free -= 1
            opened -= 1
            if w.over_share and paced is not None:
                paced -= 1
        return out

    def over_share(self, tenant: str, capacity: int, now: float, excluding: int = 0) -> bool:
        """Whether ``tenant`` holds its fair share of ``capacity`` (or more) in flight, not
        counting ``excluding`` of its requests (the one being placed)."""
        share = self._shares(capacity, now).get(tenant, float(capacity))
        return self.in_flight.get(tenant, 0) - excluding >= share

    def _shares(self, capacity: int, now: float) -> dict[str, float]:
        window = self.p.active_window_s
        for t in [t for t, at in self._last_active.items()
                  if now - at > window and t not in self.in_flight
                  and not self.tenant_queued(t)]:
            del self._last_active[t]
        active = set(self._last_active) | set(self.in_flight)
        total = sum(self.fair.weight(t) for t in active) or 1.0
        return {t: capacity * self.fair.weight(t) / total for t in active}

    def _next(self, reserve_zone: bool, shares: dict[str, float],
              over_share_ok: bool = True) -> Waiter | None:
        for band in BANDS:
            b = self._bands[band]
            if not b.count or (reserve_zone and band in UNRESERVED_BANDS):
                continue
            for tenant in sorted(b.live, key=self.fair.counter):
                if (reserve_zone or not over_share_ok) and \
                        self.in_flight.get(tenant, 0) >= shares.get(tenant, 0.0):
                    continue
                return self._head(b, tenant)
        return None

    @staticmethod
    def _head(b: _Band, tenant: str) -> Waiter:
        heap = b.by_tenant[tenant]
        while heap[0][2].state != "queued":
            heapq.heappop(heap)
        return heap[0][2]

    def _take(self, w: Waiter, now: float) -> None:
        self.remove(w, "admitted")
        self._admitted(w.tenant, w.tokens, now)

    def _admitted(self, tenant: str, tokens: int, now: float) -> None:
        self.in_flight[tenant] = self.in_flight.get(tenant, 0) + 1
        self._last_active[tenant] = now
        self.fair.served(tenant, self.fair.cost(tokens, 0))
        self.fair.dequeued(tenant)

    def _backlogged_min(self) -> float | None:
        tenants = {t for b in self._bands.values() for t in b.live}
        return min((self.fair.counter(t) for t in tenants), default=None)


__all__ = ["FlowQueue", "Waiter"]
