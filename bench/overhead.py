"""Gateway overhead benchmark: kvgate vs. calling the upstream directly vs. the Rust routers.

Every system sits in front of the same instant fake engine (``bench.upstream``). The system under
test runs alone on core 0; the upstream and the load generator share core 1. For each system it
measures, for ~1 KiB and ~200 KiB chat bodies, non-streaming and streaming:

* open loop at ``--rate`` req/s: latency p50/p99 (and time to first byte for streams);
* closed loop with ``--concurrency`` connections: max req/s, and the system's CPU time per
  request (so req/s per core = 1e6 / µs per request even where the load core is the limit).

Medians of ``--trials`` trials; all systems measured in the same run and compared as ratios.
Writes ``bench/results/overhead-<timestamp>.json`` and prints markdown tables.

Run: ``.venv/bin/python -m bench.overhead`` (``--quick --systems direct`` for a smoke test;
``--setup`` only creates the peer routers' venvs).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench import harness, profile, venvs
from bench.harness import Cell, Measurement, Medians, RunConfig, fmt, ratio
from bench.systems import (
    DIRECT,
    KVGATE,
    KVGATE_BASE,
    KVGATE_UVICORN,
    SGLANG_ROUTER,
    VLLM_ROUTER,
    VLLM_ROUTER_CA,
    System,
    catalogue,
)

DEFAULT_SYSTEMS = (DIRECT, KVGATE, VLLM_ROUTER, SGLANG_ROUTER)
RESULTS_DIR = Path("bench/results")
SMALL_BODY = 1024
LARGE_BODY = 200 * 1024
TARGET_ADDED_P50_MS = 1.0
TARGET_ADDED_P99_MS = 5.0
TARGET_RPS_SHARE = 0.5
#: Issue 12 item 5 (agent-sized bodies, cache-aware default): kvgate's req/s per core as a share
#: of vllm-router's, per body size, closed loop, non-streaming.
TARGET_PER_CORE_SHARE = {SMALL_BODY: 0.3, LARGE_BODY: 0.5}
#: An open-loop cell counts as not saturated when it completes at least this share of the
#: offered rate without errors.
UNSATURATED_SHARE = 0.95


@dataclass(frozen=True)
class Options:
    """Parsed command line."""

    systems: tuple[str, ...]
    cfg: RunConfig
    cells: tuple[Cell, ...]
    out: Path
    setup_only: bool
    profile_s: float
    profile_bytes: int
    closed_tool: str
    quick: bool


class ProgressLine:
    """Prints ``[i/N] message`` lines to stderr."""

    def __init__(self, total: int) -> None:
        self._total = total
        self._done = 0
        self._t0 = time.monotonic()

    def __call__(self, message: str) -> None:
        self._done += 1
        elapsed = time.monotonic() - self._t0
        print(f"[{self._done}/{self._total} {elapsed:5.0f}s] {message}", file=sys.stderr,
              flush=True)


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.overhead", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--rate", type=float, default=1000.0, help="open loop req/s")
    parser.add_argument("--duration", type=float, default=5.0, help="measured s per cell")
    parser.add_argument("--warmup", type=float, default=1.0, help="uncounted s before each cell")
    parser.add_argument("--concurrency", type=int, default=64, help="closed-loop connections")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                        help=f"comma-separated, from: {', '.join(catalogue())}")
    parser.add_argument("--large-bytes", type=int, default=LARGE_BODY, help="large body size")
    parser.add_argument("--no-large", action="store_true", help="skip the large-body cells")
    parser.add_argument("--no-stream", action="store_true", help="skip the streaming cells")
    parser.add_argument("--stream-chunks", type=int, default=10, help="SSE chunks per stream")
    parser.add_argument("--chunk-interval-ms", type=float, default=0.0,
                        help="upstream pause between SSE events (0 = one write)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: 1 trial, 1.5 s + 0.5 s warm-up per cell")
    parser.add_argument("--profile", type=float, default=0.0, metavar="SECONDS",
                        help="py-spy the kvgate process for SECONDS under closed-loop load")
    parser.add_argument("--profile-bytes", type=int, default=SMALL_BODY, metavar="BYTES",
                        help="chat body size of the profiled load (default 1 KiB)")
    parser.add_argument("--venv-root", type=Path, default=venvs.DEFAULT_ROOT)
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: timestamped)")
    parser.add_argument("--closed-tool", choices=["auto", "wrk", "aiohttp"], default="auto",
                        help="closed-loop driver; auto = wrk (installed with apt-get unless "
                             "--quick) else the aiohttp client")
    parser.add_argument("--setup", action="store_true",
                        help="only create the peer routers' (and py-spy's) venvs, then exit")
    return parser


def parse_options(argv: Sequence[str] | None = None) -> Options:
    """Command line to :class:`Options`."""
    parser = build_parser()
    args = parser.parse_args(argv)
    known = catalogue()
    systems = tuple(s.strip() for s in args.systems.split(",") if s.strip())
    unknown = [s for s in systems if s not in known]
    if unknown:
        parser.error(f"unknown system(s): {', '.join(unknown)}")
    duration, warmup, trials = args.duration, args.warmup, args.trials
    if args.quick:
        duration, warmup, trials = 1.5, 0.5, 1
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = args.out or RESULTS_DIR / f"overhead-{stamp}.json"
    sizes = [SMALL_BODY] if args.no_large else [SMALL_BODY, args.large_bytes]
    streams = [False] if args.no_stream else [False, True]
    cfg = RunConfig(
        rate=args.rate, concurrency=args.concurrency, duration_s=duration, warmup_s=warmup,
        trials=max(1, trials), venv_root=args.venv_root,
        log_dir=out.parent / f"{out.stem}-logs", stream_chunks=args.stream_chunks,
        chunk_interval_ms=args.chunk_interval_ms,
    )
    return Options(systems, cfg, tuple(harness.make_cells(sizes, streams)), out, args.setup,
                   args.profile, args.profile_bytes, args.closed_tool, args.quick)


def ensure_tools(systems: Sequence[System], root: Path, want_profiler: bool) -> None:
    """Create the private venvs the chosen systems need (idempotent)."""
    tools = [s.tool for s in systems if s.tool is not None]
    if want_profiler:
        tools.append(venvs.PY_SPY)
    venvs.ensure_all(tools, root)


def check_targets(med: Medians) -> dict[str, Any]:
    """kvgate vs. the issue's targets at 1 KiB non-streaming (None where not measurable)."""
    open_label = Cell(False, SMALL_BODY, "open").label
    closed_label = Cell(False, SMALL_BODY, "closed").label
    direct_p50 = harness.get(med, DIRECT, open_label, "p50_ms")
    direct_p99 = harness.get(med, DIRECT, open_label, "p99_ms")
    p50 = harness.get(med, KVGATE, open_label, "p50_ms")
    p99 = harness.get(med, KVGATE, open_label, "p99_ms")
    routers = [harness.get(med, r, closed_label, "rps") for r in (VLLM_ROUTER, SGLANG_ROUTER)]
    best_router = max((r for r in routers if r is not None), default=None)
    rps = harness.get(med, KVGATE, closed_label, "rps")
    router_cpu = [
        harness.get(med, r, closed_label, "cpu_us_per_req") for r in (VLLM_ROUTER, SGLANG_ROUTER)
    ]
    best_cpu = min((c for c in router_cpu if c is not None), default=None)
    cpu = harness.get(med, KVGATE, closed_label, "cpu_us_per_req")
    added_p50 = None if p50 is None or direct_p50 is None else p50 - direct_p50
    added_p99 = None if p99 is None or direct_p99 is None else p99 - direct_p99
    share = ratio(rps, best_router)
    cpu_share = ratio(best_cpu, cpu)
    return {
        "added_p50_ms": added_p50,
        "added_p99_ms": added_p99,
        "rps_share_of_fastest_router": share,
        "per_core_share_of_fastest_router_by_cpu": cpu_share,
        "pass_added_p50": None if added_p50 is None else added_p50 <= TARGET_ADDED_P50_MS,
        "pass_added_p99": None if added_p99 is None else added_p99 <= TARGET_ADDED_P99_MS,
        "pass_rps": None if share is None else share >= TARGET_RPS_SHARE,
    }


