"""bench/steady_workloads.py and bench/steady_sim.py: the seeded family stays in its declared
ranges and is reproducible, the untimed steady-state run keeps its routers across workloads,
and kvgate's placement beats a random spread on a small two-engine cell of it."""

from __future__ import annotations

import pytest

from bench import steady_sim
from bench.steady_workloads import RANGES, sequence


def test_the_family_is_seeded_and_in_its_ranges() -> None:
    first = list(sequence(7, 4, 128))
    again = list(sequence(7, 4, 128))
    assert [len(w.requests) for w in first] == [len(w.requests) for w in again]
    assert [w.requests[-1].blocks for w in first] == [w.requests[-1].blocks for w in again]
    lo, hi = RANGES["concurrent"]
    for wl in first:
        assert lo <= wl.concurrent <= hi and wl.sessions >= wl.concurrent
        assert RANGES["shared"][0] <= wl.shared_tokens <= RANGES["shared"][1]
        times = [r.at for r in wl.requests]
        assert times == sorted(times)
        for r in wl.requests:
            assert len(r.tokens) == r.prompt and len(r.blocks) == r.prompt // 128
            assert RANGES["reply"][0] // 2 <= r.reply <= RANGES["reply"][1]
    # workloads share no session and no token beyond a reused shared prefix
    sessions = [{r.session for r in wl.requests} for wl in first]
    assert all(not (a & b) for i, a in enumerate(sessions) for b in sessions[i + 1:])


@pytest.mark.parametrize("engines", [2, 4])
def test_placement_beats_random_in_steady_state(engines: int) -> None:
    cell = steady_sim.run_cell(1, engines, 1.0, 4, ("kvgate", "kvgate-approx", "random"), {})
    for system in ("kvgate", "kvgate-approx"):
        for k in range(1, 4):  # from the second workload on: caches full of the earlier ones
            assert cell["systems"][system][k]["share"] >= \
                cell["systems"]["random"][k]["share"] + 0.05, (system, k)
    summary = steady_sim.summarize([cell], ("kvgate", "kvgate-approx", "random"))
    assert summary["kvgate/headers"]["n"] + summary["kvgate/no-headers"]["n"] == 3
