"""Each replica's share of an engine's limit, following where the requests wait
(``flow-control`` with ``redis_url`` and ``share_limits``; pure, no I/O).

Without it every replica learns its own share of an engine's batch from the engine's queue:
two replicas in front of a 16-sequence engine converged on ~13-14 together (each cut to its
share of what the engine ran when it first queued) and kept them whatever their queues were:
one replica with 30 requests waiting and the other with none held half the seats each (seen
in ``bench.flow_control --scenario sessions --replicas 2``; docs/flow-control.md).

With it the replicas tell each other, through the tenants' exchange (every
``share_interval_s``), their requests in flight per engine and their **demand** (requests
queued, admitted and not dispatched yet, and in flight). Each replica then learns the
engine's limit **for the fleet** (its learner counts every replica's requests in flight
there: the cut is the fleet's share of what the engine runs, i.e. its batch), and keeps in
flight there

    share = round(limit x (demand + 1) / (all replicas' demand + replicas))

(+1 per replica: a replica without demand still gets a slot for its next request; kept while
the demand asks for a change of one seat or less: :data:`HYSTERESIS`), never more
than the seats the others do not hold (``limit - their in flight``: a replica whose share
fell lets its requests end before the other fills their seats, so the engine does not queue
meanwhile), never below ``min_in_flight_per_engine``. Shares sum to the limit (up to
rounding and the hysteresis); at a fixed point with both replicas saturated each holds the
limit in proportion to its queue, so a request waits about as long behind either (Little's
law) -- as it would in one gateway's one queue. The others' figures are at most
``share_interval_s`` plus a round trip old. The learner (plugins/flow/saturation.py) also
raises the limit when this replica's own share is full with requests waiting and the engine
runs below its batch, and takes this replica's reserve as its part of the fleet's.

Redis down, or no other replica: no peers, each replica on its own limit (the learner's cut
brings N replicas back to their shares of the batch within a scrape or two).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

#: The gauge each replica publishes its demand under (plugins/load/shared_load.py GaugeShare).
DEMAND = "demand"
#: [requests] A weighted share moves only when the demand asks for more than this change: two
#: replicas with a flood queued in each swing around half of a 16-seat engine with every
#: request, and a share flipping between 7 and 9 left a light tenant's turn behind a slot
#: that was the replica's a moment ago (its requests must end first).
HYSTERESIS = 1


@dataclass(frozen=True, slots=True)
class Peers:
    """The other replicas as the exchange last read them."""

    #: Per engine: their requests in flight there.
    in_flight: Mapping[str, int]
    #: Their demand, summed (requests queued, pending and in flight).
    demand: float
    #: How many they are.
    replicas: int

    def others(self, engine: str) -> int:
        return self.in_flight.get(engine, 0)

    def share(self, limit: int, engine: str, demand: float, floor: int,
              previous: int | None = None) -> tuple[int, int]:
        """This replica's part of ``engine``'s fleet ``limit`` with ``demand`` of its own:
        ``(limit here, the weighted share)``. The weighted share keeps ``previous`` while it is
        within one of it (:data:`HYSTERESIS`)."""
        weight = (demand + 1.0) / (demand + self.demand + self.replicas + 1)
        mine = math.floor(limit * weight + 0.5)
        if previous is not None and abs(mine - previous) <= HYSTERESIS and previous <= limit:
            mine = previous
        return max(floor, min(mine, limit - self.others(engine))), mine


def peers_from(in_flight: Mapping[str, float], demand: float,
               replicas: int) -> Peers | None:
    """Peers from the exchange's last round (None: no other replica was read)."""
    if replicas <= 0:
        return None
    return Peers({ep: int(n) for ep, n in in_flight.items()}, demand, replicas)


__all__ = ["DEMAND", "HYSTERESIS", "Peers", "peers_from"]
