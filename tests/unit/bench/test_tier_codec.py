"""bench.tier_sim --codec-speed: the codec's measured decode time in the replay's TTFT
(bench.tier_codec). Virtual time only: no assertion depends on this machine's speed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.replay_trace import TRACE_BLOCK, TraceRequest
from bench.tier_codec import NOT_CHARGED, CodecSpeed, CodecTier, load_speed
from bench.tier_sim import Fleet, Setup, main, markdown
from kvgate.engines.sim.core.shared_tier import SharedTier, TierParams

REPO = Path(__file__).resolve().parents[3]
CPU_SPEED = REPO / "bench" / "results" / "codec-speed-cpu.json"
BLOCK_BYTES = TRACE_BLOCK * TierParams(capacity_blocks=1, block_size=TRACE_BLOCK).kv_bytes_per_token
#: Before --codec-speed existed, tier-aware-codec (factor 1.5) on :func:`_trace` (gap 2 s, 2
#: engines of 4 blocks, tier 20) gave these (HEAD 6d2479d): "no file" must keep them.
BEFORE_MEAN, BEFORE_P99 = 0.0454698469999999, 0.05402286588000038


def _trace(gap_ms: int) -> list[TraceRequest]:
    """Six distinct 3-block prompts, then the same six again: with 2 engines of 4 blocks the
    second round loads its 2 full blocks from the tier (each of the 6 loads: 2 blocks)."""
    return [TraceRequest(i, i * gap_ms, 3 * 512 - 10, 4, (10 * k + 1, 10 * k + 2, 10 * k + 3))
            for i, k in enumerate([*range(6), *range(6)])]


def _speed_file(tmp_path: Path, decode: float, encode: float = 1.0, gpu: bool = False,
                rows: tuple[int, ...] = (6144, 16384)) -> Path:
    path = tmp_path / f"speed-{decode}-{encode}-{gpu}.json"
    path.write_text(json.dumps({
        "backend": "triton kernels (compiled, CUDA)" if gpu else "torch reference (CPU)",
        "device": "NVIDIA H200" if gpu else "cpu", "gpu": gpu,
        "per_block_size": [{"block_values": v, "encode_gbps": encode, "decode_gbps": decode}
                           for v in rows]}))
    return path


def _fleet(speed: CodecSpeed | None, gap_ms: int,
           factor: float = 1.5) -> tuple[Fleet, dict[str, Any]]:
    fleet = Fleet(Setup("tier-aware-codec", 4, 20, factor, aware=True, codec=speed), 2)
    return fleet, fleet.run(_trace(gap_ms), 4)


def test_no_speed_file_keeps_the_ttfts_and_says_codec_time_is_not_charged() -> None:
    fleet, row = _fleet(None, 2000)
    assert type(fleet.tier) is SharedTier
    assert row["ttft_mean_s"] == pytest.approx(BEFORE_MEAN, rel=1e-12)
    assert row["ttft_p99_s"] == pytest.approx(BEFORE_P99, rel=1e-12)
    assert row["codec_time"] == {"charged": False, "label": NOT_CHARGED,
                                 "short": "codec time not charged"}
    assert row["tier"]["loads"] == 6 and row["tier"]["loaded"] == 12
    table = markdown({"engines": 2, "references": [
        {"trace": "t", "requests": 12, "fleet_blocks": 8, "pooled_lru_1x": 0.1,
         "pooled_lru_2x": 0.2, "ideal": 0.3}], "results": [row | {"trace": "t"}]})
    assert "| tier-aware-codec [codec time not charged] |" in table
    assert table.startswith(f"Codec time: {NOT_CHARGED}")


@pytest.mark.parametrize(("decode_gbps", "committed"), [
    (250.0, False),  # a fast GPU-like figure
    (1.0, False),
    (0.05, False),   # slower than a load's spacing would allow at a 2 s gap: 100 s here
    (None, True),    # the committed CPU reference: bench/results/codec-speed-cpu.json
])
def test_each_load_pays_its_bytes_over_the_measured_decode_speed(
        tmp_path: Path, decode_gbps: float | None, committed: bool) -> None:
    speed = load_speed(CPU_SPEED if committed else _speed_file(tmp_path, decode_gbps or 0.0))
    gbps = speed.decode_gbps
    # factor 1.0: encoded bytes = raw bytes, so the link time is today's and only decode adds
    base, _ = _fleet(None, 100_000, factor=1.0)
    charged, row = _fleet(speed, 100_000, factor=1.0)
    assert isinstance(charged.tier, CodecTier) and row["codec_time"]["charged"]
    extra = {i: charged.ttfts[i] - base.ttfts[i] for i in base.ttfts}
    for i in range(6):  # first round: computed, nothing loaded
        assert extra[str(i)] == 0.0
    for i in range(6, 12):  # second round: 2 blocks loaded each
        assert extra[str(i)] == pytest.approx(2 * BLOCK_BYTES / (gbps * 1e9), rel=1e-9)
    assert row["codec_time"]["decode_seconds_in_ttft"] == pytest.approx(
        12 * BLOCK_BYTES / (gbps * 1e9), rel=1e-12)
    assert row["codec_time"]["encode_seconds_async_not_in_ttft"] == pytest.approx(
        12 * BLOCK_BYTES / (speed.encode_gbps * 1e9), rel=1e-12)


@pytest.mark.parametrize(("slow", "fast"), [(0.03, 0.3), (0.3, 3.0), (1.0, 1.01), (5.0, 500.0)])
@pytest.mark.parametrize("gap_ms", [2000, 300, 50])
def test_a_faster_codec_never_gives_a_higher_ttft(tmp_path: Path, slow: float, fast: float,
                                                 gap_ms: int) -> None:
    slow_fleet, slow_row = _fleet(load_speed(_speed_file(tmp_path, slow)), gap_ms)
    fast_fleet, fast_row = _fleet(load_speed(_speed_file(tmp_path, fast)), gap_ms)
    for i, t in fast_fleet.ttfts.items():
        assert t <= slow_fleet.ttfts[i]
    for key in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "ttft_mean_s"):
        assert fast_row[key] <= slow_row[key]


@pytest.mark.parametrize(("rows", "target", "chosen"), [
    ((6144, 16384), 16384, 16384), ((6144, 16384), 6000, 6144), ((6144,), 16384, 6144),
    ((8192, 32768), 16384, 32768),  # equally far (x2): the larger block
])
def test_the_row_closest_to_the_models_block_is_used(tmp_path: Path, rows: tuple[int, ...],
                                                     target: int, chosen: int) -> None:
    speed = load_speed(_speed_file(tmp_path, 2.0, rows=rows), target)
    assert speed.block_values == chosen and f"block row {chosen} values" in speed.label


@pytest.mark.parametrize(("gpu", "says", "never"), [
    (False, "CPU REFERENCE", "GPU (NVIDIA"), (True, "GPU (NVIDIA H200)", "CPU REFERENCE")])
def test_the_label_names_the_file_and_backend(tmp_path: Path, gpu: bool, says: str,
                                              never: str) -> None:
    path = _speed_file(tmp_path, 2.0, gpu=gpu)
    speed = load_speed(path)
    assert says in speed.label and never not in speed.label and str(path) in speed.label
    assert "not in TTFT" in speed.label  # writes are asynchronous in the model


def test_the_committed_cpu_file_is_labelled_as_the_cpu_reference() -> None:
    speed = load_speed(CPU_SPEED)
    assert not speed.gpu and speed.block_values == 16384
    assert "torch reference" in speed.label and "CPU REFERENCE" in speed.label


@pytest.mark.parametrize("charged", [False, True])
def test_main_writes_which_speed_file_and_backend_or_not_charged(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], charged: bool) -> None:
    (tmp_path / "t_trace.jsonl").write_text("".join(
        json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                    "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n"
        for r in _trace(2000)))
    argv = ["--traces", "t", "--trace-dir", str(tmp_path), "--engines", "2", "--gpu-blocks",
            "4", "--tier-blocks", "20", "--setups", "tier-aware,tier-aware-codec",
            "--out", str(tmp_path / "out")]
    doc = main([*argv, "--codec-speed", str(CPU_SPEED)] if charged else argv)
    printed = capsys.readouterr().out
    codec = doc["results"][1]["codec_time"]
    assert codec["charged"] is charged and "codec_time" in doc["results"][0]
    if charged:
        assert doc["codec_speed"]["path"] == str(CPU_SPEED) and not doc["codec_speed"]["gpu"]
        assert doc["codec_time"].startswith(f"codec time charged from {CPU_SPEED}")
        assert "[decode charged: CPU torch reference, not GPU]" in printed
        assert codec["backend"].startswith("torch reference")
    else:
        assert doc["codec_speed"] is None and doc["codec_time"] == NOT_CHARGED
        assert "[codec time not charged]" in printed
    assert f"Codec time: {doc['codec_time']}" in printed
