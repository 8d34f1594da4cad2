"""Which engine holds a piece of per-request state (an OpenAI Responses ``id``).

Filled from the usage taps' ``state_ids`` after a dispatch that succeeded; read for requests
that declare ``requires_state`` (``previous_response_id``) and for by-id routes
(``GET /v1/responses/{id}``). Each id is its tenant's: another tenant's id is a 404 before
anything reaches an engine (the engine's store serves any id to anyone), and with API keys on
so is an id this map does not know (its owner cannot be vouched for). Bounded: at most
``capacity`` ids (least recently used or written evicted first). Without API keys an evicted
id is routed like any request (the engine then decides; for a Responses conversation on
another engine that is a 404 from the engine) and a by-id request for it is a 404.

Per process, unless shared: with ``shared_state.redis_url`` (``--redis``) every id is also
written to Redis (middleware/serving/shared_states.py, with a TTL) and an id this process does not
hold is looked up there (:meth:`StateMap.fetch`, an async step before scheduling, which stays
free of I/O), so every replica and worker resolves it. Redis down: an id this process does
not hold is a 503 with API keys on (fail closed), routed as unknown without.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvgate.middleware.framework.errors import NotFound, ServiceUnavailable
from kvgate.middleware.serving.shared_states import SharedStates, StateStoreDown

if TYPE_CHECKING:
    from kvgate.middleware.framework.composition.config import GatewayConfig

#: Default bound: 100k ids x ~200 bytes = ~20 MB.
DEFAULT_CAPACITY = 100_000
#: With API keys on, an id Redis does not hold is asked for once more after this [s]: the
#: replica that handed it out writes it right after the answer's last byte.
MISS_RETRY_S = 0.05


@dataclass(frozen=True, slots=True)
class Holder:
    """The engine that answered with a state id, and the tenant it answered."""

    engine: str
    tenant: str | None


class StateMap:
    """Bounded LRU map state id -> :class:`Holder`, with counters for ``/metrics``."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY,
                 shared: SharedStates | None = None) -> None:
        self.capacity = capacity
        self.shared = shared
        self._ids: OrderedDict[str, Holder] = OrderedDict()
        self.evictions = 0
        #: Lookups by result: hit (pinned), miss (unknown id), unhealthy (holder out of
        #: rotation: routed normally), forbidden (another tenant's id), shared (found in
        #: Redis, now cached here), unavailable (not held here and Redis down).
        self.lookups = {"hit": 0, "miss": 0, "unhealthy": 0, "forbidden": 0, "shared": 0,
                        "unavailable": 0}

    def __len__(self) -> int:
        return len(self._ids)

    def remember(self, state_id: str, engine: str, tenant: str | None) -> None:
        self._ids[state_id] = Holder(engine, tenant)
        self._ids.move_to_end(state_id)
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)
            self.evictions += 1

    async def record(self, state_ids: Sequence[str], engine: str, tenant: str | None) -> None:
        """Remember the ids an answer created, here and (shared) in Redis; never raises."""
        for state_id in state_ids:
            self.remember(state_id, engine, tenant)
            if self.shared is not None:
                await self.shared.put(state_id, engine, tenant)

    async def fetch(self, state_id: str, tenant: str | None) -> None:
        """Bring ``state_id``'s holder here from Redis if this process does not hold it. Redis
        down: ServiceUnavailable (503) for a tenant's request, nothing without API keys."""
        shared = self.shared
        if shared is None or state_id in self._ids:
            return
        try:
            found = await shared.get(state_id)
            if found is None and tenant is not None:
                await asyncio.sleep(MISS_RETRY_S)
                found = await shared.get(state_id)
        except StateStoreDown:
            self.lookups["unavailable"] += 1
            if tenant is None:
                return
            raise ServiceUnavailable(
                f"response {state_id!r} cannot be resolved now (the shared state store is "
                "down); retry", code="state_store_unavailable",
                headers={"retry-after": "1"}) from None
        if found is not None:
            self.lookups["shared"] += 1
            self.remember(state_id, *found)

    def health(self) -> dict[str, object] | None:
        """The shared store's state for /health (None when not shared)."""
        if self.shared is None:
            return None
        return {"ids_here": len(self._ids), **self.shared.health()}

    async def close(self) -> None:
        if self.shared is not None:
            await self.shared.close()

    def known(self, state_id: str) -> bool:
        """Whether some tenant holds ``state_id`` (no refresh, no count)."""
        return state_id in self._ids

    def holder(self, state_id: str, tenant: str | None) -> Holder | None:
        """The id's holder (refreshing it), or None if unknown or another tenant's."""
        found = self._ids.get(state_id)
        if found is None:
            return None
        if found.tenant != tenant:
            self.lookups["forbidden"] += 1
            return None
        self._ids.move_to_end(state_id)
        return found

    def owned(self, state_id: str, tenant: str | None, param: str) -> Holder | None:
        """``state_id``'s holder for a request of ``tenant``. NotFound (404, naming
        ``param``) for another tenant's id and, with API keys on (``tenant`` set), for an id
        of no known owner (a restart, an evicted id): the engine's store would serve it to
        anyone (docs/security.md, "Ids a client sends"). None: unknown, keys off."""
        holder = self.holder(state_id, tenant)
        if holder is not None:
            return holder
        known = self.known(state_id)
        if not known:
            self.count("miss")
        if tenant is not None or known:
            raise NotFound(f"{param}: no response with id {state_id!r}", param=param)
        return None

    def count(self, result: str) -> None:
        self.lookups[result] += 1


class StateMapCollector(Collector):
    def __init__(self, states: StateMap) -> None:
        self._states = states

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        size = GaugeMetricFamily("kvgate_state_ids", "State ids (Responses ids) mapped to the "
                                 "engine that holds them")
        size.add_metric([], len(self._states))
        evicted = CounterMetricFamily("kvgate_state_ids_evicted", "State ids evicted (LRU) "
                                      "from the bounded map")
        evicted.add_metric([], self._states.evictions)
        lookups = CounterMetricFamily("kvgate_state_lookups", "Lookups of state ids by result "
                                      "(hit, miss, unhealthy, forbidden)", labels=["result"])
        for result, n in sorted(self._states.lookups.items()):
            lookups.add_metric([result], n)
        yield size
        yield evicted
        yield lookups
        shared = self._states.shared
        if shared is not None:
            yield from _shared_metrics(shared)


def _shared_metrics(shared: SharedStates) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    s = shared.stats
    yield GaugeMetricFamily("kvgate_state_ids_shared_up", "1 while the Redis holding every "
                            "replica's state ids answers; 0: ids not held here are refused",
                            value=int(shared.up))
    errors = CounterMetricFamily("kvgate_state_ids_shared_errors", "Failed Redis calls of "
                                 "the shared state-id map by operation", labels=["op"])
    errors.add_metric(["read"], s.read_errors)
    errors.add_metric(["write"], s.write_errors)
    yield errors
    yield CounterMetricFamily("kvgate_state_ids_shared_dropped", "Ids whose Redis write was "
                              "dropped (the queue was full during an outage)", value=s.dropped)


def state_map(config: GatewayConfig, capacity: int = DEFAULT_CAPACITY) -> StateMap:
    """The gateway's map: shared through Redis when ``shared_state`` is configured."""
    shared_cfg = config.shared_state
    if shared_cfg is None:
        return StateMap(capacity)
    return StateMap(capacity, SharedStates(shared_cfg.redis_url, shared_cfg.state_ids_ttl_s))


__all__ = ["DEFAULT_CAPACITY", "Holder", "StateMap", "StateMapCollector", "state_map"]
