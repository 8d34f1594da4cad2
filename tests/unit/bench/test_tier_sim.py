"""bench.tier_sim: the virtual-time fleet with and without a shared tier, and the codec factor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.replay_trace import TraceRequest
from bench.tier_sim import SAVING_BOUND, Fleet, Setup, codec_factor, setups


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
    rows = {s.name: s for s in setups(8, 1024, None, 1.5, ["no-tier", "equal-total", "tier"])}
    assert rows["equal-total"].gpu_blocks * 8 + rows["equal-total"].tier_blocks == 8 * 1024
    assert rows["tier"].tier_blocks == 8 * 1024 and rows["no-tier"].tier_blocks == 0


def test_codec_factor_reads_the_measurement_or_says_it_is_the_bound(tmp_path: Path) -> None:
    path = tmp_path / "codec-saving.json"
    factor, label = codec_factor(path)
    assert factor == pytest.approx(1 / (1 - SAVING_BOUND)) and label.startswith("bound")
    path.write_text(json.dumps({"saving": 0.25}))
    factor, label = codec_factor(path)
    assert factor == pytest.approx(4 / 3) and label.startswith("measured")
