"""bench.tier_sim: the virtual-time fleet with and without a shared tier, and the codec factor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.replay_trace import TraceRequest
from bench.tier_sim import SAVING_BOUND, Fleet, Setup, codec_factor, markdown, setups


def _trace() -> list[TraceRequest]:
    """Six distinct 3-block prompts, then the same six again: with 2 engines of 4 blocks the
    second round finds nothing left on the GPUs, only in a tier."""
    reqs = []
    for rnd in range(2):
        for k in range(6):
            i = rnd * 6 + k
            reqs.append(TraceRequest(i, i * 2000, 3 * 512 - 10, 4,
                                     (10 * k + 1, 10 * k + 2, 10 * k + 3)))
    return reqs


@pytest.mark.parametrize("setup", [
    Setup("tier", 4, 64), Setup("tier-aware", 4, 64, aware=True),
    Setup("tier-aware-codec", 4, 20, 1.5, aware=True),
])
def test_the_tier_serves_what_the_gpus_evicted(setup: Setup) -> None:
    base = Fleet(Setup("no-tier", 4), 2).run(_trace(), 4)
    row = Fleet(setup, 2).run(_trace(), 4)
    assert base["first_tokens"] == row["first_tokens"] == 12
    assert base["tier_hit_ratio"] == 0.0 and row["tier_hit_ratio"] > 0.0
    assert row["hit_ratio"] > base["hit_ratio"]
    assert row["hit_ratio"] == pytest.approx(row["gpu_hit_ratio"] + row["tier_hit_ratio"])
    assert row["tier"]["loaded"] > 0 and row["tier"]["capacity"] == int(
        setup.tier_blocks * setup.capacity_factor)


def test_equal_total_moves_a_quarter_of_each_gpu_into_the_tier() -> None:
    rows = {s.name: s for s in setups(8, 1024, None, 1.5, ["no-tier", "equal-total", "tier",
                                                            "equal-total-evicted"])}
    assert rows["equal-total"].gpu_blocks * 8 + rows["equal-total"].tier_blocks == 8 * 1024
    assert rows["tier"].tier_blocks == 8 * 1024 and rows["no-tier"].tier_blocks == 0
    assert rows["equal-total-evicted"].write == "evicted"
    assert rows["equal-total-evicted"].tier_blocks == rows["equal-total"].tier_blocks


def test_codec_factor_reads_the_measurement_or_says_it_is_the_bound(tmp_path: Path) -> None:
    path = tmp_path / "codec-saving.json"
    factor, label = codec_factor(path)
    assert factor == pytest.approx(1 / (1 - SAVING_BOUND)) and label.startswith("bound")
    path.write_text(json.dumps({"saving": 0.25}))
    factor, label = codec_factor(path)
    assert factor == pytest.approx(4 / 3) and label.startswith("measured")


def test_a_prompt_longer_than_the_engine_is_rejected_not_queued_forever() -> None:
    reqs = [*_trace()[:2], TraceRequest(2, 5000, 5 * 512, 4, (91, 92, 93, 94, 95))]
    row = Fleet(Setup("no-tier", 4), 2).run(reqs, 4)  # 4 blocks: at most 2,048 tokens
    assert row["rejected_too_long"] == 1 and row["first_tokens"] == 2


def test_markdown_has_one_table_per_trace_and_capacity() -> None:
    rows = [Fleet(s, 2).run(_trace(), 4) | {"trace": "t"} for s in setups(
        2, 4, 16, 1.5, ["no-tier", "tier", "equal-total"])]
    refs = [{"trace": "t", "requests": 12, "fleet_blocks": 8, "pooled_lru_1x": 0.1,
             "pooled_lru_2x": 0.2, "ideal": 0.3}]
    text = markdown({"engines": 2, "references": refs, "results": rows})
    assert text.count("| setup |") == 1 and text.count("12/12") == 3
