"""Sample a system under closed-loop load with py-spy and rank its hot spots.

py-spy (in its own venv, see :mod:`bench.venvs`) records collapsed stacks from the running
process without pausing it (``--nonblocking``); we aggregate them by function into self time
(the frame on top of the stack) and inclusive time (any frame on the stack).

Run via ``python -m bench.overhead --systems kvgate --profile 10``.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import harness, venvs
from bench.harness import Cell, RunConfig, markdown_table
from bench.systems import System, launched

SAMPLE_RATE_HZ = 250
TOP_N = 25
_LINE_NO = re.compile(r":\d+\)$")


def _frame_key(frame: str) -> str:
    """``func (path/file.py:123)`` -> ``func (path/file.py)`` so lines of one function merge."""
    return _LINE_NO.sub(")", frame.strip())


def parse_collapsed(text: str) -> tuple[Counter[str], Counter[str], int]:
    """Self and inclusive sample counts per function, and the total, from collapsed stacks."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in text.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [_frame_key(f) for f in stack.split(";") if f.strip()]
        if not frames:
            continue
        total += count
        own[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
    return own, inclusive, total


def _ranked(primary: Counter[str], other: Counter[str], total: int) -> list[dict[str, Any]]:
    """Top functions of ``primary`` with their share in both counters."""
    return [
        {"function": name, "samples": n, "share": n / total if total else 0.0,
         "other_share": other[name] / total if total else 0.0}
        for name, n in primary.most_common(TOP_N)
    ]


def summarise(text: str) -> dict[str, Any]:
    """Top functions by self samples and by inclusive samples (``other_share`` is the other)."""
    own, inclusive, total = parse_collapsed(text)
    return {"total_samples": total, "top_self": _ranked(own, inclusive, total),
            "top_inclusive": _ranked(inclusive, own, total)}


def py_spy_argv(pid: int, seconds: float, out: Path, root: Path) -> list[str]:
    """``py-spy record`` for ``pid`` writing collapsed stacks to ``out``."""
    program = venvs.bin_path(venvs.PY_SPY, "py-spy", root)
    return [
        str(program), "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))),
        "--rate", str(SAMPLE_RATE_HZ), "--format", "raw", "--nonblocking", "--output", str(out),
    ]


def _record_under_load(endpoint_url: str, pid: int, cfg: RunConfig, seconds: float,
                       out: Path, body_bytes: int) -> None:
    load_cfg = RunConfig(
        rate=cfg.rate, concurrency=cfg.concurrency, duration_s=seconds + 3.0, warmup_s=1.0,
        trials=1, venv_root=cfg.venv_root, log_dir=cfg.log_dir,
    )
    cell = Cell(stream=False, body_bytes=body_bytes, mode="closed")
    argv = ["taskset", "-c", str(harness.LOAD_CPU),
            *harness.loadgen_argv(endpoint_url, cell, load_cfg)]
    load = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(1.5)
        spy = ["taskset", "-c", str(harness.LOAD_CPU),
               *py_spy_argv(pid, seconds, out, cfg.venv_root)]
        subprocess.run(spy, check=True, capture_output=True, timeout=seconds + 60)
    finally:
        load.wait(timeout=seconds + 60)


def profile_system(system: System, cfg: RunConfig, seconds: float,
                   body_bytes: int = 1024) -> dict[str, Any]:
    """Start ``system`` afresh, load it closed-loop with ``body_bytes`` chat bodies, py-spy it;
    summary + path of the stacks."""
    venvs.ensure(venvs.PY_SPY, cfg.venv_root)
    out = cfg.log_dir / f"{system.name}-{body_bytes}B-py-spy.collapsed"
    log_path = cfg.log_dir / f"{system.name}-profiled.log"
    print(f"[profile] py-spy on {system.name} for {seconds:g} s ...", file=sys.stderr)
    with harness.upstream_running(cfg) as upstream, \
            launched(system, upstream, harness.SUT_CPU, log_path, cfg.venv_root) as endpoint:
        if endpoint.pid is None:
            return {"error": "nothing to profile"}
        _record_under_load(endpoint.base_url, endpoint.pid, cfg, seconds, out, body_bytes)
    return {"body_bytes": body_bytes, "collapsed_stacks": str(out),
            **summarise(out.read_text())}


def top_table(summary: dict[str, Any], rows: int = 15) -> str:
    """Self-time hot spots as markdown."""
    top: Sequence[dict[str, Any]] = summary.get("top_self", [])[:rows]
    body = [
        [f"{e['share'] * 100:.1f} %", f"{e['other_share'] * 100:.1f} %", f"`{e['function']}`"]
        for e in top
    ]
    return markdown_table(["self", "inclusive", "function"], body)
