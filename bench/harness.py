"""The measuring loop shared by the overhead and client-choice benchmarks.

One run: start the fake upstream (load-generator core), then for each trial and each system
(order rotated per trial, so slow drift of the machine does not favour one system), start the
system on its own core and run every cell through a fresh load-generator process. Each cell
records the load generator's summary plus the system's CPU time per request (read from /proc),
which estimates req/s per core independently of the load generator's own ceiling.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import procs
from bench.loadgen import Mode
from bench.systems import DIRECT, Endpoint, System, launched

SUT_CPU = 0
LOAD_CPU = 1
KIB = 1024
NOISE_SHARE = 0.10  # other work on the SUT core above this share is flagged in progress lines


@dataclass(frozen=True)
class Cell:
    """One load shape: streaming or not, body size, open or closed loop."""

    stream: bool
    body_bytes: int
    mode: Mode

    @property
    def label(self) -> str:
        """Short human name, e.g. ``json 1KiB open``."""
        kind = "sse" if self.stream else "json"
        size = f"{self.body_bytes // KIB}KiB" if self.body_bytes >= KIB else f"{self.body_bytes}B"
        return f"{kind} {size} {self.mode}"


@dataclass(frozen=True)
class RunConfig:
    """Load parameters shared by every cell of a run."""

    rate: float
    concurrency: int
    duration_s: float
    warmup_s: float
    trials: int
    venv_root: Path
    log_dir: Path
    stream_chunks: int = 10
    chunk_interval_ms: float = 0.0
    closed_tool: str = "aiohttp"  # or "wrk" (see bench.wrkload)


@dataclass
class Measurement:
    """One cell of one trial of one system."""

    system: str
    trial: int
    cell: Cell
    metrics: dict[str, float]
    raw: dict[str, Any] = field(default_factory=dict)


Progress = Callable[[str], None]
Medians = dict[str, dict[str, dict[str, float]]]


def make_cells(body_sizes: Sequence[int], streams: Sequence[bool]) -> list[Cell]:
    """Every combination, open loop before closed loop."""
    return [
        Cell(stream, size, mode)
        for stream in streams
        for size in body_sizes
        for mode in ("open", "closed")
    ]


def loadgen_argv(base_url: str, cell: Cell, cfg: RunConfig) -> list[str]:
    """Command line of one load-generator run."""
    module = "bench.wrkload" if cell.mode == "closed" and cfg.closed_tool == "wrk" \
        else "bench.loadgen"
    argv = [
        sys.executable, "-m", module, "--url", base_url, "--mode", cell.mode,
        "--rate", str(cfg.rate), "--concurrency", str(cfg.concurrency),
        "--duration", str(cfg.duration_s), "--warmup", str(cfg.warmup_s),
        "--body-bytes", str(cell.body_bytes),
    ]
    return [*argv, "--stream"] if cell.stream else argv


def run_loadgen(base_url: str, cell: Cell, cfg: RunConfig) -> dict[str, Any]:
    """Run the load generator pinned to the load core; return its JSON summary."""
    argv = ["taskset", "-c", str(LOAD_CPU), *loadgen_argv(base_url, cell, cfg)]
    limit = cfg.warmup_s + cfg.duration_s + 60.0
    done = subprocess.run(argv, capture_output=True, text=True, timeout=limit, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"loadgen failed ({done.returncode}): {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def flatten(result: Mapping[str, Any], sut_cpu_s: float | None) -> dict[str, float]:
    """The numbers compared across systems, from one load-generator summary."""
    latency = result["latency_ms"]
    metrics = {
        "p50_ms": float(latency["p50"]),
        "p99_ms": float(latency["p99"]),
        "rps": float(result["rps"]),
        "errors": float(result["errors"]),
        "requests": float(result["requests"]),
    }
    ttfb = result.get("ttfb_ms")
    if ttfb:
        metrics["ttfb_p50_ms"] = float(ttfb["p50"])
        metrics["ttfb_p99_ms"] = float(ttfb["p99"])
    sent = float(result.get("sent", 0))
    if sut_cpu_s is not None and sent > 0:
        metrics["cpu_us_per_req"] = sut_cpu_s / sent * 1e6
    return metrics


def measure_cell(
    endpoint: Endpoint, cell: Cell, cfg: RunConfig
) -> tuple[dict[str, float], dict[str, Any]]:
    """One load-generator run against ``endpoint``, with the system's CPU time counted."""
    cores0 = procs.core_times()
    wall0 = time.monotonic()
    cpu0 = procs.tree_cpu_seconds(endpoint.pid) if endpoint.pid else 0.0
    result = run_loadgen(endpoint.base_url, cell, cfg)
    cpu_s = procs.tree_cpu_seconds(endpoint.pid) - cpu0 if endpoint.pid else None
    wall = time.monotonic() - wall0
    cores1 = procs.core_times()
    metrics = flatten(result, cpu_s)
    for core in (SUT_CPU, LOAD_CPU):
        share = procs.busy_share(cores0, cores1, core)
        if share is not None:
            metrics[f"core{core}_busy"] = share
    if cpu_s is not None and wall > 0:
        metrics["sut_busy"] = cpu_s / wall
    return metrics, result