def per_core_targets(med: Medians, large_bytes: int, rate: float) -> dict[str, Any]:
    """Issue 12 item 5: kvgate's req/s per core vs vllm-router's at 1 KiB and the large size
    (closed loop, JSON; by req/s and by CPU µs per request), and whether kvgate keeps up with
    the open-loop rate at the large size (None where not measured)."""
    out: dict[str, Any] = {}
    sizes = {SMALL_BODY: TARGET_PER_CORE_SHARE[SMALL_BODY]}
    if large_bytes != SMALL_BODY:  # ``--no-large``: the largest size measured is 1 KiB
        sizes[large_bytes] = TARGET_PER_CORE_SHARE[LARGE_BODY]
    for size, need in sizes.items():
        label = Cell(False, size, "closed").label
        by_rps = ratio(harness.get(med, KVGATE, label, "rps"),
                       harness.get(med, VLLM_ROUTER, label, "rps"))
        by_cpu = ratio(harness.get(med, VLLM_ROUTER, label, "cpu_us_per_req"),
                       harness.get(med, KVGATE, label, "cpu_us_per_req"))
        # context, not the target: vllm-router with its cache-aware default policy
        by_cpu_ca = ratio(harness.get(med, VLLM_ROUTER_CA, label, "cpu_us_per_req"),
                          harness.get(med, KVGATE, label, "cpu_us_per_req"))
        out[label] = {"need": need, "share_by_rps": by_rps, "share_by_cpu": by_cpu,
                      "share_by_cpu_vs_cache_aware": by_cpu_ca,
                      "pass": None if by_rps is None else by_rps >= need}
    open_label = Cell(False, large_bytes, "open").label
    rps = harness.get(med, KVGATE, open_label, "rps")
    errors = harness.get(med, KVGATE, open_label, "errors")
    out[open_label] = {
        "offered_rps": rate, "rps": rps, "errors": errors,
        "p50_ms": harness.get(med, KVGATE, open_label, "p50_ms"),
        "unsaturated": None if rps is None or errors is None
        else rps >= UNSATURATED_SHARE * rate and errors == 0,
    }
    return out


