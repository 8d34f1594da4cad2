"""KV-pressure benchmark: cache-aware routing of agentic sessions on two real vLLM CPU engines
whose KV caches hold only a few sessions each (method and results in docs/benchmarks.md).

    flock /tmp/kvgate-heavy.lock .venv/bin/python -m bench.kv_pressure
    flock /tmp/kvgate-heavy.lock .venv/bin/python -m bench.kv_pressure --steady 5  # kv_steady.py

Two engines (engines/local, one core each, the tiny model, prefix caching, KV events bound on
``tcp://*:<port>`` with vLLM's default empty topic) run the whole benchmark; every system x
level x mode run goes through them with its own ``cache_salt``. vLLM puts the salt in the first
block's extra keys (vllm/v1/core/kv_cache_utils.py), so no block of an earlier run can hit;
those blocks are idle and older than any block of the current run, so the engines' LRU evicts
them first and each run sees what an empty cache would give it.

**Sizing.** The tiny model keeps 4 KiB of K and V per token (bf16, 4 layers x 4 KV heads x 64
dims x 2), 512 KiB per 128-token block; ``KV_CACHE_BYTES`` gives each engine 60 blocks. The low
level's live working set (bench/agentic_ideal.py: the blocks every live session needs for its
next turn to hit), measured over the 7 low runs of docs/benchmarks.md's results, p50 / p95:
partitioned (sessions spread over the engines and kept; the fuller engine) 30-32 / 43-55
blocks, concentrated on one engine (also each engine's need under a cache-blind spread, which
leaves every session on both) 41-45 / 61-73. Running requests add ~3 new blocks each (~9 per
engine partitioned, ~18 concentrated). So partitioned needs ~40 of 60 blocks at the median and
mostly fits at p95; concentrated needs the whole cache at the median and far more at p95: a
router that partitions keeps (nearly) every turn cached, one that concentrates or scatters
thrashes. At the high level even a partition exceeds the fleet (p50 55-68 blocks per engine).

The metric: Σ reported ``cached_tokens`` / Σ ideal cached tokens (bench/agentic_ideal.py), per
run, with TTFT and latency medians and each engine's requests and prefill (computed prompt)
tokens from its own counters.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import signal
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from bench import agentic, harness, kv_steady, venvs
from bench.agentic_client import Record, Runner
from bench.agentic_ideal import RunSummary, ideal_cached, live_working_set, summarize
from bench.agentic_systems import (
    DEFAULT_SYSTEMS,
    SYSTEMS,
    Fleet,
    counter_deltas,
    engine_counters,
    health,
    kv_blocks,
    lookup,
    predictions,
    running,
)
from kvgate.engines.local.fleet import start_fleet
from kvgate.engines.local.launcher import LocalEngine, stop
from kvgate.engines.local.model import SERVED_NAME, ensure_model

#: Per engine: 30 MiB = 60 blocks of 128 tokens = 7,680 tokens (see the module docstring).
KV_CACHE_BYTES = 30 << 20
SEED = 0


def _variant(name: str) -> bool:
    """Whether ``name`` is a kvgate system with placement params (bench/agentic_systems.py)."""
    try:
        lookup(name)
    except (KeyError, ValueError):
        return False
    return True


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--systems", default=None,
                   help=f"comma-separated, any of {', '.join(SYSTEMS)} (--steady: also "
                        f"{kv_steady.PIN_INDEX}); default {','.join(DEFAULT_SYSTEMS)} "
                        f"(--steady: {','.join(kv_steady.DEFAULT_SYSTEMS)}); a kvgate system "
                        "with placement params: kvgate-precise+pressure_floor=0.07")
    p.add_argument("--levels", default=None,
                   help="comma-separated: low, high (default low,high; --steady: low)")
    p.add_argument("--modes", default="headers,no-headers",
                   help="comma-separated: headers, no-headers (a system runs the modes it has; "
                        "--steady: workload k runs the k-th in turn)")
    p.add_argument("--steady", type=int, default=0, metavar="N",
                   help="steady state (bench/kv_steady.py): per system ONE gateway serves N "
                        "workloads of seeds seed..seed+N-1, nothing reset between them")
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--kv-cache-bytes", type=int, default=KV_CACHE_BYTES)
    p.add_argument("--engines", type=int, default=2, choices=range(2, 9), metavar="2..8",
                   help="vLLM CPU engines (each its own process; 2 cores run 4 slowly)")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--venv-root", type=Path, default=venvs.DEFAULT_ROOT)
    args = p.parse_args(argv)
    steady = args.steady > 0
    args.systems = args.systems or ",".join(kv_steady.DEFAULT_SYSTEMS if steady
                                            else DEFAULT_SYSTEMS)
    args.levels = args.levels or ("low" if steady else "low,high")
    known = kv_steady.NAMES if steady else tuple(SYSTEMS)
    unknown = [s for s in args.systems.split(",") if s not in known and not _variant(s)]
    unknown += [lv for lv in args.levels.split(",") if lv not in agentic.LEVELS]
    if unknown:
        p.error(f"unknown system(s) or level(s): {', '.join(unknown)}")
    return args


def token_counter(model_dir: Path) -> agentic.Counter:
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return lambda text: len(tok.encode(text, add_special_tokens=False).ids)


def fleet_of(engines: Sequence[LocalEngine], model_dir: Path) -> Fleet:
    events = tuple(e.kv_events or "" for e in engines)
    return Fleet(tuple(e.url for e in engines), events, model_dir, SERVED_NAME)


@dataclass(frozen=True, slots=True)
class RunResult:
    """One run: its summary, every request, and (kvgate) its prediction counters and /health."""

    summary: RunSummary
    records: list[Record]
    predictions: dict[str, float]
    health: dict[str, Any]


def run_one(system: str, mode: str, workload: agentic.Workload, fleet: Fleet, salt: str,
            logs: Path, root: Path) -> RunResult:
    """One system x mode run of ``workload`` on the fleet."""
    with running(lookup(system), fleet, logs, root) as base:
        before = [engine_counters(u) for u in fleet.urls]
        started = time.monotonic()
        runner = Runner(base, workload, fleet.model, salt, sessions=mode == "headers")
        records = asyncio.run(runner.run())
        wall = time.monotonic() - started
        time.sleep(0.5)  # let the engines' counters and the gateway's checks settle
        after = [engine_counters(u) for u in fleet.urls]
        checked, status = predictions(base), health(base)
    deltas = {f"engine-{i}": counter_deltas(b, a) for i, (b, a) in
              enumerate(zip(before, after, strict=True))}
    summary = summarize(system, workload.level, mode, records, deltas, wall)
    return RunResult(summary, records, checked, status)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _split(values: dict[str, float]) -> str:
    return "/".join(f"{v:.0f}" for _, v in sorted(values.items()))


def table(rows: Sequence[RunSummary]) -> str:
    """The runs as a markdown table."""
    out = ["| level | mode | system | share of ideal | cached / prompt | ideal / prompt | "
           "TTFT p50 s | latency p50 s | requests per engine | prefill tokens per engine | "
           "failed |", "|" + "---|" * 11]
    for r in rows:
        prompt = r.prompt_tokens or 1
        out.append(
            f"| {r.level} | {r.mode} | {r.system} | {_fmt(r.share_of_ideal, '.3f')} | "
            f"{r.cached_tokens / prompt:.3f} | {r.ideal_tokens / prompt:.3f} | "
            f"{_fmt(r.ttft_p50_s, '.3f')} | {_fmt(r.latency_p50_s, '.3f')} | "
            f"{_split(dict(r.engine_requests))} | {_split(dict(r.engine_prefill_tokens))} | "
            f"{r.failed} |")
    return "\n".join(out)


def compact(records: Sequence[Record]) -> dict[str, Any]:
    ideal = ideal_cached(records)
    fields = ["sid", "parent", "turn", "sent_s", "done_s", "status", "ttft_s", "prompt_tokens",
              "cached_tokens", "ideal", "engine", "error"]
    rows = [[r.sid, r.parent, r.turn, round(r.sent_s, 3),
             None if r.done_s is None else round(r.done_s, 3), r.status,
             None if r.ttft_s is None else round(r.ttft_s, 4), len(r.prompt_ids) or None,
             r.cached_tokens, i, r.engine, r.error] for r, i in zip(records, ideal, strict=True)]
    return {"fields": fields, "rows": rows}


def warm_up(fleet: Fleet) -> None:
    """Two small chats straight to each engine, so no system pays the first-request costs."""
    for url in fleet.urls:
        for i in range(2):
            body = {"model": fleet.model, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                    "messages": [{"role": "user", "content": f"warm up {i} " * 100}]}
            request = urllib.request.Request(url + "/v1/chat/completions",
                                             json.dumps(body).encode(),
                                             {"content-type": "application/json"})
            with urllib.request.urlopen(request, timeout=120) as resp:
                resp.read()


def run_all(args: argparse.Namespace, fleet: Fleet, doc: dict[str, Any], out: Path) -> None:
    count = token_counter(fleet.model_dir)
    rows: list[RunSummary] = []
    for level in args.levels.split(","):
        workload = agentic.build(args.seed, level, count)
        doc["workloads"][level] = {"slots": workload.slots, "agents": len(workload.agents),
                                   "requests": workload.requests()}
        for mode in args.modes.split(","):
            for system in args.systems.split(","):
                if mode not in lookup(system).modes:
                    continue
                salt = f"kvp-{doc['stamp']}-{level}-{mode}-{system}"
                print(f"kv_pressure: {level} {mode} {system} ...", flush=True)
                run = run_one(system, mode, workload, fleet, salt, out / "logs" / doc["stamp"],
                              args.venv_root)
                rows.append(run.summary)
                ws = live_working_set(run.records)
                doc["runs"].append({**asdict(run.summary), "working_set_blocks": asdict(ws),
                                    "kv_predictions": run.predictions, "salt": salt,
                                    "records": compact(run.records)})
                print(table([run.summary]).splitlines()[-1], flush=True)
                (out / f"kv_pressure-{doc['stamp']}.json").write_text(json.dumps(doc, indent=1))
    print(table(rows), flush=True)


def _exit(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; returns (and writes) the results document."""
    args = parse_args(argv)
    # SIGTERM (and SIGINT, ignored in background jobs) unwind through the finally below, so
    # the engines and the system under test are stopped
    signal.signal(signal.SIGTERM, _exit)
    signal.signal(signal.SIGINT, _exit)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = "kv_steady" if args.steady else "kv_pressure"
    if args.steady:  # the engines serve POST /reset_prefix_cache (reset between systems)
        os.environ.setdefault(kv_steady.DEV_MODE_ENV, "1")
    model_dir = ensure_model(0)
    engines = start_fleet(args.engines, kv_cache_bytes=args.kv_cache_bytes,
                          kv_events_bind=True)
    try:
        fleet = fleet_of(engines, model_dir)
        doc: dict[str, Any] = {
            "benchmark": name, "stamp": stamp,
            "command": shlex.join([sys.executable, "-m", "bench.kv_pressure",
                                   *(argv if argv is not None else sys.argv[1:])]),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                        "tree": harness.git_commit()},
            "seed": args.seed, "kv_cache_bytes": args.kv_cache_bytes, "engines": args.engines,
            "kv_blocks": {e.name: kv_blocks(e.url) for e in engines},
            "workloads": {}, "runs": [],
        }
        warm_up(fleet)
        if args.steady:
            kv_steady.run_steady(args, fleet, doc, args.out, token_counter(model_dir), compact)
        else:
            run_all(args, fleet, doc, args.out)
    finally:
        for engine in engines:
            stop(engine)
    print(f"wrote {args.out / f'{name}-{stamp}.json'}", flush=True)
    return doc


if __name__ == "__main__":
    main()
