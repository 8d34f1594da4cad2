"""The flow-control queue and fairness, through their own interfaces (pure, no I/O)."""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

from kvgate.plugins.flow.fairness import Fairness
from kvgate.plugins.flow.params import FlowParams
from kvgate.plugins.flow.queue import FlowQueue, Waiter


def _queue(**params: object) -> FlowQueue:
    p = FlowParams.model_validate(params)
    return FlowQueue(p, Fairness(p))


def _names(ws: list[Waiter]) -> list[str]:
    return [f"{w.band}:{w.tenant}:{w.session}" for w in ws]


def test_bands_are_strict_priority() -> None:
    q = _queue()
    q.enqueue("batch", "t", "b", 10, 0.0)
    q.enqueue("background", "t", "g", 10, 0.0)
    q.enqueue("standard", "t", "s", 10, 0.0)
    q.enqueue("interactive", "t", "i", 10, 0.0)
    assert _names(q.pump(4, 4, 100, 1.0)) == [
        "interactive:t:i", "standard:t:s", "batch:t:b", "background:t:g"]
    assert q.is_empty()


def test_pump_admits_only_free_slots() -> None:
    q = _queue()
    for i in range(5):
        q.enqueue("standard", "t", f"s{i}", 10, float(i))
    assert len(q.pump(2, 2, 100, 10.0)) == 2
    assert q.queued() == 3
    assert q.pump(0, 0, 100, 10.0) == []
    assert q.in_flight == {"t": 2}


def test_tenants_alternate_by_tokens_served_not_requests() -> None:
    """A queued 40 requests first, B queued 4 after: B is not behind A's backlog (VTC)."""
    q = _queue()
    for i in range(40):
        q.enqueue("standard", "A", None, 100, 0.0 + i * 1e-3)
    for i in range(4):
        q.enqueue("standard", "B", None, 100, 1.0 + i * 1e-3)
    first = [w.tenant for w in q.pump(8, 8, 1000, 2.0)]
    assert first.count("B") == 4, first
    assert first[:2] in (["A", "B"], ["B", "A"])


@pytest.mark.parametrize(("weight_a", "expected_a"), [(1.0, 10), (3.0, 15)])
def test_weighted_tenant_shares(weight_a: float, expected_a: int) -> None:
    q = _queue(tenant_weights={"A": weight_a})
    for i in range(50):
        q.enqueue("standard", "A", None, 100, i * 1e-3)
        q.enqueue("standard", "B", None, 100, i * 1e-3)
    got = [w.tenant for w in q.pump(20, 20, 1000, 1.0)]
    assert got.count("A") == expected_a


def test_big_prompts_count_more_than_small_ones() -> None:
    """Fairness by tokens: a tenant with 10x the prompt size gets ~1/10 of the requests."""
    q = _queue()
    for i in range(30):
        q.enqueue("standard", "big", None, 1000, i * 1e-3)
        q.enqueue("standard", "small", None, 100, i * 1e-3)
    got = [w.tenant for w in q.pump(22, 22, 1000, 1.0)]
    assert got.count("small") == 20 and got.count("big") == 2


def test_least_attained_session_first_and_fifo_option() -> None:
    for order, expected in (("las", ["new", "old"]), ("fifo", ["old", "new"])):
        q = _queue(session_order=order)
        q.fair.session_served("t", "old", 50_000)
        q.enqueue("standard", "t", "old", 10, 0.0)
        q.enqueue("standard", "t", "new", 10, 0.0)
        assert [w.session for w in q.pump(2, 2, 100, 0.0)] == expected


@pytest.mark.parametrize(("params", "served", "bound_s"), [
    ({"aging_tokens_per_s": 4096}, 8192, 2.0),
    ({}, 32_768, 2.0),  # the default, 16,384 tokens/s (docs/flow-control.md)
    ({}, 100_000, 100_000 / 16_384),
])
def test_aging_bounds_the_wait_of_a_long_session(params: dict[str, object], served: int,
                                                 bound_s: float) -> None:
    """A session served S tokens waits at most S / aging_tokens_per_s behind newcomers."""
    q = _queue(**params)
    q.fair.session_served("t", "long", served)
    q.enqueue("standard", "t", "long", 10, 0.0)
    q.enqueue("standard", "t", "fresh-1", 10, bound_s - 0.1)
    assert [w.session for w in q.pump(1, 1, 100, bound_s)] == ["fresh-1"]
    q.enqueue("standard", "t", "fresh-2", 10, bound_s + 0.1)
    assert [w.session for w in q.pump(1, 1, 100, bound_s + 0.2)] == ["long"]


def test_band_bound_refuses() -> None:
    q = _queue(bands={"standard": {"max_queued": 2}})
    assert q.enqueue("standard", "t", None, 1, 0.0) is not None
    assert q.enqueue("standard", "t", None, 1, 0.0) is not None
    assert q.enqueue("standard", "t", None, 1, 0.0) is None
    assert q.enqueue("batch", "t", None, 1, 0.0) is not None  # other bands unaffected


def test_ttl_expiry_and_removal() -> None:
    q = _queue(bands={"interactive": {"ttl_s": 1.0}, "batch": {"ttl_s": 5.0}})
    a = q.enqueue("interactive", "t", None, 1, 0.0)
    b = q.enqueue("batch", "t", None, 1, 0.0)
    c = q.enqueue("interactive", "t", None, 1, 0.5)
    assert a is not None and b is not None and c is not None
    assert q.remove(c, "gone") and not q.remove(c, "gone")
    assert q.expire(0.9) == []
    assert q.expire(1.0) == [a] and a.state == "expired"
    assert q.expire(5.0) == [b]
    assert q.is_empty() and q.pump(10, 10, 10, 6.0) == []


