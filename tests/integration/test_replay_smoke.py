"""Smoke test of the trace replay benchmark: a few dozen conversation-trace requests through
kvgate's default (cache-aware) profile in front of 2 simulated engines, time scale 0."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from bench import replay

TRACE = replay.TRACE_DIR / "conversation_trace.jsonl"


@pytest.mark.skipif(not TRACE.exists(), reason="Mooncake traces not available")
def test_replay_end_to_end(tmp_path: Path) -> None:
    doc = replay.main([
        "--traces", "conversation", "--limit", "40", "--engines", "2", "--time-scale", "0",
        "--speedup", "1000", "--systems", "kvgate-default", "--out", str(tmp_path),
        "--no-progress",
    ])
    result = doc["results"]["conversation"]
    row = result["systems"][0]
    assert result["requests"] == 40 and row["ok"] == 40 and row["failed"] == 0
    ideal = result["engine_reachable_reference"]["ideal"]
    # every conversation prompt shares block 0: some hits, never more than the ideal
    assert 0 < row["hit_ratio"] <= ideal + 1e-9
    assert row["engine_hit_ratio"] == pytest.approx(row["hit_ratio"], rel=0.05)
    assert row["gateway_counters"]["kvgate_kv_events_applied_total"] > 0
    assert row["imbalance"] >= 1.0 and row["ttft_p50"] is not None
    assert {o[4] for o in result["outcomes"]["kvgate-default"]} <= {"engine-0", "engine-1"}
    written = json.loads(next(tmp_path.glob("replay-*.json")).read_text())
    assert written["results"]["conversation"]["systems"] == result["systems"]
    charts = list(tmp_path.glob("replay-*.png"))  # the chart needs the bench extra's matplotlib
    if importlib.util.find_spec("matplotlib") is None:
        assert charts == []
    else:
        assert len(charts) == 1 and charts[0].stat().st_size > 0
