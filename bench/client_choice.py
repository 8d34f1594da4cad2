"""Choose the gateway's upstream HTTP client by measurement: aiohttp vs. httpx.

The same pass-through proxy (:mod:`bench.passthrough`: uvicorn + uvloop + httptools, raw ASGI)
runs with each client in turn on the system-under-test core, in front of the same fake engine,
under the same load as :mod:`bench.overhead` (open loop at ``--rate`` for p50/p99, closed loop
for max req/s on one core). ``direct`` is the floor. Prints medians and httpx / aiohttp ratios;
writes ``bench/results/client-choice-<timestamp>.json``.

Run: ``.venv/bin/python -m bench.client_choice`` (``--quick`` for a smoke test).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench import harness, venvs
from bench.harness import Cell, Medians, RunConfig, fmt, ratio
from bench.overhead import RESULTS_DIR, SMALL_BODY, ProgressLine
from bench.systems import DIRECT, PASS_AIOHTTP, PASS_HTTPX, catalogue

SYSTEMS = (DIRECT, PASS_AIOHTTP, PASS_HTTPX)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line flags."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.client_choice", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--rate", type=float, default=1000.0)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--large-bytes", type=int, default=0,
                        help="also measure bodies of this size (0: only ~1 KiB)")
    parser.add_argument("--closed-tool", choices=["auto", "wrk", "aiohttp"], default="auto")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args(argv)


def verdict(med: Medians, cells: Sequence[Cell]) -> list[str]:
    """One line per cell: httpx / aiohttp on the headline metric."""
    lines = []
    for cell in cells:
        key = "rps" if cell.mode == "closed" else "p50_ms"
        got = ratio(harness.get(med, PASS_HTTPX, cell.label, key),
                    harness.get(med, PASS_AIOHTTP, cell.label, key))
        better = "aiohttp" if got is not None and (got < 1 if key == "rps" else got > 1) \
            else "httpx"
        lines.append(f"- {cell.label}: httpx / aiohttp {key} = {fmt(got)} -> {better} better")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point."""
    args = parse_args(argv)
    duration, warmup, trials = (1.5, 0.5, 1) if args.quick else (
        args.duration, args.warmup, args.trials)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out: Path = args.out or RESULTS_DIR / f"client-choice-{stamp}.json"
    cfg = RunConfig(
        rate=args.rate, concurrency=args.concurrency, duration_s=duration, warmup_s=warmup,
        trials=max(1, trials), venv_root=venvs.DEFAULT_ROOT,
        log_dir=out.parent / f"{out.stem}-logs",
        closed_tool=venvs.closed_loop_tool(args.closed_tool, may_install=not args.quick),
    )
    sizes = [SMALL_BODY, args.large_bytes] if args.large_bytes else [SMALL_BODY]
    cells = harness.make_cells(sizes, [False, True])
    known = catalogue()
    systems = [known[name] for name in SYSTEMS]
    progress = ProgressLine(cfg.trials * len(systems) * len(cells))
    measurements, failed = harness.run_matrix(systems, cells, cfg, progress)
    med = harness.medians(measurements)
    doc = {
        "benchmark": "client-choice",
        "command": shlex.join([sys.executable, "-m", "bench.client_choice", *sys.argv[1:]]),
        "machine": harness.machine_info(),
        "config": {"rate": cfg.rate, "concurrency": cfg.concurrency, "duration_s": duration,
                   "warmup_s": warmup, "trials": cfg.trials,
                   "closed_loop_tool": cfg.closed_tool},
        "failed_to_start": failed,
        "medians": med,
        "measurements": [harness.measurement_json(m) for m in measurements],
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    measured = [s for s in SYSTEMS if s in med]
    print(f"\n## Medians of {cfg.trials} trial(s)\n")
    print(harness.results_table(med, measured, cells, PASS_HTTPX, [PASS_AIOHTTP, DIRECT]))
    print("\n## Added over direct\n")
    print(harness.added_latency_table(med, measured, cells))
    print("\n## Verdict\n")
    print("\n".join(verdict(med, cells)))
    print(f"\nJSON: {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
