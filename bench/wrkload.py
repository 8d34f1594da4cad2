"""Closed-loop load with wrk (C, epoll), printing the same JSON summary as :mod:`bench.loadgen`.

Why wrk for the closed loop: the load generator shares its core with the fake upstream, and the
aiohttp client tops out near 11-13k req/s there, below what the Rust routers sustain on one core
(about 16k req/s at ~60 µs of CPU each). wrk with one thread drives the same upstream at ~65k
req/s from that core, so closed-loop req/s measures the system under test, not the client.
Open-loop latency and time to first byte stay with :mod:`bench.loadgen` (wrk has neither a fixed
rate nor a first-byte clock).

wrk runs twice: ``--warmup`` seconds (discarded), then ``--duration`` seconds (measured).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.loadgen import CHAT_PATH, LoadResult, Percentiles, make_body

DONE_HOOK = r"""
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '\n{"requests": %d, "duration_us": %d, "errors": %d, "p50_us": %d, "p90_us": %d, '
    .. '"p99_us": %d, "max_us": %d, "mean_us": %f}\n',
    summary.requests, summary.duration, e.connect + e.read + e.write + e.status + e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max,
    latency.mean))
end
"""


def lua_script(body_path: Path) -> str:
    """A wrk script that POSTs the JSON body read from ``body_path`` and reports JSON."""
    return (
        'wrk.method = "POST"\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
        f'local f = assert(io.open("{body_path}", "rb"))\n'
        "wrk.body = f:read(\"*a\")\n"
        "f:close()\n" + DONE_HOOK
    )


def wrk_argv(url: str, script: Path, connections: int, seconds: float) -> list[str]:
    """One wrk thread, ``connections`` keep-alive connections."""
    return [
        "wrk", "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--timeout", "30s",
        "-s", str(script), url,
    ]


def run_wrk(argv: Sequence[str], seconds: float) -> dict[str, Any]:
    """Run wrk; return the JSON line its ``done`` hook printed."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"wrk failed ({done.returncode}): {done.stdout[-500:]}{done.stderr}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def to_result(measured: dict[str, Any], warm: dict[str, Any] | None) -> LoadResult:
    """wrk's numbers as a :class:`LoadResult`."""
    seconds = measured["duration_us"] / 1e6
    sent = int(measured["requests"]) + (int(warm["requests"]) if warm else 0)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return LoadResult(
        mode="closed",
        tool="wrk",
        sent=sent,
        requests=int(measured["requests"]),
        errors=int(measured["errors"]),
        rps=measured["requests"] / seconds if seconds > 0 else 0.0,
        latency_ms=Percentiles(
            p50=measured["p50_us"] / 1e3, p90=measured["p90_us"] / 1e3,
            p99=measured["p99_us"] / 1e3, max=measured["max_us"] / 1e3,
            mean=measured["mean_us"] / 1e3,
        ),
        ttfb_ms=None,
        client_cpu_s=children.ru_utime + children.ru_stime,
        window_s=seconds,
    )


def available() -> bool:
    """True when a ``wrk`` binary is on PATH."""
    return shutil.which("wrk") is not None


def run(url: str, body: bytes, connections: int, duration_s: float, warmup_s: float) -> LoadResult:
    """Warm up, then measure."""
    with tempfile.TemporaryDirectory(prefix="kvgate-wrk-") as tmp:
        body_path = Path(tmp) / "body.json"
        body_path.write_bytes(body)
        script = Path(tmp) / "post.lua"
        script.write_text(lua_script(body_path))
        warm = None
        if warmup_s > 0:
            warm = run_wrk(wrk_argv(url, script, connections, warmup_s), warmup_s)
        measured = run_wrk(wrk_argv(url, script, connections, duration_s), duration_s)
    return to_result(measured, warm)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point (same flags as :mod:`bench.loadgen`; ``--mode`` must be closed)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--mode", choices=["closed"], default="closed")
    parser.add_argument("--rate", type=float, default=0.0, help="ignored (closed loop)")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--body-bytes", type=int, default=1024)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--model", default="bench-model")
    args = parser.parse_args(argv)
    body = make_body(args.body_bytes, args.stream, args.model)
    url = args.url.rstrip("/") + CHAT_PATH
    result = run(url, body, args.concurrency, args.duration, args.warmup)
    json.dump(asdict(result), sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
