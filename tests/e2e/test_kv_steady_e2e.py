"""Steady state on real engines (issue 28): ONE long-running ``kvgate serve --engine A --engine
B`` serves three consecutive small agentic workloads (seeds 0, 1, 2: each its own shared system +
tool prompt and sessions; without, with, without session headers) on two real vLLM CPU engines
whose caches hold only a few sessions each, nothing reset between the workloads; a random spread
does the same on the same engines in the same run, after the engines' caches were reset
(bench/kv_steady.py, the harness of ``python -m bench.kv_pressure --steady N``).

A gateway that has been up for a while must keep what a fresh one does: in the third workload,

* kvgate's share of the ideal cached tokens (bench/agentic_ideal.py) exceeds random's by at
  least ``MARGIN``;
* at most ``MAX_BUSIEST`` of the workload's requests are served by one engine.

The user's report (a gateway serving five workloads in a row): from the second workload on
kvgate reached 0.72-0.80 of the ideal against random's 0.78-0.85, with 85-94 % of each
workload's requests on one engine (access log ``placement: home``); one fresh gateway per
workload reached 0.95-0.99.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from bench import agentic, venvs
from bench.kv_pressure import fleet_of, token_counter, warm_up
from bench.kv_steady import Cell, line, run_sequence, sequence, table
from kvgate.engines.local.launcher import LocalEngine
from tests.e2e.conftest import SMALL_KV_CACHE_BYTES

pytestmark = pytest.mark.e2e

SEED = 0
WORKLOADS = 3
#: Workload k's mode: without session headers first, so the third one (the one asserted) is
#: also without: kvgate has only its own record of what it sent, like random has nothing.
MODES = ("no-headers", "headers")
SYSTEMS = ("kvgate-default", "random")
#: 4 agents at once, 6 in all (42-63 requests a workload for seeds 0-2): the low level's shape,
#: smaller, so the test runs in about 4 minutes on 2 cores. Its sessions split 0.50-0.51 at best
#: between the engines (their lengths differ), 0.51-0.62 by index. (3 at once, 4 in all kept
#: every session cached even on one engine: no share lost to concentration, only to scatter.)
SMALL = agentic.Level(slots=4, agents=6)
#: KV per engine: 24 MiB = 48 blocks of 128 tokens (tests/e2e/test_kv_pressure_e2e.py's
#: sizing for 4 at once): the shared prompt (10 blocks) and two growing sessions fit, four do
#: not, so a spread that keeps each session on one engine keeps its turns cached and one that
#: scatters them (every engine needing every session) or concentrates them evicts.
KV_CACHE_BYTES = SMALL_KV_CACHE_BYTES
#: kvgate's share must exceed random's by this much. A fresh gateway is 0.12-0.16 above random
#: at the low level (docs/benchmarks.md, "KV pressure results"); the collapse put it 0.03-0.08
#: below. 0.05 lies between, above the run-to-run spread of random's share (0.84-0.88).
MARGIN = 0.05
#: Most of the third workload's requests one engine may serve: its sessions split 0.52 / 0.48
#: at best and 0.59 / 0.41 by index; the collapse put 0.85-0.94 on one engine. 0.70 leaves a
#: split by sessions (one session more on an engine) room and catches the collapse.
MAX_BUSIEST = 0.70


@pytest.fixture(scope="module")
def cells(small_kv_fleet: list[LocalEngine], tiny_model: Path,
          tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Cell]]:
    """On the shared ``small_kv_fleet``: two engines binding their own KV-event sockets with
    ``KV_CACHE_BYTES`` each, serving ``POST /reset_prefix_cache`` (vLLM's dev mode) so that
    each system starts from empty caches."""
    fleet = fleet_of(small_kv_fleet, tiny_model)
    warm_up(fleet)
    workloads = sequence(SEED, WORKLOADS, "low", token_counter(tiny_model), SMALL)
    logs = tmp_path_factory.mktemp("kv-steady")
    tag = uuid.uuid4().hex[:8]
    out = {s: run_sequence(s, workloads, MODES, fleet, f"e2e-{tag}-{s}", logs,
                           venvs.DEFAULT_ROOT) for s in SYSTEMS}
    print(f"\nsteady state ({[w.requests() for w in workloads]} requests per workload; share "
          f"of ideal / busiest engine's share):\n"
          + table([c for v in out.values() for c in v], MODES))
    return out


def _why(cell: Cell) -> str:
    """The cell, the placement's view before and after it (pressures, decisions) and /health's
    plugin sections (index states)."""
    return (f"{line(cell)}\nplacement: {cell.placement}\n"
            f"/health plugins: {cell.health.get('plugins')}")


def test_every_request_succeeds(cells: dict[str, list[Cell]]) -> None:
    for cell in (c for v in cells.values() for c in v):
        assert cell.summary.failed == 0, [r.error for r in cell.records if not r.ok]
        assert cell.summary.ideal_tokens > 0


def test_random_spreads_over_both_engines(cells: dict[str, list[Cell]]) -> None:
    """The reference is a real spread (a degenerate 'random' would make the margin moot)."""
    routed: dict[str, int] = {}
    for cell in cells["random"]:
        for rec in cell.records:
            routed[rec.engine or "?"] = routed.get(rec.engine or "?", 0) + 1
    assert len(routed) == 2 and min(routed.values()) >= 0.3 * sum(routed.values()), routed


def test_third_workload_share_of_ideal_above_random(cells: dict[str, list[Cell]]) -> None:
    kvgate, spread = cells["kvgate-default"][2], cells["random"][2]
    mine, theirs = kvgate.summary.share_of_ideal, spread.summary.share_of_ideal
    assert mine is not None and theirs is not None
    assert mine >= theirs + MARGIN, f"{_why(kvgate)}\nrandom: {line(spread)}"


def test_third_workload_not_on_one_engine(cells: dict[str, list[Cell]]) -> None:
    kvgate = cells["kvgate-default"][2]
    assert kvgate.busiest_share <= MAX_BUSIEST, _why(kvgate)
