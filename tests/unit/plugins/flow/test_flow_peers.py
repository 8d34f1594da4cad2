"""Each replica's share of an engine's limit, following its demand (plugins/flow/peers.py,
plugins/flow/saturation.py with peers), table-driven."""

from __future__ import annotations

import pytest

from kvgate.middleware.framework.types import Endpoint, EngineMetrics, Role
from kvgate.plugins.flow.params import FlowParams
from kvgate.plugins.flow.peers import Peers, peers_from
from kvgate.plugins.flow.saturation import Saturation


def _ep(name: str = "e0", in_flight: int = 0, role: Role = Role.BOTH,
        **metrics: object) -> Endpoint:
    return Endpoint(id=name, url=f"http://{name}", kind="vllm", role=role, healthy=True,
                    in_flight_requests=in_flight, in_flight_tokens=0,
                    metrics=EngineMetrics(**metrics))  # type: ignore[arg-type]


SHARES = [
    # name, limit, others' in flight, others' demand, replicas, own demand, share
    ("even demand, two replicas", 16, 8, 20.0, 1, 20.0, 8),
    ("all the demand here", 16, 0, 0.0, 1, 40.0, 16),
    ("three times the other's queue", 16, 4, 10.0, 1, 30.0, 12),
    ("others hold more than their share: wait for their seats", 16, 10, 10.0, 1, 30.0, 6),
    ("no demand here: one slot for the next request", 16, 15, 30.0, 1, 0.0, 1),
    ("no demand anywhere: even split of three", 15, 0, 0.0, 2, 0.0, 5),
    ("others hold every seat: the floor", 16, 16, 40.0, 1, 10.0, 1),
]


@pytest.mark.parametrize(("name", "limit", "others", "their_demand", "replicas", "demand",
                          "share"), SHARES, ids=[c[0] for c in SHARES])
def test_share(name: str, limit: int, others: int, their_demand: float, replicas: int,
               demand: float, share: int) -> None:
    peers = Peers({"e0": others}, their_demand, replicas)
    assert peers.share(limit, "e0", demand, floor=1)[0] == share


HYSTERESIS_CASES = [
    # name, others' demand, own demand, previous share, share kept
    ("a seat more asked: kept", 100.0, 100.0 * 9 / 7, 8, 8),
    ("a seat less asked: kept", 100.0, 100.0 * 7 / 9, 8, 8),
    ("two seats more asked: moved", 100.0, 100.0 * 10 / 6, 8, 10),
    ("no previous share", 100.0, 100.0 * 9 / 7, None, 9),
]


@pytest.mark.parametrize(("name", "their_demand", "demand", "previous", "kept"),
                         HYSTERESIS_CASES, ids=[c[0] for c in HYSTERESIS_CASES])
def test_a_share_moves_only_past_one_seat(name: str, their_demand: float, demand: float,
                                          previous: int | None, kept: int) -> None:
    """Two replicas each with a flood queued swing around half an engine with every request:
    a share within one seat of the last one stays (HYSTERESIS)."""
    assert Peers({}, their_demand, 1).share(16, "e0", demand, 1, previous)[1] == kept


RESERVES = [
    # name, share of a 16-seat engine here, reserve kept of it
    ("half the engine", 8, 1),
    ("a little under half: still one", 7, 1),
    ("a little over half", 9, 2),
    ("one seat", 1, 1),
    ("all of it", 16, 2),
]


@pytest.mark.parametrize(("name", "share", "reserve"), RESERVES, ids=[c[0] for c in RESERVES])
def test_a_replicas_reserve_is_its_part_of_the_fleets(name: str, share: int,
                                                      reserve: int) -> None:
    """Sharing a limit of 16 (a reserve of 2 for the fleet), a replica's reserve is its part
    of the fleet's, rounded up: a share of 7 keeps one slot for light tenants' turns, where a
    reserve taken of the share itself (none below 8) kept none."""
    sat = Saturation(FlowParams())
    assert sat.reserve(share) == int(share * 0.125)  # alone: of its own limit
    sat.peers = Peers({}, 10.0, 1)
    assert sat.reserve(share, learned=16) == reserve


def test_shares_sum_to_the_limit() -> None:
    """Two replicas' shares of a limit of 16, each computed from the other's demand, sum to
    16 whatever the split of demand (the engine neither queues nor idles)."""
    for mine in range(0, 60, 3):
        for theirs in range(0, 60, 7):
            a = Peers({}, theirs, 1).share(16, "e0", mine, floor=1)[0]
            b = Peers({}, mine, 1).share(16, "e0", theirs, floor=1)[0]
            assert 15 <= a + b <= 17, (mine, theirs, a, b)


def test_peers_from_the_exchange() -> None:
    assert peers_from({"e0": 3.0}, 7.0, 0) is None
    peers = peers_from({"e0": 3.0}, 7.0, 2)
    assert peers == Peers({"e0": 3}, 7.0, 2)
    assert peers_from({}, 0.0, 1) == Peers({}, 0.0, 1)


