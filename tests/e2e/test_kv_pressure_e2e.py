"""A small KV-pressure run (bench/kv_pressure.py's harness, the same agentic workload, fewer
agents) on two real vLLM CPU engines whose caches hold only a few agent sessions each.

Outcome bounds the default ``kvgate serve --engine A --engine B`` must hold, in one run next to a
cache-blind uniform spread (``random``) on the same engines and workload:

* share of the ideal cached tokens (bench/agentic_ideal.py) >= ``MIN_SHARE_HEADERS`` with
  ``x-session-affinity`` and >= ``MIN_SHARE_PLAIN`` without any session header — the levels the
  user's report put pinning (0.985) and vllm-router ``cache_aware`` (0.905) at, where the old
  default reached 0.71-0.81 and random 0.85;
* both above random's share in the same run.

With precise routing (``--kv-events`` per engine + ``--tokenizer``), the gateway's predicted
cached tokens agree with the engines' reports within one block on >= 85 % of the index's
predictions (``kvgate_kv_predictions_total{engine,result}`` on /metrics; speculative misses
apart): under this deliberate KV pressure blocks are evicted between routing and admission.
Unpressured, the bound is 99 % (tests/e2e/test_kv_predictions_e2e.py).
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from bench import agentic, venvs
from bench.agentic_ideal import RunSummary
from bench.kv_pressure import RunResult, fleet_of, run_one, table, token_counter
from kvgate.engines.local.launcher import LocalEngine
from tests.e2e.conftest import SMALL_KV_CACHE_BYTES

pytestmark = pytest.mark.e2e

SEED = 0
#: 4 agents at once, 4 in all (~35 requests a run): the low level's shape, smaller.
SMALL = agentic.Level(slots=4, agents=4)
MIN_SHARE_HEADERS = 0.90
MIN_SHARE_PLAIN = 0.85
#: Under deliberate KV pressure a few blocks are evicted between the routing decision and the
#: engine admitting the request (seen: 33-34 of 36 within one block, misses all "over"). The
#: >= 99 % bound holds on an unpressured fleet: tests/e2e/test_kv_predictions_e2e.py (9 of 9).
MIN_WITHIN_BLOCK = 0.85
#: Agents start together on the shared tool prompt: a few requests are predicted on blocks a
#: concurrent request is still computing (seen: 2-3 of 36).
MAX_SPECULATIVE = 0.15
RUNS = (("kvgate-default", "headers"), ("kvgate-default", "no-headers"),
        ("random", "no-headers"), ("kvgate-precise", "headers"))
#: KV per engine: 24 MiB = 48 blocks of 128 tokens, bench/kv_pressure.py's sizing scaled to 4
#: agents at once: a partition (2 sessions + the shared prompts per engine) fits, one engine
#: holding all 4 does not once the sessions have grown.
KV_CACHE_BYTES = SMALL_KV_CACHE_BYTES


@pytest.fixture(scope="module")
def runs(small_kv_fleet: list[LocalEngine], tiny_model: Path,
         tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], RunResult]:
    """On two engines as deployed (each binds its own KV-event socket, vLLM's default empty
    topic) with ``KV_CACHE_BYTES`` each: the shared ``small_kv_fleet``, caches emptied."""
    fleet = fleet_of(small_kv_fleet, tiny_model)
    workload = agentic.build(SEED, "low", token_counter(tiny_model), SMALL)
    logs = tmp_path_factory.mktemp("kv-pressure")
    tag = uuid.uuid4().hex[:8]
    out = {(system, mode): run_one(system, mode, workload, fleet, f"e2e-{tag}-{system}-{mode}",
                                   logs, venvs.DEFAULT_ROOT) for system, mode in RUNS}
    print(f"\nKV-pressure e2e ({workload.requests()} requests a run):\n"
          + table([r.summary for r in out.values()]))
    return out


def _summary(runs: dict[tuple[str, str], RunResult], system: str, mode: str) -> RunSummary:
    return runs[(system, mode)].summary


def test_every_request_succeeds(runs: dict[tuple[str, str], RunResult]) -> None:
    for result in runs.values():
        assert result.summary.failed == 0, [r.error for r in result.records if not r.ok]
        assert result.summary.ideal_tokens > 0


def test_default_holds_its_share_of_ideal_above_random(
        runs: dict[tuple[str, str], RunResult]) -> None:
    headers = _summary(runs, "kvgate-default", "headers").share_of_ideal
    plain = _summary(runs, "kvgate-default", "no-headers").share_of_ideal
    spread = _summary(runs, "random", "no-headers").share_of_ideal
    assert headers is not None and plain is not None and spread is not None
    print(f"\nshare of ideal: default+headers {headers:.3f}, default {plain:.3f}, "
          f"random {spread:.3f}")
    assert headers >= MIN_SHARE_HEADERS
    assert plain >= MIN_SHARE_PLAIN
    assert headers > spread and plain > spread


def test_random_spreads_over_both_engines(runs: dict[tuple[str, str], RunResult]) -> None:
    """The reference is a real spread (a degenerate 'random' would make the bound meaningless)."""
    routed = _summary(runs, "random", "no-headers").engine_requests
    assert len(routed) == 2 and min(routed.values()) >= 0.25 * sum(routed.values()), routed


def test_precise_predictions_within_one_block(runs: dict[tuple[str, str], RunResult]) -> None:
    """The index's predictions (what the engines' events said) are within one block of the
    engines' reports; a miss due only to speculative entries (a request dispatched moments
    earlier on the same new prefix had not computed its blocks yet when this one was admitted)
    is counted apart as ``speculative`` and bounded here: it is a timing guess, not the index."""
    result = runs[("kvgate-precise", "headers")]
    checked = result.predictions
    total = sum(checked.values())
    speculative = checked.get("speculative", 0.0)
    evicted = checked.get("evicted", 0.0)  # removed by the engine while in flight: not judged
    print(f"\nkvgate-precise predictions: {checked}; /health kv section: "
          f"{ {k: v for k, v in result.health.items() if k not in ('engines',)} }")
    assert total >= 0.9 * result.summary.requests, checked
    assert speculative <= MAX_SPECULATIVE * total, checked
    judged = total - speculative - evicted
    assert checked.get("within_block", 0.0) >= MIN_WITHIN_BLOCK * judged, checked
