"""The codec's device tables, device packing and multi-symbol decoder against the host oracle
(``huffman.py`` + ``container``), in the engine venv (torch; the Triton kernels through
``TRITON_INTERPRET=1``), each check a seeded run of
``python -m kvgate.engines.kvcodec.measure.devicechecks NAME`` (see that module for what each
compares); and every kernel compiled ahead of time for sm_90 (no GPU needed). Skipped when the
engine venv has not been built (``kvgate codec setup``)."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest

from kvgate.engines.kvcodec.venv import MARKER, MODEL_REQUIREMENT, engine_env, engine_side_path
from kvgate.engines.local.paths import engine_venv
from kvgate.engines.local.venv import venv_ready


def _codec_env_ready() -> bool:
    marker = engine_venv() / MARKER
    return venv_ready() and marker.is_file() and marker.read_text().strip() == MODEL_REQUIREMENT


pytestmark = pytest.mark.skipif(not _codec_env_ready(), reason="engine venv with the codec's "
                                "model not built (kvgate codec setup)")


def _engine_python(args: list[str], interpret: bool) -> dict[str, Any]:
    python = engine_venv() / "bin" / "python"
    with engine_side_path() as path:
        env = engine_env(path)
        env.pop("TRITON_INTERPRET", None)
        if interpret:
            env["TRITON_INTERPRET"] = "1"
        done = subprocess.run([str(python), "-m", *args], env=env, capture_output=True,
                              text=True, timeout=300, check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


@pytest.mark.parametrize("check", ["tables", "kernel_tables", "kernel_limit", "oracle_bytes",
                                   "multi_luts", "triton_roundtrip", "kvc1", "launches"])
def test_device_check(check: str) -> None:
    report = _engine_python(["kvgate.engines.kvcodec.measure.devicechecks", check],
                            interpret=True)
    assert report["ok"] is True, report


def test_every_kernel_compiles_for_sm90_without_a_gpu() -> None:
    """The interpreter accepts code the compiler rejects: Triton's whole pipeline to a cubin
    (kvgate.engines.kvcodec.aot), never interpreted."""
    report = _engine_python(["kvgate.engines.kvcodec.aot"], interpret=False)
    assert report["arch"] == "sm_90"
    assert set(report["kernels"]) == {"split", "merge", "encode", "decode", "decode_multi",
                                      "lengths"}
    for name, row in report["kernels"].items():
        assert row["ok"] is True, (name, row)
        assert row["cubin_bytes"] > 0