def per_core_text(checks: Mapping[str, Any]) -> str:
    """One line per issue-12 item-5 check."""
    lines = []
    for label, check in checks.items():
        if "need" in check:
            verdict = "n/a" if check["pass"] is None else ("PASS" if check["pass"] else "FAIL")
            lines.append(f"- {label}: req/s per core vs vllm-router {fmt(check['share_by_rps'])} "
                         f"(by CPU µs/req {fmt(check['share_by_cpu'])}), need >= "
                         f"{check['need']:g} -> {verdict}")
            if check.get("share_by_cpu_vs_cache_aware") is not None:
                lines.append(f"  - context: by CPU µs/req vs vllm-router's cache_aware policy "
                             f"{fmt(check['share_by_cpu_vs_cache_aware'])}")
        else:
            flag = check["unsaturated"]
            verdict = "n/a" if flag is None else ("not saturated" if flag else "SATURATED")
            lines.append(f"- {label} at {check['offered_rps']:g} req/s offered: "
                         f"{fmt(check['rps'], 0)} req/s, p50 {fmt(check['p50_ms'])} ms, "
                         f"{fmt(check['errors'], 0)} errors -> {verdict}")
    return "\n".join(lines)


def targets_text(targets: Mapping[str, Any]) -> str:
    """One line per target."""
    def verdict(flag: object) -> str:
        if flag is None:
            return "n/a"
        return "PASS" if flag else "FAIL"

    return "\n".join([
        f"- added p50 at {TARGET_ADDED_P50_MS:g} ms budget: {fmt(targets['added_p50_ms'])} ms "
        f"-> {verdict(targets['pass_added_p50'])}",
        f"- added p99 at {TARGET_ADDED_P99_MS:g} ms budget: {fmt(targets['added_p99_ms'])} ms "
        f"-> {verdict(targets['pass_added_p99'])}",
        f"- max req/s vs fastest Rust router (need >= {TARGET_RPS_SHARE:g}): "
        f"{fmt(targets['rps_share_of_fastest_router'])} -> {verdict(targets['pass_rps'])} "
        f"(by CPU µs/req: {fmt(targets['per_core_share_of_fastest_router_by_cpu'])})",
    ])


