"""What placement produces: its decision per request (``PLACEMENT`` in the cycle state, read by
its own dispatch hook) and its counters (``kvgate_placement_*``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvgate.middleware.framework.immutable import immutable
from kvgate.middleware.framework.types import EndpointId, StateKey
from kvgate.plugins.common.broadcast import BroadcastStats


@dataclass(slots=True)
class PlacementStats:
    """Decisions by kind (``home``: the engine holding the most beyond the others; ``moved``: a
    prefix held elsewhere was given up for pressure or queue; ``cold``: nothing beyond the
    common prefix anywhere), session pins used and evicted, insertions charged [tokens]."""

    decisions: dict[str, int] = field(
        default_factory=lambda: {"home": 0, "moved": 0, "cold": 0}
    )
    pins_used: int = 0
    pins_evicted: int = 0
    hints_used: int = 0
    inserted_tokens: int = 0
    remote_inserted_tokens: int = 0


@immutable
class Placement:
    """One scoring: cost per engine [tokens], the engine holding most beyond the others."""

    costs: Mapping[EndpointId, float]
    home: EndpointId | None


#: The last placement of a request (for the dispatch hook's statistics).
PLACEMENT: StateKey[Placement] = StateKey("kv-placement")


@dataclass(frozen=True, slots=True)
class PlacementView:
    """What ``/metrics`` shows of the scorer, taken at one scrape."""

    stats: PlacementStats
    #: Session pins held; sessions whose own insertions are tracked; restored pins unused.
    sessions: int
    own_sessions: int
    hints: int
    #: Prompts remembered to recognise later turns without headers, found, evicted.
    conversations: int
    conversation_turns_found: int
    conversations_evicted: int
    #: Per engine: recent insertions per token of capacity, and the capacity [tokens].
    pressures: Mapping[EndpointId, float]
    capacities: Mapping[EndpointId, int]
    #: The session memory told to / by the other replicas (None: not shared).
    shared: BroadcastStats | None = None
