"""Saturation per engine and pool (plugins/flow/saturation.py), table-driven."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvgate.middleware.framework.types import (
    KV_CAPACITY_TOKENS,
    CycleState,
    Endpoint,
    EngineMetrics,
    InferenceRequest,
    Role,
    RoutingDecision,
)
from kvgate.plugins.flow.params import FlowParams
from kvgate.plugins.flow.plugin import Ticket
from kvgate.plugins.flow.saturation import Saturation


def _ep(name: str = "e0", in_flight: int = 0, tokens: int = 0, healthy: bool = True,
        role: Role = Role.BOTH, **metrics: object) -> Endpoint:
    return Endpoint(id=name, url=f"http://{name}", kind="vllm", role=role, healthy=healthy,
                    in_flight_requests=in_flight, in_flight_tokens=tokens,
                    metrics=EngineMetrics(**metrics))  # type: ignore[arg-type]


CASES = [
    # name, endpoint, params, saturated reason, free
    ("idle", _ep(), {}, None, 32),
    ("idle, learning off", _ep(), {"learn": False}, None, 256),
    ("at the limit", _ep(in_flight=8), {"max_in_flight_per_engine": 8, "learn": False},
     "in_flight", 0),
    ("unhealthy", _ep(healthy=False), {}, "unhealthy", 0),
    ("kv full (fresh)", _ep(kv_usage=0.96, scraped_at=99.0), {}, "kv_usage", 0),
    ("kv full but stale", _ep(kv_usage=0.99, scraped_at=0.0), {}, None, 32),
    ("token cap", _ep(in_flight=3, tokens=5000), {"max_in_flight_tokens_per_engine": 4096},
     "tokens", 0),
    ("token cap from KV capacity", _ep(in_flight=2, tokens=9600, scraped_at=99.0,
                                       extra={KV_CAPACITY_TOKENS: 10_000.0}), {}, "tokens", 0),
    ("engine queue, learning off", _ep(running=4, waiting=3, scraped_at=99.0),
     {"learn": False}, "engine_waiting", 0),
]


@pytest.mark.parametrize(("name", "ep", "params", "reason", "free"), CASES, ids=[c[0] for c in CASES])
def test_engine_verdicts(name: str, ep: Endpoint, params: dict[str, object],
                         reason: str | None, free: int) -> None:
    view = Saturation(FlowParams.model_validate(params)).view([ep], 100.0)
    assert view.engines[0].saturated == reason
    assert view.free() == free


def test_limit_is_learned_from_the_engine_queue_and_probed_up() -> None:
    """Slow start 32 -> 64 while the engine shows no queue; 64 in flight on an engine running
    16 with 48 waiting: the limit drops to 16; then, full without a queue, +1 once per probe
    interval."""
    sat = Saturation(FlowParams(probe_interval_s=30))
    view = sat.view([_ep(in_flight=32, running=32, waiting=0, scraped_at=0.5)], 0.5)
    assert view.engines[0].limit == 64
    view = sat.view([_ep(in_flight=64, running=16, waiting=48, scraped_at=1.0)], 1.0)
    assert view.engines[0].limit == 16 and view.engines[0].saturated == "in_flight"
    view = sat.view([_ep(in_flight=16, running=16, waiting=0, scraped_at=2.0)], 2.0)
    assert view.engines[0].limit == 16  # within the probe interval
    view = sat.view([_ep(in_flight=16, running=16, waiting=0, scraped_at=40.0)], 40.0)
    assert view.engines[0].limit == 17 and view.free() == 1
    view = sat.view([_ep(in_flight=17, running=17, waiting=0, scraped_at=40.0)], 80.0)
    assert view.engines[0].limit == 17  # the same scrape teaches nothing twice
    assert (sat.cuts, sat.probes) == (1, 2)


def test_a_lagging_gateway_does_not_raise_the_limit() -> None:
    """16 in flight here at the limit, the engine running 10 without a queue: 6 of ours have
    finished there and are still being relayed (a busy gateway), not free seats: no raise, on
    any number of such scrapes. After a cut to 14, a real free seat (all 14 of ours at the
    engine, running 14 below the observed batch of 16) raises it by one."""
    sat = Saturation(FlowParams())
    sat.view([_ep(in_flight=32, running=16, waiting=16, scraped_at=1.0)], 1.0)
    for t in range(2, 40):
        view = sat.view([_ep(in_flight=16, running=10, waiting=0, scraped_at=float(t))],
                        float(t))
        assert view.engines[0].limit == 16
    sat.view([_ep(in_flight=16, running=16, waiting=2, scraped_at=50.0)], 50.0)
    view = sat.view([_ep(in_flight=14, running=14, waiting=0, scraped_at=51.0)], 51.0)
    assert view.engines[0].limit == 15


def test_a_burst_waiting_for_prefill_is_not_a_full_engine() -> None:
    """After the engine queued at 16 running (its batch), a scrape showing 7 running and 7
    waiting (a burst waiting for a step's prefill budget) cuts nothing; a queue below the batch
    that lasts QUEUE_SCRAPES scrapes does (the batch shrank), and the limit follows it."""
    from kvgate.plugins.flow.saturation import QUEUE_SCRAPES

    sat = Saturation(FlowParams())
    sat.view([_ep(in_flight=32, running=16, waiting=16, scraped_at=1.0)], 1.0)
    view = sat.view([_ep(in_flight=16, running=7, waiting=7, scraped_at=2.0)], 2.0)
    assert view.engines[0].limit == 16
    view = sat.view([_ep(in_flight=16, running=16, waiting=0, scraped_at=3.0)], 3.0)
    for t in range(QUEUE_SCRAPES):
        view = sat.view([_ep(in_flight=16, running=8, waiting=8, scraped_at=4.0 + t)], 4.0 + t)
    assert view.engines[0].limit == 8


def test_replicas_learn_their_share() -> None:
    """Two replicas with 16 each on a 16-sequence engine: each cuts to 16 (the limit less the
    queue), then to 8 (its share); when the other replica leaves, the engine shows free seats
    below its observed batch size and the limit climbs back, one per scrape."""
    sat = Saturation(FlowParams())
    view = sat.view([_ep(in_flight=16, running=16, waiting=16, scraped_at=1.0)], 1.0)
    assert view.engines[0].limit == 16
    view = sat.view([_ep(in_flight=16, running=16, waiting=16, scraped_at=2.0)], 2.0)
    assert view.engines[0].limit == 8
    for t in range(3, 11):
        view = sat.view([_ep(in_flight=view.engines[0].limit, running=view.engines[0].limit,
                             waiting=0, scraped_at=float(t))], float(t))
    assert view.engines[0].limit == 16
    view = sat.view([_ep(in_flight=16, running=16, waiting=0, scraped_at=12.0)], 12.0)
    assert view.engines[0].limit == 16  # at the observed batch size: no probe before 300 s


def test_pools_saturate_separately() -> None:
    eps = [_ep("p0", in_flight=4, role=Role.PREFILL), _ep("d0", in_flight=1, role=Role.DECODE)]
    view = Saturation(FlowParams(max_in_flight_per_engine=4, learn=False)).view(eps, 0.0)
    assert view.pool_saturated() == {"serving": False, "prefill": True}
    assert view.free() == 0 and view.capacity == 4


def test_engines_gone_are_forgotten() -> None:
    sat = Saturation(FlowParams())
    sat.view([_ep("a"), _ep("b")], 0.0)
    sat.view([_ep("b")], 1.0)
    assert list(sat.limits()) == ["b"]


def test_stale_metrics_are_reported(caplog: pytest.LogCaptureFixture) -> None:
    view = Saturation(FlowParams(metrics_stale_s=10)).view(
        [_ep(kv_usage=0.5, scraped_at=0.0)], 60.0)
    assert view.stale == ("e0",)
    assert "metrics are 60 s old" in caplog.text


def test_the_filter_keeps_each_role_available() -> None:
    """A full prefill engine next to a free decode engine: the prefill role keeps its engine
    (a later role filter must still find one); the full 'both' engine is dropped for the free
    one."""
    from kvgate.plugins.flow.plugin import FlowControl

    class _NoLookup:
        def lookup(self, name: str) -> object:
            raise KeyError(name)

    params = FlowParams(max_in_flight_per_engine=2, learn=False)
    flow = FlowControl("flow-control", params, _NoLookup())
    eps = [_ep("p0", in_flight=2, role=Role.PREFILL), _ep("d0", role=Role.DECODE),
           _ep("b0", in_flight=2), _ep("b1")]
    kept = flow.filter(_req("t"), CycleState(), eps)
    assert [ep.id for ep in kept] == ["p0", "d0", "b1"]
    assert flow.unfiltered == 1


def _req(tenant: str) -> InferenceRequest:
    return InferenceRequest(request_id="r", api="chat", model="m", body={}, headers={},
                            stream=False, client_wants_usage=False, prompt_token_estimate=10,
                            received_at=0.0, tenant=tenant)


def test_a_tenant_over_its_share_leaves_each_engine_reserve() -> None:
    """Two 16-slot engines, reserve 2 each: e0 has 14 in flight (2 free, both reserved), e1
    10. A holds 24 of 32 slots (share 16): its request may only go to e1, past e1's reserve;
    B (under its share) may use e0's reserve, e.g. where its session lives; and A's next
    request is admitted at once while a slot is open past the reserves, queued when none is."""
    from kvgate.plugins.flow.plugin import FlowControl

    class _NoLookup:
        def lookup(self, name: str) -> object:
            raise KeyError(name)

    flow = FlowControl("flow-control", FlowParams(max_in_flight_per_engine=16, learn=False),
                       _NoLookup())
    for _ in range(24):
        flow.queue.admit_now("A", 10, 0.0)
    flow.queue.admit_now("B", 10, 0.0)
    eps = [_ep("e0", in_flight=14), _ep("e1", in_flight=10)]
    assert flow.saturation.headroom(eps, 1.0) == (8, 4, 32)
    flow._seen_capacity = 32
    assert [ep.id for ep in flow.filter(_req("A"), CycleState(), eps)] == ["e1"]
    assert [ep.id for ep in flow.filter(_req("B"), CycleState(), eps)] == ["e0", "e1"]
    full = [_ep("e0", in_flight=14), _ep("e1", in_flight=14)]
    assert not flow._fits(full, _ticket("A"), time.monotonic())
    assert flow._fits(full, _ticket("B", "interactive"), time.monotonic())
    assert not flow._fits(full, _ticket("B", "batch"), time.monotonic())  # never the reserve
    assert flow._fits(eps, _ticket("A"), time.monotonic())
    assert flow.pending_paced == 1  # paced by default: A is over its share


@pytest.mark.parametrize(("name", "ep", "over_share_open"), [
    # the token bound of a 10,000-token KV cache: 9,500 (max_kv_usage 0.95); a tenant over its
    # share stops at 7/8 of it (8,312), and at KV usage 0.83
    ("tokens under both bounds", _ep(in_flight=2, tokens=8_000, scraped_at=99.0,
                                     extra={KV_CAPACITY_TOKENS: 10_000.0}), True),
    ("tokens in the reserve", _ep(in_flight=2, tokens=9_000, scraped_at=99.0,
                                  extra={KV_CAPACITY_TOKENS: 10_000.0}), False),
    ("kv usage in the reserve", _ep(in_flight=2, kv_usage=0.9, scraped_at=99.0), False),
    ("kv usage in the reserve, stale", _ep(in_flight=2, kv_usage=0.9, scraped_at=0.0), True),
])
def test_a_tenant_over_its_share_leaves_the_token_and_kv_reserve(
        name: str, ep: Endpoint, over_share_open: bool) -> None:
    """An engine full by tokens long before by requests (long prompts): a flood over its share
    stops at 1 - reserve_fraction of the token bound and of max_kv_usage, so a light tenant's
    turn goes in at once instead of waiting for one of the flood's requests to end (seen on
    real vLLM CPU engines: B's TTFT p99 up to 11 s behind A's 256-token answers)."""
    sat = Saturation(FlowParams(max_in_flight_per_engine=16, learn=False))
    free, opened, _ = sat.headroom([ep], 100.0)
    assert free == 14  # under its share: the whole engine
    assert (opened > 0) == over_share_open
    assert bool(sat.unsaturated([ep], 100.0, past_reserve=True)) == over_share_open
    assert sat.unsaturated([ep], 100.0) == [ep]


def _ticket(tenant: str, band: str = "standard") -> Ticket:
    return Ticket(band, tenant, None, 10, 0.0, admitted=True)


def test_a_tenant_over_its_share_enters_each_engine_once_per_pace_interval() -> None:
    """Pacing (over_share_pace_s): two 16-slot engines with slots open past their reserves; A
    holds more than its share. Two of A's requests may be admitted at once (one per engine
    not paced), a third waits; each paces the engine it is sent to, and the filter sends the
    next one to an engine not paced; B (under its share) is never paced; the interval ends."""
    from kvgate.plugins.flow.plugin import FlowControl

    class _NoLookup:
        def lookup(self, name: str) -> object:
            raise KeyError(name)

    params = FlowParams(max_in_flight_per_engine=16, learn=False, over_share_pace_s=5.0)
    flow = FlowControl("flow-control", params, _NoLookup())
    for _ in range(20):
        flow.queue.admit_now("A", 10, 0.0)
    flow.queue.admit_now("B", 10, 0.0)
    eps = [_ep("e0", in_flight=10), _ep("e1", in_flight=11)]
    flow._last_eps = eps
    now = time.monotonic()
    flow.saturation.headroom(eps, now)  # the engines are known
    first, second, third = _ticket("A"), _ticket("A"), _ticket("A")
    assert flow._fits(eps, first, now) and flow._fits(eps, second, now)
    assert not flow._fits(eps, third, now) and flow.pending_paced == 2
    assert flow._fits(eps, _ticket("B"), now)
    state = CycleState()
    state.put(flow._ticket, first)
    asyncio.run(flow.before_dispatch(_req("A"), state, RoutingDecision(target=eps[0])))
    assert flow.pending_paced == 1 and flow.saturation.paced(eps[0], time.monotonic())
    state = CycleState()
    state.put(flow._ticket, second)
    assert [ep.id for ep in flow.filter(_req("A"), state, eps)] == ["e1"]
    assert not flow._fits(eps, _ticket("A"), time.monotonic())  # e1 is promised to `second`
    assert not flow.saturation.paced(eps[0], time.monotonic() + 6)


def test_an_engine_without_queue_metrics_is_not_held_at_the_slow_start(
        caplog: pytest.LogCaptureFixture) -> None:
    """A scrape without running/waiting (a server of unknown kind) teaches nothing: the engine
    gets max_in_flight_per_engine at once, with a WARNING, /health and /metrics naming it, not
    the slow start's 32 it could never leave; when it reports its queue, learning resumes."""
    sat = Saturation(FlowParams())
    view = sat.view([_ep(in_flight=40, scraped_at=1.0)], 1.0)
    assert view.engines[0].limit == 256 and view.engines[0].saturated is None
    assert view.blind == ("e0",) and "reports no running/waiting metrics" in caplog.text
    view = sat.view([_ep(in_flight=40, running=16, waiting=24, scraped_at=2.0)], 2.0)
    assert view.blind == () and view.engines[0].limit == 16
    before_scrape = Saturation(FlowParams()).view([_ep(in_flight=40)], 0.0)
    assert before_scrape.engines[0].limit == 32 and before_scrape.blind == ()


