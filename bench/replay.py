"""Trace replay benchmark: Mooncake traces through kvgate's routing policies and the peer routers
in front of a fleet of simulated engines (issue 4; method in docs/benchmarks.md).

    .venv/bin/python -m bench.replay --traces synthetic --limit 2000 --speedup 10

For each trace (the first ``--limit`` requests), each system gets a fresh fleet of ``--engines``
simulated engines (``--block-size`` tokens per block, ``--capacity-blocks`` blocks, H100 timing
scaled by ``--time-scale``, default ``1 / --speedup``) and the trace is sent on its schedule,
compressed ``--speedup`` times. Reports the prefix hit ratio from the engines' reported cached
tokens next to the ideal and pooled-LRU references of exactly the replayed requests, TTFT
percentiles in H100-equivalent seconds (wall / time scale), prefill-load imbalance (max/mean of
uncached prompt tokens per engine) and failures. Writes JSON and a PNG to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench import venvs
from bench.replay_client import Job, Outcome, replay
from bench.replay_metrics import Reference, reference
from bench.replay_report import Summary, markdown, plot, summarize
from bench.replay_systems import (
    MODEL,
    SYSTEMS,
    DefaultTuning,
    FleetSpec,
    SystemSpec,
    engine_counters,
    gateway_counters,
    system_running,
)
from bench.replay_trace import (
    TRACE_BLOCK,
    BlockCache,
    TraceRequest,
    completion_body,
    infer_sessions,
    load_trace,
    send_offsets,
)

#: The workplace's shared/ folder sits beside the repository (``KVGATE_TRACES`` overrides).
TRACE_DIR = Path(os.environ.get(
    "KVGATE_TRACES", Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake"))
CALIBRATION = ("engines/sim timing: H100 80GB, Llama-3.1-8B-shaped, transformers + SDPA, batch 1 "
               "(shared/design/H100_TIMING.md; docs/simulator.md)")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--traces", default="conversation,synthetic",
                   help="trace names in --trace-dir (<name>_trace.jsonl) or paths, comma-separated;"
                        " NAME:N replays that trace's first N requests")
    p.add_argument("--trace-dir", type=Path, default=TRACE_DIR)
    p.add_argument("--limit", type=int, default=None,
                   help="replay the first N requests of each trace (default: all)")
    p.add_argument("--speedup", type=float, default=10.0, help="trace time compression (10)")
    p.add_argument("--time-scale", type=float, default=None,
                   help="simulated step time factor (default 1/speedup; 0 = instant)")
    p.add_argument("--max-output", type=int, default=32,
                   help="cap on output tokens per request (32; the trace's length when shorter)")
    p.add_argument("--concurrency", type=int, default=512, help="max requests in flight (512)")
    p.add_argument("--engines", type=int, default=8)
    p.add_argument("--block-size", type=int, default=TRACE_BLOCK, help="engine KV block (512)")
    p.add_argument("--capacity-blocks", type=int, default=4096, help="KV blocks per engine")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma-separated, any of {', '.join(SYSTEMS)}")
    p.add_argument("--no-sessions", action="store_true", help="send no session headers")
    p.add_argument("--guard", type=_guard, default=None, metavar="FACTOR,SLACK",
                   help="kvgate-v1-default's token-imbalance-filter max_imbalance,slack_tokens "
                        "(default: the plugin's defaults)")
    p.add_argument("--weights", type=_weights, default=(3.0, 2.0, 1.0), metavar="P,L,S",
                   help="kvgate-v1-default's prefix, load, session weights (3,2,1)")
    p.add_argument("--placement-params", type=json.loads, default=None, metavar="JSON",
                   help="kvgate-default only: params merged into its kv-placement-scorer "
                        "(tuning runs; default: the shipped defaults, as `kvgate serve` runs)")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--venv-root", type=Path, default=venvs.DEFAULT_ROOT)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--no-plot", action="store_true",
                   help="skip the PNG chart (also skipped when matplotlib is not installed)")
    args = p.parse_args(argv)
    unknown = [s for s in args.systems.split(",") if s not in SYSTEMS]
    if unknown:
        p.error(f"unknown system(s): {', '.join(unknown)}")
    if TRACE_BLOCK % args.block_size:
        p.error("--block-size must divide 512")
    return args


def _guard(text: str) -> dict[str, float]:
    factor, slack = text.split(",")
    return {"max_imbalance": float(factor), "slack_tokens": int(slack)}


def _weights(text: str) -> tuple[float, float, float]:
    prefix, load, session = (float(x) for x in text.split(","))
    return prefix, load, session


def trace_path(name: str, trace_dir: Path) -> Path:
    path = Path(name)
    return path if path.suffix == ".jsonl" else trace_dir / f"{name}_trace.jsonl"


def _jobs(reqs: Sequence[TraceRequest], speedup: float, sessions: bool) -> list[Job]:
    ids = infer_sessions(reqs)
    offsets = send_offsets(reqs, speedup)
    return [Job(i, offsets[i], f"s{ids[i]}" if sessions else None) for i in range(len(reqs))]


def run_system(
    spec: SystemSpec, fleet: FleetSpec, jobs: Sequence[Job], bodies: Sequence[bytes],
    args: argparse.Namespace, logs: Path, label: str,
) -> tuple[list[Outcome], dict[str, dict[str, float]]]:
    """Replay ``jobs`` through ``spec`` in front of a fresh fleet; outcomes and engine counters."""
    if spec.kind != "kvgate":
        tool = venvs.SGLANG_ROUTER if spec.kind == "sglang-router" else venvs.VLLM_ROUTER
        venvs.ensure(tool, args.venv_root)
    tuning = DefaultTuning(args.weights, args.guard, args.placement_params)
    with system_running(spec, fleet, logs, args.venv_root, tuning) as sut:
        outcomes = asyncio.run(replay(
            sut.base_urls or sut.base_url, jobs, bodies.__getitem__, args.concurrency, label=label,
            progress=not args.no_progress))
        time.sleep(0.2)  # let the engines' last counters settle
        counters = {f"e{i}": engine_counters(u) for i, u in enumerate(sut.engine_urls)}
        if spec.uses_events:
            counters["gateway"] = gateway_counters(sut.base_url)
    return outcomes, counters


def _ref_dict(ref: Reference) -> dict[str, Any]:
    return asdict(ref)


def _bodies(
    cache: dict[bool, list[bytes]], reqs: Sequence[TraceRequest], text: bool, max_output: int,
    blocks: BlockCache,
) -> list[bytes]:
    """The request bodies in one prompt format, built once per trace and format."""
    if text not in cache:
        cache[text] = [completion_body(r, MODEL, max_output, blocks, text) for r in reqs]
    return cache[text]


def run_trace(spec: str, args: argparse.Namespace, stamp: str) -> dict[str, Any]:
    """Every system on one trace (``name`` or ``name:limit``); the JSON-ready result."""
    name, _, limit = spec.partition(":")
    path = trace_path(name, args.trace_dir)
    reqs = load_trace(path, int(limit) if limit else args.limit)
    time_scale = args.time_scale if args.time_scale is not None else 1.0 / args.speedup
    fleet = FleetSpec(engines=args.engines, block_size=args.block_size,
                      capacity_blocks=args.capacity_blocks, time_scale=time_scale)
    pooled = args.engines * args.capacity_blocks * args.block_size // TRACE_BLOCK
    ref, engine_ref = reference(reqs, pooled), reference(reqs, pooled, engine_view=True)
    blocks = BlockCache()
    bodies: dict[bool, list[bytes]] = {}
    jobs = _jobs(reqs, args.speedup, not args.no_sessions)
    rows: list[Summary] = []
    raw: dict[str, list[list[Any]]] = {}
    wall: dict[str, float] = {}
    for system in args.systems.split(","):
        logs = args.out / "logs" / stamp / path.stem / system
        body = _bodies(bodies, reqs, SYSTEMS[system].text_prompt, args.max_output, blocks)
        started = time.monotonic()
        outcomes, counters = run_system(SYSTEMS[system], fleet, jobs, body, args, logs,
                                        f"{path.stem[:12]} {system}")
        wall[system] = round(time.monotonic() - started, 1)
        rows.append(summarize(system, outcomes, counters, time_scale,
                              [r.input_length for r in reqs]))
        raw[system] = [[o.index, o.status, o.ttft_s, o.cached_tokens, o.engine, o.error,
                        o.late_s, o.latency_s] for o in outcomes]
    print(markdown(path.stem, ref, engine_ref, rows), flush=True)
    span = (reqs[-1].timestamp_ms - reqs[0].timestamp_ms) / 1000 if reqs else 0.0
    return {
        "trace": str(path), "requests": len(reqs), "trace_span_s": span,
        "sessions": len(set(infer_sessions(reqs))) if not args.no_sessions else None,
        "prompt_tokens": sum(r.input_length for r in reqs),
        "fleet": asdict(fleet), "reference": _ref_dict(ref),
        "engine_reachable_reference": _ref_dict(engine_ref),
        "systems": [asdict(r) for r in rows], "wall_s": wall,
        "outcomes": {"fields": ["index", "status", "ttft_wall_s", "cached_tokens", "engine",
                                "error", "late_wall_s", "latency_wall_s"], **raw},
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; returns (and writes) the results document."""
    args = parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    args.out.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {
        "benchmark": "replay",
        "command": shlex.join([sys.executable, "-m", "bench.replay", *(argv or sys.argv[1:])]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "calibration": CALIBRATION, "speedup": args.speedup,
        "time_scale": args.time_scale if args.time_scale is not None else 1.0 / args.speedup,
        "max_output_tokens": args.max_output, "concurrency": args.concurrency,
        "sessions": not args.no_sessions, "default_guard": args.guard,
        "default_weights": args.weights, "placement_params": args.placement_params,
        "results": {},
    }
    out_json = args.out / f"replay-{stamp}.json"
    for spec in args.traces.split(","):
        doc["results"][Path(spec.partition(":")[0]).stem] = run_trace(spec, args, stamp)
        out_json.write_text(json.dumps(doc, indent=1))
    if args.no_plot or importlib.util.find_spec("matplotlib") is None:
        print(f"wrote {out_json} (no chart: --no-plot, or matplotlib missing: "
              "pip install -e '.[bench]')", flush=True)
    else:
        plot(out_json.with_suffix(".png"), doc["results"])
        print(f"wrote {out_json} and {out_json.with_suffix('.png')}", flush=True)
    return doc


if __name__ == "__main__":
    main()
