"""The request pipeline's stages in a tight loop: CPU µs per request of each, with no I/O.

:mod:`bench.overhead` measures the whole gateway through its server, :mod:`bench.plugin_cost`
by ablation through its ASGI app; both include the HTTP server, the engine client, the event
loop and the machine's noise (±10 % between runs). This benchmark takes all I/O away: the
quick-start default's pipeline (the config ``kvgate serve --engine URL ...`` builds, with
``--engines`` fake engines so that the pool is discovered and healthy) runs its per-request
work on one chat body of ``--body-size`` bytes, request after request, in one coroutine:

``parse`` (``load_body``, the chat adapter's ``parse``, ``build_request``), the request hooks,
each producer's ``prepare``, the scheduler (filters, scorers, picker), each dispatch hook's
``before_dispatch``, the usage hooks (a fixed usage), the completion and request-end hooks.
What it leaves out is what the gateway does around the pipeline: the request context, the
dispatcher's bookkeeping, the engine exchange, metrics, the access log.

Each stage is timed with ``time.perf_counter`` around it (a few hundredths of a µs per stage);
the total is timed separately with no stage timer, as ``time.process_time`` over ``--requests``
requests. Medians of ``--trials``. The figures are precise to a few tenths of a µs from one run
to the next, so a change's effect on the pipeline shows in one A/B run of two trees.

Run: ``.venv/bin/python -m bench.pipeline_cost`` (about 10 s); writes
``bench/results/pipeline-cost-<timestamp>.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from bench import harness
from bench.loadgen import make_body
from bench.plugin_cost import preset_data, with_engines

#: One request's pass through the pipeline; ``tick(stage, since)`` adds the time since
#: ``since`` to ``stage`` and returns now (a no-op returning 0.0 when the total is timed).
Tick = Callable[[str, float], float]


async def _discovered(app: Any, engines: int, timeout_s: float) -> list[Any]:
    """The pool's snapshot once every engine is healthy with its models known."""
    deadline = time.monotonic() + timeout_s
    while True:
        eps = list(app.pool.snapshot())
        if len(eps) == engines and all(ep.healthy and ep.models for ep in eps):
            return eps
        if time.monotonic() > deadline:
            raise RuntimeError(f"engines not discovered within {timeout_s} s")
        await asyncio.sleep(0.05)


def pipeline(app: Any, eps: Sequence[Any], body: bytes) -> Callable[[Tick], Awaitable[None]]:
    """One request's pipeline work, as the gateway and the dispatcher run it (no I/O)."""
    from kvgate.apis.openai import ChatCompletions
    from kvgate.middleware.framework.types import CycleState, Outcome, OutcomeKind, Usage
    from kvgate.middleware.serving.requests import build_request, load_body

    gateway = app.gateway
    pipe, adapter, rids = gateway.dispatcher.pipeline, ChatCompletions(), gateway.request_ids
    headers = {"content-type": "application/json"}
    usage = Usage(prompt_tokens=256, completion_tokens=16, cached_tokens=240)

    async def one(tick: Tick) -> None:
        t = tick("", 0.0)
        data = load_body(body)
        req = build_request(adapter, adapter.parse(data, headers), data, body, headers, rids())
        state = CycleState()
        t = tick("parse", t)
        for hook in pipe.request_hooks:
            await hook.on_request(req, state)
        t = tick("on_request (all)", t)
        for producer in pipe.producers:
            await producer.prepare(req, state, eps)
            t = tick(f"prepare {producer.name}", t)
        decision = pipe.scheduler.schedule(req, state, eps)
        t = tick("schedule (filters, scorers, picker)", t)
        for dispatch in pipe.dispatch_hooks:
            await dispatch.before_dispatch(req, state, decision)
            t = tick(f"before_dispatch {dispatch.name}", t)
        for used in pipe.usage_hooks:
            await used.on_usage(req, state, decision.target, usage)
        t = tick("on_usage (all)", t)
        outcome = Outcome(kind=OutcomeKind.DONE, status=200, usage=usage, total_s=0.001)
        for done in pipe.completion_hooks:
            await done.on_complete(req, state, decision.target, outcome)
        for end in pipe.request_end_hooks:
            await end.on_request_end(req, state, 200)
        tick("on_complete, on_request_end (all)", t)

    return one


