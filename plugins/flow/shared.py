"""Fairness accounting shared between gateway replicas (``flow-control`` with ``redis_url``;
``kvgate serve --redis`` sets it).

**Tenants.** Each replica publishes the tokens it served per tenant (cumulative, real usage)
every ``share_interval_s`` and adds the growth of the other replicas' figures to its own virtual
token counters, through the same exchange the token-load scorer uses (plugins/load/shared_load.py:
one string per replica with a TTL, a registry sorted set, ``MGET``; no Redis I/O on the
request path). So a tenant flooding through replica 1 is behind a light tenant on replica 2
too: N replicas order their queues as one would.

**Sessions** (``share_sessions``, on by default). Behind a round-robin balancer a replica sees
one turn in N of an agent session, so its least-attained-service rank would be its own part of
the session's service: a long session moved to another replica would rank there as a
newcomer. Every usage's session tokens are therefore told to the other replicas through a
:class:`~kvgate.plugins.common.broadcast.Broadcast` on ``<redis_prefix>sessions:<plugin>``
(batched every 50 ms: a session's next turn comes later than that) as
``[tenant, session digest, tokens]``; the receiver adds them to the session's attained service
as if it had served them. The session is its blake2b-128 digest (as the session table's Redis
key): no session id leaves the process in clear; the tenant is already in the tenants'
exchange. Bounded as the local counters (``max_sessions``, LRU).

**Limits** (``share_limits``, on by default). The tenants' exchange also carries each
replica's requests in flight per engine (as its per-engine loads) and its demand (a gauge:
requests queued, pending and in flight); :meth:`FlowShare.peers` hands them to the saturation
view, which learns each engine's limit for the fleet and keeps this replica's share of it
following its demand (plugins/flow/peers.py). Without it (or Redis down) each replica learns
its own share of each engine's batch from the engine's running / waiting counts
(plugins/flow/saturation.py). The reserve and the fair shares are per replica (each holds its
share of the fleet's slots).

Redis down: the exchange drops the remote view and the broadcast drops what it would tell
(WARNING once per outage each, /health says ``degraded``, ``kvgate_flow_shared_down`` and
``kvgate_flow_shared_sessions_down`` are 1) and each replica orders by its own counters;
requests never wait for Redis.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvgate.middleware.framework.types import Endpoint
from kvgate.plugins.common.broadcast import (
    FLUSH_S,
    MAX_PENDING,
    RETRY_S,
    Broadcast,
    Channel,
    Receive,
    broadcast_families,
    connect_pair,
)
from kvgate.plugins.flow.fairness import Fairness
from kvgate.plugins.flow.params import FlowParams
from kvgate.plugins.flow.peers import DEMAND, Peers, peers_from
from kvgate.plugins.flow.saturation import Saturation
from kvgate.plugins.load.loads import EngineLoad
from kvgate.plugins.load.shared_load import (
    CounterShare,
    GaugeShare,
    LoadExchange,
    connect,
    replica_id,
)

#: Bounds on a told item's fields (the receiver's validation): a tenant id as the keys file
#: allows it, a session digest (32 hex digits), tokens of one usage.
MAX_TENANT_CHARS, DIGEST_CHARS, MAX_ITEM_TOKENS = 256, 32, 1e9


class Demand:
    """This replica's side of the limits' share: what it tells (its requests in flight per
    engine, its demand) and what it last heard (the others' demand, summed)."""

    def __init__(self, fleet: Callable[[], Sequence[Endpoint]], saturation: Saturation) -> None:
        self._fleet = fleet
        self._saturation = saturation
        self.others: float = 0.0

    def loads(self) -> dict[str, EngineLoad]:
        return {ep.id: EngineLoad(0, 0, ep.in_flight_requests) for ep in self._fleet()}

    def gauges(self) -> GaugeShare:
        def local() -> Mapping[str, float]:
            return {DEMAND: float(self._saturation.demand(self._fleet(), own=True))}

        def remote(sums: Mapping[str, float]) -> None:
            self.others = sums.get(DEMAND, 0.0)

        return GaugeShare(local, remote)


def exchange(params: FlowParams, fair: Fairness,
             demand: Demand | None = None) -> LoadExchange | None:
    """The tenants' exchange for ``params.redis_url`` (None without one), carrying the limits'
    share when ``demand`` is given; not started."""
    if params.redis_url is None:
        return None

    def local() -> Mapping[str, float]:
        return dict(fair.own)

    def remote(deltas: Mapping[str, float]) -> None:
        fair.remote(dict(deltas))

    return LoadExchange(
        connect(params.redis_url.get_secret_value(), params.redis_timeout_s),
        dict if demand is None else demand.loads,
        prefix=params.redis_prefix, interval_s=params.share_interval_s,
        ttl_s=params.share_ttl_s, timeout_s=params.redis_timeout_s, max_replicas=64,
        counters=CounterShare(local, remote),
        gauges=None if demand is None else demand.gauges())


def session_item(tenant: str, session: str, tokens: float) -> list[Any]:
    return [tenant, session, tokens]


def parse_session(item: Any) -> tuple[str, str, float] | None:
    """Another replica's ``[tenant, session digest, tokens]``, or None when malformed."""
    if not isinstance(item, list) or len(item) != 3:
        return None
    tenant, session, tokens = item
    if not (isinstance(tenant, str) and 0 < len(tenant) <= MAX_TENANT_CHARS
            and isinstance(session, str) and len(session) == DIGEST_CHARS):
        return None
    if type(tokens) not in (int, float) or not (0 <= tokens <= MAX_ITEM_TOKENS) \
            or not math.isfinite(tokens):
        return None
    return tenant, session, float(tokens)


def session_receiver(fair: Fairness) -> Receive:
    """The broadcast's ``receive``: a valid item is added to the session's attained service."""

    def receive(item: Any) -> bool:
        told = parse_session(item)
        if told is None:
            return False
        fair.session_served(*told)
        return True

    return receive


def session_broadcast(params: FlowParams, fair: Fairness, plugin: str) -> Broadcast | None:
    """The sessions' broadcast (None without ``redis_url`` or with ``share_sessions`` off);
    not started."""
    if params.redis_url is None or not params.share_sessions:
        return None
    pub, sub = connect_pair(params.redis_url.get_secret_value(), params.redis_timeout_s)
    return Broadcast(pub, sub, session_receiver(fair), Channel(
        f"{params.redis_prefix}sessions:{plugin}", "shared_sessions",
        "shared session service (flow control)", "this replica's own session counters"),
        me=replica_id(), flush_s=FLUSH_S, timeout_s=params.redis_timeout_s, retry_s=RETRY_S,
        max_pending=MAX_PENDING)


class FlowShare:
    """What one flow-control plugin shares with the other replicas: the tenants' exchange and
    the sessions' broadcast (module docstring)."""

    def __init__(self, params: FlowParams, fair: Fairness, plugin: str,
                 demand: Demand | None = None) -> None:
        #: The limits' share (None: ``share_limits`` or ``learn`` off).
        self.demand = demand if params.share_limits and params.learn else None
        self.tenants = exchange(params, fair, self.demand)
        self.sessions = session_broadcast(params, fair, plugin)

    @classmethod
    def started(cls, params: FlowParams, fair: Fairness, plugin: str,
                demand: Demand | None = None) -> FlowShare | None:
        """A started share (None without ``redis_url``)."""
        if params.redis_url is None:
            return None
        share = cls(params, fair, plugin, demand)
        if share.tenants is not None:
            share.tenants.start()
        if share.sessions is not None:
            share.sessions.start()
        return share

    async def stop(self) -> None:
        if self.tenants is not None:
            await self.tenants.stop()
        if self.sessions is not None:
            await self.sessions.stop()

    def replicas(self) -> int:
        """Replicas sharing the fleet, this one included, as the tenants' exchange last saw
        them (1 while Redis is down: then each replica is on its own)."""
        if self.tenants is None or self.tenants.stats.down:
            return 1
        return 1 + self.tenants.stats.replicas

    def peers(self) -> Peers | None:
        """The other replicas' requests in flight per engine and demand, as last read (None:
        limits not shared, Redis down, or no other replica)."""
        ex = self.tenants
        if self.demand is None or ex is None or ex.stats.down:
            return None
        return peers_from({ep: ld.requests for ep, ld in ex.remote.items()},
                          self.demand.others, ex.stats.replicas)

    def served(self, tenant: str, session: str | None, tokens: float) -> None:
        """A usage's session tokens, told to the other replicas."""
        if self.sessions is not None and session is not None:
            self.sessions.send(session_item(tenant, session, tokens))

    def health(self) -> dict[str, object]:
        out: dict[str, object] = {}
        for part in (self.tenants, self.sessions):
            if part is not None:
                out.update(part.health())
        return out

    def families(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        """``kvgate_flow_shared_*`` (the tenants' exchange) and
        ``kvgate_flow_shared_sessions_*`` (the sessions' broadcast)."""
        if self.tenants is not None:
            st = self.tenants.stats
            yield GaugeMetricFamily("kvgate_flow_shared_down", "1 while Redis is unreachable "
                                    "(fairness from this replica's counters only)",
                                    value=int(st.down))
            yield GaugeMetricFamily("kvgate_flow_shared_replicas", "Other replicas whose "
                                    "served tokens were read in the last round",
                                    value=st.replicas)
            rounds = CounterMetricFamily("kvgate_flow_shared_rounds", "Fairness exchange "
                                         "rounds by result", labels=["result"])
            rounds.add_metric(["ok"], st.rounds)
            rounds.add_metric(["error"], st.errors)
            yield rounds
        if self.sessions is not None:
            yield from broadcast_families("kvgate_flow_shared_sessions", self.sessions.stats)


__all__ = ["Demand", "FlowShare", "exchange", "parse_session", "session_broadcast", "session_item",
           "session_receiver"]
