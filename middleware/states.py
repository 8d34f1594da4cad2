"""Which engine holds a piece of per-request state (an OpenAI Responses ``id``).

Filled from the usage taps' ``state_ids`` after a dispatch that succeeded; read for requests
that declare ``requires_state`` (``previous_response_id``) and for by-id routes
(``GET /v1/responses/{id}``). Each id is its tenant's: another tenant's id is a 404 before
anything reaches an engine (the engine's store serves any id to anyone), and with API keys on
so is an id this map does not know (its owner cannot be vouched for). Bounded: at most
``capacity`` ids (least recently used or written evicted first). Without API keys an evicted
id is routed like any request (the engine then decides; for a Responses conversation on
another engine that is a 404 from the engine) and a by-id request for it is a 404. Per
process: a gateway restart forgets every id.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

#: Default bound: 100k ids x ~200 bytes = ~20 MB.
DEFAULT_CAPACITY = 100_000


@dataclass(frozen=True, slots=True)
class Holder:
    """The engine that answered with a state id, and the tenant it answered."""

    engine: str
    tenant: str | None


class StateMap:
    """Bounded LRU map state id -> :class:`Holder`, with counters for ``/metrics``."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[str, Holder] = OrderedDict()
        self.evictions = 0
        #: Lookups by result: hit (pinned), miss (unknown id), unhealthy (holder out of
        #: rotation: routed normally), forbidden (another tenant's id).
        self.lookups = {"hit": 0, "miss": 0, "unhealthy": 0, "forbidden": 0}

    def __len__(self) -> int:
        return len(self._ids)

    def remember(self, state_id: str, engine: str, tenant: str | None) -> None:
        self._ids[state_id] = Holder(engine, tenant)
        self._ids.move_to_end(state_id)
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)
            self.evictions += 1

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


__all__ = ["DEFAULT_CAPACITY", "Holder", "StateMap", "StateMapCollector"]