async def _measure(app: Any, eps: Sequence[Any], body: bytes,
                   args: argparse.Namespace) -> dict[str, Any]:
    one = pipeline(app, eps, body)
    stages: dict[str, float] = {}
    clock = time.perf_counter

    def timed(stage: str, since: float) -> float:
        now = clock()
        if stage:
            stages[stage] = stages.get(stage, 0.0) + now - since
        return now

    def untimed(stage: str, since: float) -> float:
        return 0.0

    for _ in range(args.warmup):
        await one(untimed)
    totals, per_stage = [], []
    for _ in range(args.trials):
        start = time.process_time()
        for _ in range(args.requests):
            await one(untimed)
        totals.append((time.process_time() - start) / args.requests * 1e6)
        stages.clear()
        for _ in range(args.requests):
            await one(timed)
        per_stage.append({k: v / args.requests * 1e6 for k, v in stages.items()})
    return {"total_us": totals, "stages_us": per_stage}


def summarise(samples: dict[str, Any]) -> dict[str, Any]:
    """Medians: the total and each stage (in pipeline order)."""
    runs = samples["stages_us"]
    return {"total_us": statistics.median(samples["total_us"]),
            "stages_us": {k: statistics.median(r[k] for r in runs) for k in runs[0]}}


def table(summary: dict[str, Any]) -> str:
    rows = [[stage, f"{us:.2f}"] for stage, us in summary["stages_us"].items()]
    rows.append(["sum of the stages", f"{sum(summary['stages_us'].values()):.2f}"])
    rows.append(["total, no stage timer", f"{summary['total_us']:.2f}"])
    return harness.markdown_table(["stage", "CPU µs/request"], rows)


async def _run(upstreams: Sequence[str], args: argparse.Namespace) -> dict[str, Any]:
    from kvgate.middleware.app import create_app
    from kvgate.middleware.framework.composition.config import parse_config

    data = preset_data(upstreams)
    app = create_app(parse_config(data, "<pipeline-cost>"))
    body = make_body(args.body_size, False, "bench-model")
    async with app.running():
        eps = await _discovered(app, len(upstreams), args.timeout_s)
        samples = await _measure(app, eps, body, args)
    summary = summarise(samples)
    return {"benchmark": "pipeline_cost", "machine": harness.machine_info(),
            "options": {k: v for k, v in vars(args).items() if k != "out"},
            "preset": data, "samples": samples, "summary": summary, "table": table(summary)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.pipeline_cost",
        description="CPU per request of each stage of the default pipeline (no I/O)")
    parser.add_argument("--requests", type=int, default=20000, help="requests per trial")
    parser.add_argument("--warmup", type=int, default=2000, help="untimed requests first")
    parser.add_argument("--body-size", type=int, default=1024, help="chat body size [bytes]")
    parser.add_argument("--engines", type=int, default=1, help="fake engines behind the pool")
    parser.add_argument("--trials", type=int, default=5, help="timed runs (medians)")
    parser.add_argument("--timeout-s", type=float, default=30.0,
                        help="for the engines to be discovered")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: timestamped)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if min(args.requests, args.trials, args.body_size, args.engines) < 1 or args.warmup < 0:
        raise SystemExit("--requests, --trials, --body-size and --engines must be >= 1")
    return with_engines("pipeline-cost", args.engines, args.out,
                        lambda upstreams, _work: asyncio.run(_run(upstreams, args)))


if __name__ == "__main__":
    raise SystemExit(main())