def _noise_note(metrics: Mapping[str, float]) -> str:
    """Flag a cell where something other than the system under test kept its core busy."""
    other = metrics.get(f"core{SUT_CPU}_busy", 0.0) - metrics.get("sut_busy", 0.0)
    return f" [core {SUT_CPU}: {other:.0%} busy with other work]" if other > NOISE_SHARE else ""


def _describe(metrics: Mapping[str, float], cell: Cell) -> str:
    return _describe_load(metrics, cell) + _noise_note(metrics)


def _describe_load(metrics: Mapping[str, float], cell: Cell) -> str:
    if cell.mode == "closed":
        cpu = metrics.get("cpu_us_per_req")
        cpu_text = f", {cpu:.0f} µs CPU/req" if cpu is not None else ""
        return f"{metrics['rps']:.0f} req/s{cpu_text}"
    text = f"p50 {metrics['p50_ms']:.2f} ms, p99 {metrics['p99_ms']:.2f} ms"
    if "ttfb_p50_ms" in metrics:
        text += f", ttfb p50 {metrics['ttfb_p50_ms']:.2f} ms"
    errors = int(metrics["errors"])
    return text + (f", {errors} errors" if errors else "")


def rotated(items: Sequence[System], trial: int) -> list[System]:
    """``items`` rotated left by ``trial`` places."""
    if not items:
        return []
    shift = trial % len(items)
    return [*items[shift:], *items[:shift]]


def measure_system(
    system: System, upstream: str, cells: Sequence[Cell], cfg: RunConfig, trial: int,
    progress: Progress,
) -> list[Measurement]:
    """Start ``system`` once and run every cell through it."""
    log_path = cfg.log_dir / f"{system.name}-trial{trial}.log"
    out: list[Measurement] = []
    with launched(system, upstream, SUT_CPU, log_path, cfg.venv_root) as endpoint:
        for cell in cells:
            metrics, raw = measure_cell(endpoint, cell, cfg)
            out.append(Measurement(system.name, trial, cell, metrics, raw))
            progress(f"trial {trial + 1} {system.name:>20} {cell.label:<18} "
                     f"{_describe(metrics, cell)}")
    return out


def upstream_argv(port: int, cfg: RunConfig) -> list[str]:
    """Command line of the fake engine."""
    return [
        sys.executable, "-m", "bench.upstream", "--host", "127.0.0.1", "--port", str(port),
        "--stream-chunks", str(cfg.stream_chunks),
        "--chunk-interval-ms", str(cfg.chunk_interval_ms),
    ]


@contextlib.contextmanager
def upstream_running(cfg: RunConfig) -> Iterator[str]:
    """Start the fake engine on the load core; yield its base URL."""
    port = procs.free_port()
    upstream = f"http://127.0.0.1:{port}"
    log_path = cfg.log_dir / "upstream.log"
    with procs.running(upstream_argv(port, cfg), LOAD_CPU, log_path) as proc:
        procs.wait_healthy(upstream + "/health", proc, 30.0, log_path)
        yield upstream


def run_matrix(
    systems: Sequence[System], cells: Sequence[Cell], cfg: RunConfig, progress: Progress,
) -> tuple[list[Measurement], dict[str, str]]:
    """Every trial, system and cell. Returns measurements and systems that failed to start."""
    procs.pin_self(LOAD_CPU)
    failed: dict[str, str] = {}
    measurements: list[Measurement] = []
    with upstream_running(cfg) as upstream:
        for trial in range(cfg.trials):
            for system in rotated([s for s in systems if s.name not in failed], trial):
                try:
                    measurements += measure_system(
                        system, upstream, cells, cfg, trial, progress
                    )
                except procs.StartError as exc:
                    failed[system.name] = str(exc)
                    progress(f"trial {trial + 1} {system.name}: did not start: {exc}")
    return measurements, failed


