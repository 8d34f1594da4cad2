"""``kvgate codec bench --speed`` on a tiny synthetic input: the JSON report's fields, the
bit-exactness of every block size and the device copy measured in the same run (not the speed:
this machine's figures are in docs/kernels.md). The codec runs in the engine venv (torch); the
test skips when that venv has not been built (``kvgate engines setup``), as building it here
would take minutes and 3.5 GB."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvgate.engines.kvcodec.venv import MARKER, MODEL_REQUIREMENT
from kvgate.engines.local.paths import engine_venv
from kvgate.engines.local.venv import venv_ready
from kvgate.middleware import cli


def _codec_env_ready() -> bool:
    marker = engine_venv() / MARKER
    return venv_ready() and marker.is_file() and marker.read_text().strip() == MODEL_REQUIREMENT


@pytest.mark.skipif(not _codec_env_ready(), reason="engine venv with the codec's model not built "
                    "(kvgate codec setup)")
def test_speed_report_on_a_tiny_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "speed.json"
    rc = cli.main(["codec", "bench", "--speed", "--source", "synthetic", "--values", "40000",
                   "--block-values", "6144,16384", "--repeats", "1", "--out", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == {
        k: v for k, v in report.items() if k != "command"}
    assert report["command"].startswith("kvgate codec bench --json --speed --source=synthetic")
    assert report["bit_exact"] is True
    assert report["gpu"] is False and report["backend"].startswith("torch reference (CPU")
    assert (report["source"], report["values"], report["repeats"]) == ("synthetic", 40000, 1)
    rows = report["per_block_size"]
    assert [(r["block_values"], r["blocks"]) for r in rows] == [(6144, 6), (16384, 2)]
    for r in rows:
        assert r["bit_exact"] is True
        assert r["raw_bytes"] == 2 * r["block_values"] * r["blocks"]
        assert 0.25 < r["saving"] < 0.35  # Gaussian BF16: ~2.6 bits of exponent entropy
        assert r["encoded_bytes"] == round(r["raw_bytes"] * (1 - r["saving"]))
        for what in ("copy", "encode", "decode"):
            assert r[f"{what}_gbps"] > 0 and r["seconds"][what] > 0
        assert r["encode_vs_copy"] == pytest.approx(r["seconds"]["copy"] / r["seconds"]["encode"])
        assert r["decode_vs_copy"] == pytest.approx(r["seconds"]["copy"] / r["seconds"]["decode"])