def test_the_fleet_learns_the_engines_batch_and_splits_it_by_demand() -> None:
    """Two replicas in front of a 16-sequence engine, sharing: each learns the engine's limit
    for the fleet (16, counting the other's requests in flight), and keeps the share its
    queue asks for; alone again, the same learner takes the whole limit."""
    backlog = [0]
    sat = Saturation(FlowParams(), lambda: backlog[0])
    sat.peers = Peers({"e0": 16}, 16.0, 1)  # the other replica holds 16
    # slow start: 32 for the fleet, half here; the engine queues what exceeds its 16 seats
    view = sat.view([_ep(in_flight=16, running=16, waiting=16, scraped_at=1.0)], 1.0)
    assert view.engines[0].learned == 16  # the fleet's share of what the engine runs: all
    backlog[0] = 24  # 24 wait here, the other replica has none waiting (its 8 in flight)
    sat.peers = Peers({"e0": 8}, 8.0, 1)
    view = sat.view([_ep(in_flight=8, running=16, waiting=0, scraped_at=2.0)], 2.0)
    assert view.engines[0].learned == 16
    assert view.engines[0].limit == 8  # 16 x 33/42 = 13, but the other still holds 8
    sat.peers = Peers({"e0": 3}, 3.0, 1)  # its requests end; it does not replace them
    view = sat.view([_ep(in_flight=13, running=16, waiting=0, scraped_at=3.0)], 3.0)
    assert view.engines[0].limit == 13  # 16 x (24 + 13 + 1) / (37 + 3 + 2)
    sat.peers = None  # Redis down: this replica's own limit
    view = sat.view([_ep(in_flight=13, running=13, waiting=0, scraped_at=4.0)], 4.0)
    assert view.engines[0].limit == 16


def test_without_peers_the_learner_is_this_replicas_own() -> None:
    """No peers (no Redis, no other replica, share_limits off): a queue cuts the limit to this
    replica's share of the batch, as before limits were shared."""
    sat = Saturation(FlowParams())
    view = sat.view([_ep(in_flight=16, running=16, waiting=16, scraped_at=1.0)], 1.0)
    view = sat.view([_ep(in_flight=16, running=16, waiting=16, scraped_at=2.0)], 2.0)
    assert view.engines[0].limit == view.engines[0].learned == 8


def test_demand_counts_the_serving_pool_once() -> None:
    """A P/D request is in flight on a prefill and a decode engine: demand counts it once."""
    sat = Saturation(FlowParams(), lambda: 5)
    eps = [_ep("p0", in_flight=3, role=Role.PREFILL), _ep("d0", in_flight=3, role=Role.DECODE)]
    assert sat.demand(eps) == 0  # no peers: nothing to weigh
    assert sat.demand(eps, own=True) == 8
    sat.peers = Peers({}, 0.0, 1)
    assert sat.demand(eps) == 8


def test_shares_below_the_limit_still_raise_it() -> None:
    """Seen in a flood through two replicas: a cut made before the other replica's requests
    were known left the fleet's limit at 7 on a 16-sequence engine, each replica at 3 of it
    (hysteresis kept 3 where 7 x 1/2 rounds to 4): the fleet never filled the limit, so it never
    rose. A replica at its own share with requests waiting, on an engine running below its
    observed batch, raises the limit to that batch."""
    sat = Saturation(FlowParams(), lambda: 70)
    # the burst's queue, scraped before the other replica's requests were heard of: cut to 7
    view = sat.view([_ep(in_flight=28, running=16, waiting=48, scraped_at=1.0)], 1.0)
    assert view.engines[0].learned == 7
    sat.peers = Peers({"e0": 3}, 80.0, 1)
    view = sat.view([_ep(in_flight=3, running=6, waiting=48, scraped_at=1.0)], 1.0)
    assert view.engines[0].limit == 3  # 7 x 74 / 155
    view = sat.view([_ep(in_flight=3, running=6, waiting=0, scraped_at=2.0)], 2.0)
    assert view.engines[0].learned == 16  # the engine's observed batch
    assert view.engines[0].limit == 8


def test_the_filter_weighs_shares_by_the_whole_fleets_demand() -> None:
    """The filter looks at a profile's subset of engines (a P/D role, the healthy ones): the
    shares there are weighed by the demand seen over the whole fleet, as the gate's are.
    Weighed by the subset's own demand, engine a's share fell to its requests in flight and
    the filter dropped an engine the gate had counted a free slot on."""
    sat = Saturation(FlowParams(), lambda: 0)
    sat.peers = Peers({}, 8.0, 1)
    eps = [_ep("a", in_flight=23), _ep("b", in_flight=15)]
    limits = {e.id: e.limit for e in sat.view(eps, 1.0).engines}
    assert limits == {"a": 26, "b": 26}  # 32 x 39 / 48: 38 requests in flight here
    assert sat.unsaturated(eps[:1], 1.0) == eps[:1]  # a's subset alone: 32 x 24 / 33 = 23
    assert {e.id: e.limit for e in sat.view(eps, 1.0).engines} == limits
