"""Saturation, measured (pure, no I/O): per engine a request limit learned from what the engine
reports, and the free request slots of each pool.

Inputs per engine (an :class:`~kvgate.middleware.framework.types.Endpoint` of the pool's
snapshot): the gateway's own in-flight requests and prompt tokens (taken on dispatch, released
on every outcome: exact and current), and the engine's scraped ``running`` / ``waiting`` requests,
KV usage and KV capacity (``pool.metrics_interval_s`` old at most; ignored past
``metrics_stale_s``, which shows on /health, /metrics and in a WARNING).

An engine is **saturated** (takes no new request) when it is out of rotation, or the gateway
has ``limit`` requests in flight on it (``in_flight``), or its last fresh scrape showed KV
usage at ``max_kv_usage`` or more (``kv_usage``), or its in-flight prompt tokens reach the
token bound (``tokens``), or -- with learning off -- it reported more than
``max_engine_waiting`` queued requests (``engine_waiting``).

The limit starts at ``initial_in_flight_per_engine`` and is learned (see FlowParams.learn): a
scrape showing a queue in the engine cuts it to this gateway's share of what the engine runs; a
scrape showing the engine full without a queue doubles it until the first cut (slow start),
then raises it by one while the engine runs fewer requests than it did when it last queued
(its observed batch size: a free seat, e.g. another replica left), and past that by one at
most every ``probe_interval_s`` (the batch may have grown) -- each raise only while every
request counted in flight here is at the engine (``running + waiting >= in_flight``: not the
gateway's own lag in relaying finished answers) -- never past ``max_in_flight_per_engine``
(with ``learn: false`` the limit is that, fixed). So a gateway in front of a 16-sequence engine
converges on 16, and N replicas in front of it on about 16 / N each, without talking to each
other. With ``share_limits`` and other replicas on Redis (plugins/flow/peers.py) the learner
counts every replica's requests in flight, so the limit is the engine's for the fleet, and
this replica keeps its share of it, following its demand.

Pools: engines of role ``both`` and ``decode`` serve a request (the serving pool); ``prefill``
engines form the prefill pool. A request needs a free slot in the serving pool and, when
there is a prefill pool, in it too (P/D saturation: each side saturates on its own).
Bounded: one record per engine the pool has (records of engines gone are dropped).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvgate.middleware.framework.types import KV_CAPACITY_TOKENS, Endpoint, Role
from kvgate.plugins.flow.params import FlowParams
from kvgate.plugins.flow.peers import Peers

log = logging.getLogger("kvgate.flow")
#: Scrapes a queue below the engine's observed batch must last to count as a full engine (its
#: batch shrank, e.g. a restart with a smaller ``max_num_seqs``), rather than a burst waiting
#: for a step's prefill budget (gone by the next scrape).
QUEUE_SCRAPES = 3


@dataclass(slots=True)
class _Learned:
    limit: int
    #: Slow start: the limit doubles until the engine first queues.
    slow_start: bool = True
    #: The engine's running count the last time it queued (raised whenever it ran more without
    #: a queue): its batch size as observed.
    ceiling: float | None = None
    #: Consecutive scrapes with a queue while the engine ran below its observed batch.
    short_queues: int = 0
    seen_scrape: float | None = None
    last_probe: float = 0.0
    stale: bool = False
    #: The engine answers its metrics scrape without ``running`` / ``waiting`` counts (a
    #: third-party server, an engine of unknown kind): nothing to learn a limit from.
    blind: bool = False
    #: When a request of a tenant over its fair share was last sent here (``over_share_pace_s``).
    paced_at: float | None = None
    #: Sharing with peers: this replica's weighted share of ``limit`` (plugins/flow/peers.py).
    share: int | None = None


@dataclass(frozen=True, slots=True)
class EngineView:
    id: str
    role: str
    #: This replica's limit there (its share of ``learned`` when sharing with peers).
    limit: int
    in_flight: int
    free: int
    #: Why it takes no request (``in_flight``, ``kv_usage``, ``tokens``, ``engine_waiting``,
    #: ``unhealthy``), or None.
    saturated: str | None
    #: The learned limit: this replica's own, or the fleet's when sharing with peers.
    learned: int = 0


@dataclass(frozen=True, slots=True)
class FleetView:
    engines: tuple[EngineView, ...]
    #: Free request slots of the serving pool (role both/decode) and of the prefill pool
    #: (None: no prefill pool).
    serving_free: int
    prefill_free: int | None
    #: Sum of the serving pool's healthy engines' limits: the fleet's capacity in requests.
    capacity: int
    stale: tuple[str, ...] = field(default=())
    #: Engines that report no queue metrics (limited by ``max_in_flight_per_engine`` only).
    blind: tuple[str, ...] = field(default=())

    def free(self) -> int:
        """Slots a request may take now (both pools when there is a prefill pool)."""
        if self.prefill_free is None:
            return self.serving_free
        return min(self.serving_free, self.prefill_free)

    def pool_saturated(self) -> dict[str, bool]:
        out = {"serving": self.serving_free <= 0}
        if self.prefill_free is not None:
            out["prefill"] = self.prefill_free <= 0
        return out


class Saturation:
    """Per-engine learned limits and the fleet's view (synchronous; one per plugin)."""

    def __init__(self, params: FlowParams, backlog: Callable[[], int] = lambda: 0) -> None:
        self.p = params
        self._learned: dict[str, _Learned] = {}
        #: Requests of this replica waiting for a slot (queued, admitted not dispatched): with
        #: its requests in flight, its demand (the share of each limit it keeps with peers).
        self._backlog = backlog
        #: The other replicas sharing the limits (plugins/flow/peers.py), as last read; None:
        #: alone, or Redis down, or ``share_limits`` off.
        self.peers: Peers | None = None
        #: This replica's demand at the last look at the whole fleet (:meth:`view`,
        #: :meth:`headroom`): the filter's look at a profile's subset weighs its shares by it.
        self._seen_demand = 0
        #: Gateway replicas pacing the same engines (this one and the others the fairness
        #: exchange saw last round; 1 without Redis): each paces at that many times
        #: ``over_share_pace_s``, so the fleet's over-share admissions enter an engine at one
        #: gateway's interval, not N times as often.
        self.pacers = 1
        #: Limit changes (cuts and probes), for /metrics.
        self.cuts = 0
        self.probes = 0

    def limits(self) -> dict[str, int]:
        return {k: v.limit for k, v in self._learned.items()}

    def view(self, eps: Sequence[Endpoint], now: float) -> FleetView:
        """Learn from fresh scrapes, then each engine's verdict and the pools' free slots."""
        self._forget(eps)
        demand = self._seen_demand = self.demand(eps)
        views = tuple(self._engine(ep, now, demand) for ep in eps)
        serving = [v for v in views if v.role != Role.PREFILL.value]
        prefill = [v for v in views if v.role == Role.PREFILL.value]
        capacity = sum(v.limit for v in serving if v.saturated != "unhealthy")
        stale = tuple(k for k, v in self._learned.items() if v.stale)
        blind = tuple(k for k, v in self._learned.items() if v.blind)
        return FleetView(views, sum(v.free for v in serving),
                         sum(v.free for v in prefill) if prefill else None, capacity, stale,
                         blind)

    def headroom(self, eps: Sequence[Endpoint], now: float) -> tuple[int, int, int]:
        """``(free, open, capacity)``: :meth:`view`'s ``free()`` and ``capacity``, learning
        alike, without building the view (every admission asks this; /health and /metrics
        read the view), and the free slots past each engine's reserve (``open``: what a tenant
        over its fair share may take)."""
        self._forget(eps)
        serving = capacity = opened = 0
        prefill: int | None = None
        prefill_open = 0
        demand = self._seen_demand = self.demand(eps)
        for ep in eps:
            limit, why = self._verdict(ep, now, demand)
            free = 0 if why is not None else limit - ep.in_flight_requests
            unreserved = 0 if free == 0 or self._in_reserve(ep, limit, now) else max(
                0, free - self._reserve(ep, limit))
            if ep.role is Role.PREFILL:
                prefill = free + (prefill or 0)
                prefill_open += unreserved
            else:
                serving += free
                opened += unreserved
                if why != "unhealthy":
                    capacity += limit
        if prefill is None:
            return serving, opened, capacity
        return min(serving, prefill), min(opened, prefill_open), capacity

    def pace(self, engine: str, now: float) -> None:
        """A request of a tenant over its fair share was sent to ``engine`` now: the next one
        enters it ``over_share_pace_s`` later at the earliest (an unknown engine: ignored)."""
        learned = self._learned.get(engine)
        if learned is not None:
            learned.paced_at = now

    def paced(self, ep: Endpoint, now: float) -> bool:
        """Whether ``ep`` took an over-share request from this replica less than
        ``over_share_pace_s`` x :attr:`pacers` ago."""
        learned = self._learned.get(ep.id)
        at = None if learned is None else learned.paced_at
        return at is not None and now - at < self.p.over_share_pace_s * self.pacers

    def unpaced_open(self, eps: Sequence[Endpoint], now: float) -> int | None:
        """Serving engines with a free slot past their reserve that an over-share request may
        enter now (not paced): how many such requests may be admitted at once (None: pacing
        is off)."""
        if self.p.over_share_pace_s <= 0:
            return None
        return sum(1 for ep in self.unsaturated(eps, now, past_reserve=True)
                   if ep.role is not Role.PREFILL and not self.paced(ep, now))

    def reserve(self, limit: int, learned: int | None = None) -> int:
        """An engine's slots kept for tenants under their fair share (``reserve_fraction`` of
        its limit, rounded down: 2 of 16, none of fewer than 8). Sharing the ``learned`` fleet
        limit with peers, this replica's part of the fleet's reserve, rounded up: its share of
        a 16-seat engine moves between 7 and 9 with the replicas' demand, and a reserve taken
        of the share itself vanished at 7 (a light tenant's turn then waited for one of the
        flood's requests to end)."""
        if learned is None or self.peers is None or limit >= learned:
            return int(limit * self.p.reserve_fraction)
        fleet = int(learned * self.p.reserve_fraction)
        return min(limit, math.ceil(fleet * limit / learned))

    def _forget(self, eps: Sequence[Endpoint]) -> None:
        if len(self._learned) > len(eps):  # engines gone: forget them
            ids = {ep.id for ep in eps}
            for gone in [k for k in self._learned if k not in ids]:
                del self._learned[gone]

    def unsaturated(self, eps: Sequence[Endpoint], now: float,
                    past_reserve: bool = False) -> list[Endpoint]:
        """The engines of ``eps`` that take a request now (no learning, nothing forgotten:
        ``eps`` may be a profile's subset); ``past_reserve``: only those with a free slot
        past their reserve (for a tenant over its fair share)."""
        out = []
        demand = None if self.peers is None else self._seen_demand
        for ep in eps:
            learned = self._learned.get(ep.id)
            limit = self._mine(ep, self._new() if learned is None else learned, demand)
            if self._saturated(ep, limit, self._scraped_lately(ep, now), past_reserve):
                continue
            if past_reserve and limit - ep.in_flight_requests <= self._reserve(ep, limit):
                continue
            out.append(ep)
        return out

    def _reserve(self, ep: Endpoint, limit: int) -> int:
        learned = self._learned.get(ep.id)
        return self.reserve(limit, None if learned is None else learned.limit)

    def _in_reserve(self, ep: Endpoint, limit: int, now: float) -> bool:
        """Whether ``ep`` (not saturated) is past what a tenant over its share may fill of its
        KV usage or in-flight tokens (:meth:`_saturated` with ``over_share``)."""
        return self._saturated(ep, limit, self._scraped_lately(ep, now), True) is not None

    def _scraped_lately(self, ep: Endpoint, now: float) -> bool:
        """Whether ``ep``'s last scrape is within ``metrics_stale_s`` (read only: no
        learning, no warning; :meth:`_fresh` is the verdict's, which does both)."""
        scraped = ep.metrics.scraped_at
        return scraped is not None and now - scraped <= self.p.metrics_stale_s

    def _new(self) -> _Learned:
        p = self.p
        if p.learn:
            return _Learned(p.initial_in_flight_per_engine)
        return _Learned(p.max_in_flight_per_engine, slow_start=False)

    def demand(self, eps: Sequence[Endpoint], own: bool = False) -> int:
        """This replica's demand: its requests waiting for a slot and in flight (computed
        with peers, or ``own``: to tell them)."""
        if self.peers is None and not own:
            return 0
        return self._backlog() + sum(ep.in_flight_requests for ep in eps
                                     if ep.role is not Role.PREFILL)

    def _mine(self, ep: Endpoint, learned: _Learned, demand: float | None) -> int:
        """This replica's limit on ``ep``: the learned one, or with peers its share of it."""
        if self.peers is None or demand is None:
            learned.share = None
            return learned.limit
        mine, learned.share = self.peers.share(learned.limit, ep.id, demand,
                                               self.p.min_in_flight_per_engine, learned.share)
        return mine

    def _fleet_in_flight(self, ep: Endpoint) -> int:
        """Requests in flight on ``ep`` from this replica and, with peers, from the others."""
        others = 0 if self.peers is None else self.peers.others(ep.id)
        return ep.in_flight_requests + others

    def _engine(self, ep: Endpoint, now: float, demand: int) -> EngineView:
        limit, why = self._verdict(ep, now, demand)
        free = 0 if why is not None else limit - ep.in_flight_requests
        learned = self._learned[ep.id].limit
        return EngineView(ep.id, ep.role.value, limit, ep.in_flight_requests, free, why,
                          learned)

    def _verdict(self, ep: Endpoint, now: float, demand: int) -> tuple[int, str | None]:
        """This replica's limit on the engine, learned from a fresh scrape first, and why the
        engine is saturated."""
        learned = self._learned.get(ep.id)
        if learned is None:
            learned = self._learned[ep.id] = self._new()
        fresh = self._fresh(ep, learned, now)
        if fresh and ep.metrics.scraped_at != learned.seen_scrape:
            self._blind(ep, learned)
            if self.p.learn:
                self._learn(ep, learned, now, demand)
        limit = self._mine(ep, learned, demand)
        return limit, self._saturated(ep, limit, fresh)

    def _fresh(self, ep: Endpoint, learned: _Learned, now: float) -> bool:
        scraped = ep.metrics.scraped_at
        fresh = scraped is not None and now - scraped <= self.p.metrics_stale_s
        stale = scraped is not None and not fresh and ep.healthy
        if stale and not learned.stale:
            log.warning("flow control: engine %s's metrics are %.0f s old (more than "
                        "metrics_stale_s=%s): saturation from the gateway's counters only",
                        ep.id, now - (now if scraped is None else scraped),
                        self.p.metrics_stale_s)
        learned.stale = stale
        return fresh

    def _blind(self, ep: Endpoint, learned: _Learned) -> None:
        """An engine whose scrape carries no running / waiting counts gives no evidence of a
        queue: it gets ``max_in_flight_per_engine`` (what an engine of unknown batch size may
        take), not the slow start's guess, which it could never leave."""
        m = ep.metrics
        blind = m.running is None and m.waiting is None
        if blind and not learned.blind:
            log.warning("flow control: engine %s reports no running/waiting metrics: its "
                        "limit is max_in_flight_per_engine=%d, not learned", ep.id,
                        self.p.max_in_flight_per_engine)
            learned.limit = self.p.max_in_flight_per_engine
            learned.slow_start = False
        elif not blind and learned.blind:
            log.info("flow control: engine %s reports its queue again: limit learned", ep.id)
            learned.limit = self._new().limit
            learned.slow_start = self.p.learn
        learned.blind = blind

    def _learn(self, ep: Endpoint, learned: _Learned, now: float, demand: int) -> None:
        m = ep.metrics
        if m.scraped_at == learned.seen_scrape or m.running is None or m.waiting is None:
            return
        learned.seen_scrape = m.scraped_at
        p = self.p
        allowed = p.max_engine_waiting
        if m.waiting > allowed:  # a queue: cut, when it means no free seat; never raise
            if self._seat_bound(learned, m.running):
                self._cut(ep, learned, m.running, m.waiting)
            return
        learned.short_queues = 0
        if learned.ceiling is not None and m.running > learned.ceiling:
            learned.ceiling = m.running  # it ran that many at once: its batch is no smaller
        if (self._at_limit(ep, learned, demand)
                and learned.limit < p.max_in_flight_per_engine
                and m.running + m.waiting >= ep.in_flight_requests):
            # at the limit, and every request counted here is at the engine (not finished
            # there and still being relayed: a busy gateway must not read its own lag as
            # free seats, and let a burst into the engine's queue when it catches up)
            if learned.slow_start:
                learned.limit = min(p.max_in_flight_per_engine, 2 * learned.limit)
            elif learned.ceiling is not None and m.running < learned.ceiling - 0.5:
                # the engine reports a free seat: no queue expected (sharing with peers: the
                # engine's observed batch at once, each replica's share being its part)
                learned.limit = min(p.max_in_flight_per_engine, max(
                    learned.limit + 1, int(learned.ceiling) if self.peers else 0))
            elif now - learned.last_probe >= p.probe_interval_s:
                learned.limit += 1  # past the observed batch size: it may have grown
                learned.last_probe = now
            else:
                return
            self.probes += 1

    def _at_limit(self, ep: Endpoint, learned: _Learned, demand: int) -> bool:
        """Whether the limit holds requests back: every replica's requests in flight fill it,
        or (sharing with peers) this replica's own share is full while it has requests
        waiting. The shares sum to the limit only up to rounding and hysteresis: waiting for
        the fleet to fill the limit exactly left two replicas at 3 + 3 of a limit of 7, on a
        16-sequence engine, for good."""
        if self._fleet_in_flight(ep) >= learned.limit:
            return True
        return (self.peers is not None and self._backlog() > 0
                and ep.in_flight_requests >= self._mine(ep, learned, demand))

    def _cut(self, ep: Endpoint, learned: _Learned, running: float, waiting: float) -> None:
        """A queue in a full engine: this replica's share of the engine's batch, but never
        below the limit less the queue (the in-flight count moved since the scrape: a probe's
        one queued request costs one slot, not a rounding's two)."""
        p = self.p
        allowed = p.max_engine_waiting
        learned.ceiling, learned.short_queues, learned.slow_start = running, 0, False
        share = self._fleet_in_flight(ep) * (running + allowed) / (running + waiting)
        cut = max(round(share), learned.limit - int(waiting - allowed))
        cut = max(p.min_in_flight_per_engine, min(learned.limit, cut))
        if cut < learned.limit:
            self.cuts += 1
            log.info("flow control: engine %s queues %d requests: limit %d -> %d",
                     ep.id, int(waiting), learned.limit, cut)
            learned.limit = cut

    def _seat_bound(self, learned: _Learned, running: float) -> bool:
        """Whether a queue in the engine means it has no free seat: it runs its observed batch
        (or none was observed yet), or the queue outlasted ``QUEUE_SCRAPES`` scrapes. Below its
        batch a queue is requests waiting for the prefill budget of a step (a burst arriving),
        gone by the next scrape: cutting on it left a 16-sequence engine at 7."""
        if learned.ceiling is None or running >= learned.ceiling - 0.5:
            return True
        learned.short_queues += 1
        return learned.short_queues >= QUEUE_SCRAPES

    def _saturated(self, ep: Endpoint, limit: int, fresh: bool,
                   over_share: bool = False) -> str | None:
        """Why ``ep`` takes no request now (None: it takes one). ``over_share``: for a tenant
        over its fair share, who leaves the last ``reserve_fraction`` of the KV usage and of
        the in-flight tokens to the others, as it leaves them the last slots: an engine full
        by tokens long before by requests (long prompts, a large batch) otherwise let a light
        tenant's turn wait for a flood's request to end."""
        if not ep.healthy:
            return "unhealthy"
        if ep.in_flight_requests >= limit:
            return "in_flight"
        m, p = ep.metrics, self.p
        room = 1.0 - p.reserve_fraction if over_share else 1.0
        if fresh and m.kv_usage is not None and m.kv_usage >= p.max_kv_usage * room:
            return "kv_usage"
        cap = p.max_in_flight_tokens_per_engine
        if cap is None and KV_CAPACITY_TOKENS in m.extra:
            cap = int(m.extra[KV_CAPACITY_TOKENS] * p.max_kv_usage)
        if cap is not None and ep.in_flight_tokens >= cap * room and ep.in_flight_requests > 0:
            return "tokens"
        if (fresh and not p.learn and m.waiting is not None
                and m.waiting > p.max_engine_waiting):
            return "engine_waiting"
        return None


__all__ = ["EngineView", "FleetView", "Saturation"]
