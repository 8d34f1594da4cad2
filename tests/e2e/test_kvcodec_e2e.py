"""``kvgate codec bench --json`` as a real process: the codec's environment is set up on first
use (the engine venv, as the engine e2e tests build it, plus the model the K/V come from), the
bench runs in the engine venv, and its last stdout line is the report checked here. Without a
GPU the Triton kernels run through the interpreter (``TRITON_INTERPRET=1``). One 256-token
window keeps it to about half a minute (192 real blocks; docs/kernels.md has the full run).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.e2e

KVGATE = str(Path(sys.executable).with_name("kvgate"))
#: The issue's bar: 85 % of the ~33 % bound that the exponents' entropy allows.
MIN_SAVING = 0.28


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    done = subprocess.run([KVGATE, "codec", "bench", "--json", "--windows", "1"],
                          capture_output=True, text=True, timeout=1800, check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_every_tensor_tried_round_trips_bit_exact(report: dict[str, Any]) -> None:
    assert report["bit_exact"] is True
    assert len(report["per_tensor"]) == 12  # K and V of 6 layers
    assert all(row["bit_exact"] for row in report["per_tensor"].values())
    assert report["triton"]["blocks"] == 12
    assert report["triton"]["bytes_equal_reference"] is True
    assert report["triton"]["bit_exact"] is True
    tables = report["device_tables_equal_host"]  # every real block's device table == huffman.py
    assert tables["blocks"] == 12 * 16 and tables["lengths"] is True and tables["codes"] is True


@pytest.mark.parametrize("kind", ["K", "V"])
def test_saving_on_real_kv_per_kind(report: dict[str, Any], kind: str) -> None:
    row = report["per_kind"][kind]
    assert MIN_SAVING <= row["saving"] < row["ideal_saving"] < 0.5
    assert len(row["per_layer_saving"]) == 6
    assert all(s >= MIN_SAVING for s in row["per_layer_saving"])
    assert 2.0 < row["exponent_entropy_bits"] < 3.5  # the measured range is 2.6-2.9 bits
    assert row["encoded_bytes"] < row["raw_bytes"] == 6 * 256 * 384 * 2
    assert report["saving"] >= MIN_SAVING


@pytest.mark.parametrize(("case", "modes", "max_code_len"), [
    ("specials", {"coded"}, None),
    ("all_exponents_uniform", {"raw"}, 0),
    ("all_exponents_skewed", {"coded"}, 12),  # the length limit is hit
    ("random_words", {"raw"}, 0),
    ("constant", {"coded"}, 1),
    ("single", {"raw"}, 0),
    ("odd_size", {"coded"}, None),
    ("gaussian", {"coded"}, None),
])
def test_edge_cases_agree_byte_for_byte_and_round_trip(
        report: dict[str, Any], case: str, modes: set[str], max_code_len: int | None) -> None:
    row = report["edge_cases"][case]
    assert row["bytes_equal"] is True  # torch reference and Triton wrote the same bytes
    assert row["round_trip"] == {"torch": True, "triton": True}
    assert set(row["modes"]) == modes
    if max_code_len is not None:
        assert row["max_code_len"] == max_code_len
    if modes == {"raw"}:
        assert row["bytes"] == row["raw_bytes"] + 16 * len(row["modes"])


def test_kernels_compile_for_an_h100_without_one(report: dict[str, Any]) -> None:
    """The interpreter accepts code the compiler rejects: Triton's full pipeline down to a cubin
    for sm_90 must succeed for every kernel (kvgate.engines.kvcodec.aot)."""
    aot = report["triton_compile"]
    assert aot["arch"] == "sm_90"
    assert set(aot["kernels"]) == {"split", "merge", "encode", "decode", "decode_multi",
                                   "lengths"}
    for name, row in aot["kernels"].items():
        assert row["ok"] is True, (name, row.get("error"))
        assert row["ptx_bytes"] > 0 and row["cubin_bytes"] > 0, name


def test_gpu_decode_speed_is_null_without_a_gpu(report: dict[str, Any]) -> None:
    if report["gpu"] is None:
        assert report["gpu_decode_gbps"] is None
        assert report["triton"]["mode"].startswith("interpreter")
    else:
        assert report["gpu_decode_gbps"] > 0
