"""bench/pipeline_cost.py: its summary and table, and one real (tiny) run of the default
pipeline behind two fake engines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import pipeline_cost


def test_summary_and_table() -> None:
    samples = {"total_us": [30.0, 10.0, 20.0],
               "stages_us": [{"parse": 5.0, "schedule": 9.0}, {"parse": 4.0, "schedule": 8.0},
                             {"parse": 6.0, "schedule": 10.0}]}
    summary = pipeline_cost.summarise(samples)
    assert summary == {"total_us": 20.0, "stages_us": {"parse": 5.0, "schedule": 9.0}}
    assert list(summary["stages_us"]) == ["parse", "schedule"]  # pipeline order kept
    text = pipeline_cost.table(summary)
    assert "| parse | 5.00 |" in text
    assert "| sum of the stages | 14.00 |" in text
    assert "| total, no stage timer | 20.00 |" in text


@pytest.mark.parametrize("argv", [["--requests", "0"], ["--engines", "0"], ["--warmup", "-1"]])
def test_bad_arguments_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit, match="must be >= 1"):
        pipeline_cost.main(argv)


def test_a_tiny_real_run(tmp_path: Path) -> None:
    """Every stage of the default pipeline ran on every request, behind two engines; the
    stages' sum is near the untimed total (the timers add a little, the loop's own work is
    outside the stages)."""
    out = tmp_path / "pipeline.json"
    assert pipeline_cost.main(["--requests", "200", "--warmup", "20", "--trials", "1",
                               "--engines", "2", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [e["name"] for e in doc["preset"]["engines"]] == ["engine-0", "engine-1"]
    stages = doc["summary"]["stages_us"]
    assert list(stages) == [
        "parse", "on_request (all)", "prepare tokenizer", "prepare prefix-cache-producer",
        "prepare session-affinity-scorer", "schedule (filters, scorers, picker)",
        "before_dispatch prefix-cache-producer", "before_dispatch session-affinity-scorer",
        "before_dispatch token-load-scorer", "before_dispatch kv-placement-scorer",
        "before_dispatch flow-control",
        "on_usage (all)", "on_complete, on_request_end (all)"]
    assert all(us > 0 for us in stages.values())
    total = doc["summary"]["total_us"]
    assert 0.5 * total < sum(stages.values()) < 2.0 * total
    assert "| total, no stage timer |" in doc["table"]
