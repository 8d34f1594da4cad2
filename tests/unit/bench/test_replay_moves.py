"""bench.replay_moves: a replay's decisions priced again offline, moves attributed to a term."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.replay_moves import decompose, main, read_outcomes

BLOCK = 512


def _line(ts: int, blocks: tuple[int, ...], tokens: int) -> str:
    return json.dumps({"timestamp": ts, "input_length": tokens, "output_length": 4,
                       "hash_ids": list(blocks)})


def _doc(tmp_path: Path, rows: list[tuple[int, int, float, float]]) -> Path:
    """A two-request replay of one session: A (blocks 1-4), then B extending it (1-5), sent
    1 s of trace time later (0.1 s at speed-up 10); ``rows``: (engine, cached, late, latency)
    per request. Engines of 64 blocks: nothing is evicted."""
    trace = tmp_path / "t_trace.jsonl"
    trace.write_text("\n".join([_line(0, (1, 2, 3, 4), 4 * BLOCK),
                                _line(1000, (1, 2, 3, 4, 5), 5 * BLOCK)]) + "\n")
    fields = ["index", "status", "ttft_wall_s", "cached_tokens", "engine", "error",
              "late_wall_s", "latency_wall_s"]
    outcomes = [[i, 200, 0.01, cached, f"engine-{engine}", None, late, latency]
                for i, (engine, cached, late, latency) in enumerate(rows)]
    doc: dict[str, Any] = {"speedup": 10.0, "results": {"t": {
        "trace": str(trace), "requests": 2,
        "fleet": {"engines": 2, "capacity_blocks": 64},
        "outcomes": {"fields": fields, "kvgate-default": outcomes}}}}
    path = tmp_path / "replay.json"
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize(("case", "rows", "kind", "lost"), [
    # B follows A home and finds A's 4 blocks there
    ("home", [(0, 0, 0.0, 0.01), (0, 2048, 0.0, 0.01)], "home", 0),
    # B sent elsewhere after A's answer: no queue, equal pressure, the pin on e0: unexplained
    ("moved, no reason", [(0, 0, 0.0, 0.01), (1, 0, 0.0, 0.01)], "unexplained", 2048),
])
def test_decisions_are_classified_and_priced(
    tmp_path: Path, case: str, rows: list[tuple[int, int, float, float]], kind: str, lost: int,
) -> None:
    doc = json.loads(_doc(tmp_path, rows).read_text())
    reqs, sent = read_outcomes(doc, "t", "kvgate-default", tmp_path)
    out = decompose(reqs, sent, 2, 64, {})
    total = 9 * BLOCK
    assert out["measured_hit_ratio"] == out["model_hit_ratio"], case
    decisions = out["decisions"]
    assert decisions["cold"] == 1, case
    assert decisions.get("home", 0) + decisions.get("moved", 0) == 1, case
    if kind == "home":
        assert decisions["home"] == 1 and "moved_lost" not in out["lost_and_differences"]
    else:
        assert decisions[f"moved_by_{kind}"] == 1
        assert out["lost_and_differences"]["moved_lost"] == round(lost / total, 5)


def test_a_move_away_from_a_long_queue_is_the_queue_terms(tmp_path: Path) -> None:
    """B moves while A, 2,048 + 16 tokens, is in flight at home: at load_weight 2 the queue
    (4,128 cost tokens) outweighs the 2,048 tokens B holds there, without it home wins."""
    doc = json.loads(_doc(tmp_path, [(0, 0, 0.0, 5.0), (1, 0, 0.0, 0.01)]).read_text())
    reqs, sent = read_outcomes(doc, "t", "kvgate-default", tmp_path)
    assert decompose(reqs, sent, 2, 64, {"load_weight": 2.0})["decisions"]["moved_by_queue"] == 1
    # the same move after A's answer: nothing in flight, so the shadow would have kept B home
    doc = json.loads(_doc(tmp_path, [(0, 0, 0.0, 0.05), (1, 0, 0.0, 0.01)]).read_text())
    reqs, sent = read_outcomes(doc, "t", "kvgate-default", tmp_path)
    out = decompose(reqs, sent, 2, 64, {"load_weight": 2.0})
    assert out["decisions"]["moved_by_unexplained"] == 1


def test_engine_and_model_differences_are_summed(tmp_path: Path) -> None:
    """An engine reporting more than the model's LRU could hold shows as engine_above_model."""
    path = _doc(tmp_path, [(0, 512, 0.0, 0.01), (0, 2048, 0.0, 0.01)])
    out = main([str(path), "--trace-dir", str(tmp_path)])["t"]
    assert out["lost_and_differences"]["engine_above_model"] == round(512 / (9 * BLOCK), 5)
    assert out["measured_hit_ratio"] > out["model_hit_ratio"]


def test_a_result_without_latencies_is_refused(tmp_path: Path) -> None:
    doc = json.loads(_doc(tmp_path, [(0, 0, 0.0, 0.01), (0, 0, 0.0, 0.01)]).read_text())
    res = doc["results"]["t"]["outcomes"]
    res["fields"] = res["fields"][:6]
    with pytest.raises(ValueError, match="latency"):
        read_outcomes(doc, "t", "kvgate-default", tmp_path)
