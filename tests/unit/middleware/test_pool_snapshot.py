"""EndpointPool.snapshot: each engine's Endpoint is rebuilt only after something scheduling
sees of that engine changed (a lease taken or released, its breaker moved); the others are the
same objects as before, and an unchanged pool returns the same tuple."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvgate.middleware.fleet.pool import EndpointPool, Lease
from kvgate.middleware.framework.composition.config import EngineConfig, PoolConfig
from kvgate.middleware.framework.composition.registry import Registry
from kvgate.middleware.framework.types import Endpoint

NAMES = ("e0", "e1", "e2", "e3")


def _pool() -> EndpointPool:
    adapter = Registry.from_entry_points().adapter("vllm")
    assert adapter is not None
    engines = [EngineConfig(name=n, url=f"http://127.0.0.1:{9000 + i}")
               for i, n in enumerate(NAMES)]
    return EndpointPool(engines, {"vllm": adapter}, PoolConfig(breaker_failures=1))


def _by_id(pool: EndpointPool) -> dict[str, Endpoint]:
    return {ep.id: ep for ep in pool.snapshot()}


def test_unchanged_pool_returns_the_same_snapshot() -> None:
    pool = _pool()
    first = pool.snapshot()
    assert [ep.id for ep in first] == list(NAMES)
    assert pool.snapshot() is first


Change = Callable[[EndpointPool], object]


@pytest.mark.parametrize(("change", "engine", "check"), [
    (lambda p: p.acquire("e1", 100), "e1",
     lambda ep: (ep.in_flight_requests, ep.in_flight_tokens, ep.healthy) == (1, 100, True)),
    (lambda p: p.report_failure("e2", "connection refused"), "e2",
     lambda ep: not ep.healthy),
    (lambda p: p.report_outcome("e3", "HTTP 500"), "e3",  # breaker_failures=1: opens
     lambda ep: not ep.healthy),
])
def test_a_change_rebuilds_that_engine_only(change: Change, engine: str,
                                            check: Callable[[Endpoint], bool]) -> None:
    pool = _pool()
    before = _by_id(pool)
    change(pool)
    after = _by_id(pool)
    assert check(after[engine])
    assert after[engine] is not before[engine]
    assert all(after[n] is before[n] for n in NAMES if n != engine)


def test_release_and_a_served_request() -> None:
    pool = _pool()
    lease = pool.acquire("e0", 40)
    held = _by_id(pool)
    assert held["e0"].in_flight_tokens == 40
    pool.report_outcome("e0", None)  # served, breaker closed: nothing scheduling sees changes
    assert _by_id(pool)["e0"] is held["e0"]
    assert isinstance(lease, Lease)
    lease.release()
    lease.release()  # a second release changes nothing
    after = _by_id(pool)
    assert (after["e0"].in_flight_requests, after["e0"].in_flight_tokens) == (0, 0)
    assert all(after[n] is held[n] for n in NAMES[1:])
