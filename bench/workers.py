"""``kvgate serve --workers 2`` against ``--workers 1``: requests per second on this host.

One instant fake engine (``bench.upstream``), then for each trial and each setting a fresh
``kvgate serve --engine URL --workers N`` (the quick start, from its own temporary working
directory), and the closed-loop load generator (``bench.loadgen``, ``--concurrency``
connections, 1 KiB chat bodies, non-streaming) for ``--duration`` seconds after a warm-up.
Nothing is pinned: the workers need every core; the upstream and the load generator share them,
so on a 2-core host the ratio is a lower bound of what a dedicated gateway host gets.
Settings alternate order between trials; the medians and their ratio to ``--workers 1`` are
printed and written to ``bench/results/workers-<timestamp>.json``.

    flock /tmp/kvgate-heavy.lock .venv/bin/python -m bench.workers --trials 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import procs
from bench.replicas import redis_running

MODEL = "bench-model"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default="1,2", help="settings to compare (1,2)")
    p.add_argument("--redis", action="store_true",
                   help="also run the largest setting with --redis (a local redis-server)")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--duration", type=float, default=8.0, help="measured seconds per run")
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--body-bytes", type=int, default=1024)
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    return p.parse_args(argv)


def load(base: str, args: argparse.Namespace) -> dict[str, Any]:
    """One closed-loop run of the load generator; its JSON summary."""
    argv = [sys.executable, "-m", "bench.loadgen", "--url", base, "--mode", "closed",
            "--concurrency", str(args.concurrency), "--duration", str(args.duration),
            "--warmup", str(args.warmup), "--body-bytes", str(args.body_bytes),
            "--model", MODEL]
    done = subprocess.run(argv, capture_output=True, text=True, check=False,
                          timeout=args.duration + args.warmup + 60)
    if done.returncode != 0:
        raise RuntimeError(f"loadgen failed: {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def measure(upstream: str, workers: int, redis: str | None, args: argparse.Namespace,
            logs: Path) -> dict[str, Any]:
    """Start the gateway with ``workers``, load it, stop it."""
    port = procs.free_port()
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="kvgate-workers-") as cwd:
        argv = ["env", "-C", cwd, str(Path(sys.executable).parent / "kvgate"), "serve",
                "--engine", upstream, "--port", str(port), "--workers", str(workers)]
        argv += ["--redis", redis] if redis else []
        log = logs / f"kvgate-w{workers}{'-redis' if redis else ''}.log"
        with procs.running(argv, "0-1", log) as proc:
            procs.wait_healthy(base + "/v1/models", proc, 120.0, log, MODEL.encode())
            time.sleep(1.0)  # every worker up (uvicorn starts them one after another)
            return load(base, args)


def settings(args: argparse.Namespace) -> list[tuple[int, bool]]:
    counts = [int(w) for w in args.workers.split(",")]
    return [(w, False) for w in counts] + ([(max(counts), True)] if args.redis else [])


def label(workers: int, redis: bool) -> str:
    return f"workers={workers}" + (" redis" if redis else "")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    logs = args.out / "logs" / f"workers-{stamp}"
    logs.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {label(w, r): [] for w, r in settings(args)}
    up_port = procs.free_port()
    upstream = f"http://127.0.0.1:{up_port}"
    up_argv = [sys.executable, "-m", "bench.upstream", "--port", str(up_port), "--model", MODEL]
    with procs.running(up_argv, "0-1", logs / "upstream.log") as up, \
            redis_running(logs) as redis:
        procs.wait_healthy(upstream + "/v1/models", up, 30.0, logs / "upstream.log")
        for trial in range(args.trials):
            order = settings(args) if trial % 2 == 0 else settings(args)[::-1]
            for workers, shared in order:
                result = measure(upstream, workers, redis if shared else None, args, logs)
                runs[label(workers, shared)].append(result)
                print(f"trial {trial}: {label(workers, shared)}: {result['rps']:.0f} req/s, "
                      f"p50 {result['latency_ms']['p50']:.1f} ms", file=sys.stderr, flush=True)
    medians = {k: statistics.median(r["rps"] for r in v) for k, v in runs.items()}
    base = medians[label(min(int(w) for w in args.workers.split(",")), False)]
    doc = {
        "benchmark": "workers",
        "command": shlex.join([sys.executable, "-m", "bench.workers", *(argv or sys.argv[1:])]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "median_rps": medians, "ratio_to_first": {k: v / base for k, v in medians.items()},
        "runs": runs,
    }
    out = args.out / f"workers-{stamp}.json"
    out.write_text(json.dumps(doc, indent=1))
    for k, v in medians.items():
        print(f"{k}: median {v:.0f} req/s, x{v / base:.2f}")
    print(f"wrote {out}")
    return doc


if __name__ == "__main__":
    main()
