"""The circuit breaker's transitions (middleware/fleet/breaker.py), one event sequence per case."""

from __future__ import annotations

import pytest

from kvgate.middleware.fleet.breaker import Breaker, BreakerState

CLOSED, HALF, OPEN = BreakerState.CLOSED, BreakerState.HALF_OPEN, BreakerState.OPEN


def _play(breaker: Breaker, events: str) -> list[BreakerState | None]:
    """``f`` failure, ``s`` success, ``t`` trip, ``p`` probe ok, ``d`` dispatch, ``r`` release."""
    moves: list[BreakerState | None] = []
    for event in events:
        if event == "d":
            breaker.on_dispatch()
        elif event == "r":
            breaker.on_release()
        else:
            step = {"f": breaker.on_failure, "s": breaker.on_success, "t": breaker.trip,
                    "p": breaker.on_probe_ok}[event]
            moves.append(step())
    return moves


@pytest.mark.parametrize(("events", "state", "allows", "moves"), [
    ("ff", CLOSED, True, [None, None]),
    ("fff", OPEN, False, [None, None, OPEN]),
    ("ffsff", CLOSED, True, [None, None, None, None, None]),  # a success resets the run
    ("t", OPEN, False, [OPEN]),
    ("tf", OPEN, False, [OPEN, None]),
    ("tp", HALF, True, [OPEN, HALF]),
    ("tpd", HALF, False, [OPEN, HALF]),  # one trial at a time
    ("tpdr", HALF, True, [OPEN, HALF]),  # the trial ended without a verdict (client left)
    ("tpdf", OPEN, False, [OPEN, HALF, OPEN]),  # a failed trial opens again at once
    ("tpds", CLOSED, True, [OPEN, HALF, CLOSED]),
    ("p", CLOSED, True, [None]),  # a probe does not move a closed breaker
    ("tpp", HALF, True, [OPEN, HALF, None]),
])
def test_transitions(events: str, state: BreakerState, allows: bool,
                     moves: list[BreakerState | None]) -> None:
    breaker = Breaker(threshold=3)
    got = _play(breaker, events)
    assert breaker.state is state and breaker.allows() is allows
    assert got == moves


def test_reopened_breaker_needs_a_full_run_after_closing() -> None:
    breaker = Breaker(threshold=2)
    _play(breaker, "ffpds")
    assert breaker.state is CLOSED and breaker.failures == 0
    assert _play(breaker, "ff") == [None, OPEN]