def write_json(opts: Options, measurements: Sequence[Measurement], med: Medians,
               failed: Mapping[str, str], extra: Mapping[str, Any]) -> None:
    """Everything measured, for later comparison."""
    cfg = opts.cfg
    doc = {
        "benchmark": "overhead",
        "command": shlex.join([sys.executable, "-m", "bench.overhead", *sys.argv[1:]]),
        "machine": harness.machine_info(),
        "config": {
            "rate": cfg.rate, "concurrency": cfg.concurrency, "duration_s": cfg.duration_s,
            "warmup_s": cfg.warmup_s, "trials": cfg.trials, "stream_chunks": cfg.stream_chunks,
            "chunk_interval_ms": cfg.chunk_interval_ms, "systems": list(opts.systems),
            "sut_cpu": harness.SUT_CPU, "load_cpu": harness.LOAD_CPU,
            "closed_loop_tool": cfg.closed_tool,
        },
        "failed_to_start": dict(failed),
        "medians": med,
        "measurements": [harness.measurement_json(m) for m in measurements],
        **extra,
    }
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(doc, indent=2, default=str) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point."""
    opts = parse_options(argv)
    known = catalogue()
    systems = [known[name] for name in opts.systems]
    want_profile = opts.profile_s > 0 and KVGATE in opts.systems
    ensure_tools(systems, opts.cfg.venv_root, want_profile or opts.setup_only)
    tool = venvs.closed_loop_tool(opts.closed_tool, may_install=not opts.quick)
    if opts.setup_only:
        return 0
    opts = replace(opts, cfg=replace(opts.cfg, closed_tool=tool))
    total = opts.cfg.trials * len(systems) * len(opts.cells)
    progress = ProgressLine(total)
    measurements, failed = harness.run_matrix(systems, opts.cells, opts.cfg, progress)
    extra: dict[str, Any] = {}
    if want_profile and KVGATE not in failed:
        extra["profile"] = profile.profile_system(known[KVGATE], opts.cfg, opts.profile_s,
                                                  opts.profile_bytes)
    med = harness.medians(measurements)
    measured = [s for s in opts.systems if s in med]
    targets = check_targets(med)
    large = max(c.body_bytes for c in opts.cells)
    per_core = per_core_targets(med, large, opts.cfg.rate)
    write_json(opts, measurements, med, failed,
               {"targets": targets, "per_core_targets": per_core, **extra})
    print(f"\n## Medians of {opts.cfg.trials} trial(s)\n")
    baselines = [s for s in (DIRECT, VLLM_ROUTER, VLLM_ROUTER_CA, SGLANG_ROUTER, KVGATE_UVICORN,
                             KVGATE_BASE) if s in measured]
    subject = KVGATE if KVGATE in measured else None
    print(harness.results_table(med, measured, opts.cells, subject, baselines))
    print("\n## Added over direct\n")
    print(harness.added_latency_table(med, measured, opts.cells))
    if KVGATE in measured:
        print("\n## kvgate targets (1 KiB non-streaming)\n")
        print(targets_text(targets))
        print("\n## Agent-sized bodies (issue 12 item 5, cache-aware default)\n")
        print(per_core_text(per_core))
    for name, why in failed.items():
        print(f"\n{name} did not start: {why}")
    if "profile" in extra:
        print("\n## kvgate profile (py-spy, self time)\n")
        print(profile.top_table(extra["profile"]))
    print(f"\nJSON: {opts.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