# (case, replicas the fairness exchange saw besides this one (None: no exchange), Redis down,
#  seconds since this replica sent an over-share request to the engine, paced?)
PACERS = [
    ("one gateway: the interval is over_share_pace_s", None, False, 1.5, False),
    ("two replicas: each paces at twice the interval", 1, False, 1.5, True),
    ("... and no longer than that", 1, False, 2.5, False),
    ("four replicas", 3, False, 3.5, True),
    ("Redis down: each replica is on its own again", 3, True, 1.5, False),
]


@pytest.mark.parametrize(("case", "others", "down", "since", "paced"), PACERS,
                         ids=[c[0] for c in PACERS])
def test_replicas_pace_together_at_one_gateways_interval(
        case: str, others: int | None, down: bool, since: float, paced: bool) -> None:
    """With N replicas each pacing its own over-share admissions, an engine would take N per
    interval; each paces at N x ``over_share_pace_s`` (N from the fairness exchange)."""
    from kvgate.plugins.flow.plugin import FlowControl
    from kvgate.plugins.flow.shared import FlowShare
    from kvgate.plugins.load.shared_load import ExchangeStats

    class _NoLookup:
        def lookup(self, name: str) -> object:
            raise KeyError(name)

    class _Exchange:
        def __init__(self, replicas: int, down: bool) -> None:
            self.stats = ExchangeStats(replicas=replicas, down=down)

    flow = FlowControl("flow-control", FlowParams(over_share_pace_s=1.0), _NoLookup())
    if others is not None:
        flow.shared = FlowShare(flow.p, flow.fair, flow.name)
        flow.shared.tenants = _Exchange(others, down)  # type: ignore[assignment]
    flow.saturation.pacers = flow._replicas()
    ep = _ep("e0")
    flow.saturation.headroom([ep], 100.0)  # the engine is known
    flow.saturation.pace("e0", 100.0)
    assert flow.saturation.paced(ep, 100.0 + since) is paced