def medians(measurements: Sequence[Measurement]) -> Medians:
    """system -> cell label -> metric -> median over trials."""
    grouped: dict[str, dict[str, dict[str, list[float]]]] = {}
    for m in measurements:
        cell = grouped.setdefault(m.system, {}).setdefault(m.cell.label, {})
        for key, value in m.metrics.items():
            cell.setdefault(key, []).append(value)
    return {
        system: {
            label: {key: statistics.median(values) for key, values in metrics.items()}
            for label, metrics in cells.items()
        }
        for system, cells in grouped.items()
    }


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is zero."""
    if a is None or b is None or b == 0 or math.isnan(a) or math.isnan(b):
        return None
    return a / b


def git_commit() -> str:
    """The checkout's commit, ``+dirty`` with uncommitted changes to tracked files: the tree a
    bench's gateways start from (not edits made while it runs; a ``PYTHONPATH`` pointing
    elsewhere is not seen)."""
    here = Path(__file__).resolve().parent
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=False, cwd=here)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, check=False, cwd=here).stdout.strip()
    return done.stdout.strip() + ("+dirty" if dirty else "")


def machine_info() -> dict[str, Any]:
    """Where the numbers came from (and on which tree)."""
    model = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_model": model,
        "cpus": os.cpu_count(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "tree": git_commit(),
    }


def measurement_json(m: Measurement) -> dict[str, Any]:
    """One measurement as plain JSON."""
    return {
        "system": m.system, "trial": m.trial, "cell": m.cell.label, "stream": m.cell.stream,
        "body_bytes": m.cell.body_bytes, "mode": m.cell.mode, "metrics": m.metrics,
        "loadgen": m.raw,
    }


def fmt(value: float | None, digits: int = 2) -> str:
    """A table number, or a dash when missing."""
    if value is None or math.isnan(value):
        return "-"
    return f"{value:,.{digits}f}"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub-flavoured markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def metric_rows(cell: Cell) -> list[tuple[str, str, int]]:
    """(metric key, label, digits) shown for a cell."""
    if cell.mode == "closed":
        return [("rps", "max req/s", 0), ("cpu_us_per_req", "CPU µs/req", 0)]
    rows = [("p50_ms", "p50 ms", 2), ("p99_ms", "p99 ms", 2)]
    if cell.stream:
        rows += [("ttfb_p50_ms", "TTFB p50 ms", 2), ("ttfb_p99_ms", "TTFB p99 ms", 2)]
    return rows


def get(med: Medians, system: str, label: str, key: str) -> float | None:
    """One median, or None when that system/cell/metric was not measured."""
    return med.get(system, {}).get(label, {}).get(key)


def results_table(
    med: Medians, systems: Sequence[str], cells: Sequence[Cell], subject: str | None,
    baselines: Sequence[str],
) -> str:
    """Medians per system, then ``subject``'s ratio to each baseline."""
    others = [b for b in baselines if b != subject] if subject else []
    header = ["cell", "metric", *systems, *(f"{subject} / {o}" for o in others)]
    rows: list[list[str]] = []
    for cell in cells:
        for key, name, digits in metric_rows(cell):
            row = [cell.label, name]
            row += [fmt(get(med, s, cell.label, key), digits) for s in systems]
            if subject:
                mine = get(med, subject, cell.label, key)
                row += [fmt(ratio(mine, get(med, o, cell.label, key))) for o in others]
            rows.append(row)
    return markdown_table(header, rows)


def added_latency_table(med: Medians, systems: Sequence[str], cells: Sequence[Cell]) -> str:
    """Latency each proxy adds over calling the upstream directly (ms), open-loop cells."""
    proxies = [s for s in systems if s != DIRECT]
    rows: list[list[str]] = []
    for cell in (c for c in cells if c.mode == "open"):
        keys = ["p50_ms", "p99_ms"] + (["ttfb_p50_ms"] if cell.stream else [])
        for key in keys:
            base = get(med, DIRECT, cell.label, key)
            row = [cell.label, "+" + key.removesuffix("_ms").replace("_", " ") + " ms"]
            for s in proxies:
                value = get(med, s, cell.label, key)
                row.append(fmt(None if value is None or base is None else value - base))
            rows.append(row)
    return markdown_table(["cell", "added", *proxies], rows)