def test_reserve_goes_to_tenants_under_their_share() -> None:
    """Capacity 16, 2 slots left, both in their engines' reserves (none open): A (over its
    share) waits, B goes."""
    q = _queue(reserve_fraction=0.125)
    for _ in range(14):
        q.admit_now("A", 10, 0.0)
    q.admit_now("B", 10, 0.0)  # B is active: shares 8 / 8
    q.enqueue("standard", "A", None, 10, 0.1)
    assert q.pump(2, 0, 16, 0.2) == []
    w = q.enqueue("standard", "B", None, 10, 0.3)
    assert q.pump(2, 0, 16, 0.4) == [w]
    assert q.over_share("A", 16, 0.5) and not q.over_share("B", 16, 0.5)
    assert not q.over_share("B", 16, 0.5, excluding=1)
    a = q.enqueue("standard", "A", None, 10, 0.6)
    assert a is not None and len(q.pump(2, 2, 16, 0.7)) == 2  # slots open past the reserves
    batch = q.enqueue("batch", "B", None, 10, 0.8)  # B's batch work: never the reserve
    assert q.pump(1, 0, 16, 0.9) == [] and q.pump(1, 1, 16, 1.0) == [batch]


def _queued(q: FlowQueue, tenant: str, at: float) -> Waiter:
    w = q.enqueue("standard", tenant, None, 10, at)
    assert w is not None
    return w


def test_pacing_bounds_the_over_share_admissions_of_one_pump() -> None:
    """``paced``: at most that many waiters of tenants over their share leave in one pump
    (one per engine not paced); tenants under their share are not counted nor held."""
    q = _queue()
    for _ in range(10):
        q.admit_now("A", 10, 0.0)
    q.admit_now("B", 10, 0.0)  # shares 8 / 8: A is over
    a = [_queued(q, "A", 0.1 + i / 100) for i in range(3)]
    b = [_queued(q, "B", 0.2 + i / 100) for i in range(2)]
    got = q.pump(8, 8, 16, 0.5, paced=1)
    assert sorted(map(id, got)) == sorted(map(id, [a[0], *b]))
    assert [w.over_share for w in (a[0], *b)] == [True, False, False]
    assert q.pump(8, 8, 16, 0.6, paced=0) == []
    assert len(q.pump(8, 8, 16, 0.7)) == 2  # no pacing: the rest go


def test_a_lone_tenant_uses_the_whole_fleet() -> None:
    q = _queue(reserve_fraction=0.5)
    for i in range(16):
        q.enqueue("standard", "A", None, 10, i * 1e-3)
    assert len(q.pump(16, 16, 16, 1.0)) == 16


def test_idle_tenant_does_not_bank_credit() -> None:
    """B idle while A was served a lot: B joins at the virtual time, not at 0."""
    q = _queue()
    for i in range(10):
        q.enqueue("standard", "A", None, 1000, i * 1e-3)
    q.pump(10, 10, 100, 1.0)
    for i in range(10):
        q.enqueue("standard", "A", None, 1000, 2 + i * 1e-3)
        q.enqueue("standard", "B", None, 1000, 2 + i * 1e-3)
    got = [w.tenant for w in q.pump(10, 10, 100, 3.0)]
    assert 4 <= got.count("A") <= 6, got


def test_release_and_bounded_state() -> None:
    q = _queue(max_tenants=3, max_sessions=2, active_window_s=1.0)
    rng = random.Random(7)
    for i in range(50):
        tenant = f"t{rng.randrange(10)}"
        q.enqueue("standard", tenant, f"s{i}", 10, float(i))
        for w in q.pump(1, 1, 100, float(i)):
            q.fair.session_served(w.tenant, w.session, 10)
            q.release(w.tenant, float(i))
    assert q.fair.tenants() <= 3 and q.fair.sessions() <= 2
    assert q.in_flight == {}


@pytest.mark.parametrize(("params", "message"), [
    ({"bands": {"urgent": {}}}, "unknown band"),
    ({"tenant_weights": {"a": 0}}, "weights must be > 0"),
    ({"default_band": "interactive", "max_band": "standard"}, "above max_band"),
    ({"min_in_flight_per_engine": 9, "max_in_flight_per_engine": 8}, "min_in_flight"),
    ({"initial_in_flight_per_engine": 300}, "initial_in_flight"),
    ({"bands": {"batch": {"ttl_s": 0}}}, "greater than 0"),
    ({"reserve_fraction": 1.0}, "less than 1"),
    ({"unknown": 1}, "Extra inputs"),
])
def test_params_are_validated(params: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        FlowParams.model_validate(params)


def test_async_headroom_gate_stays_closed_while_live_requests_queue() -> None:
    """Deferred work sits below every live band: the async queue's gate reads the live queue."""
    from kvgate.asyncq.headroom import HeadroomParams, gate
    from kvgate.middleware.framework.types import Endpoint
    eps = [Endpoint(id="e", url="http://e", kind="vllm")]
    assert gate(eps, 0, HeadroomParams()).open
    verdict = gate(eps, 0, HeadroomParams(), live_queued=1)
    assert (verdict.open, verdict.reason) == (False, "live_queue")
