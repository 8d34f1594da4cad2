"""Placement without timing: the trace's requests, one after another, routed over per-engine LRU
caches by the real ``kv-placement-scorer`` (and simple baselines), in seconds instead of the
minutes of a timed replay (``bench/replay.py``). For tuning and for checking a placement design
at many capacities; the timed replay remains the benchmark of record.

Model: ``--engines`` caches of ``--capacity-blocks`` blocks of 512 tokens (the traces' block),
each an LRU over block hash ids exactly like ``bench/replay_metrics.lru_hit_ratio`` with the
engine's view (only full blocks are stored; a hit is capped at ``(input - 1) // 512`` blocks,
as vLLM recomputes a fully cached prompt's last token). The router sees the exact prefix each
engine holds (precise mode), no in-flight load (requests do not overlap), and the output adds
nothing (not cached). Prefill imbalance = max / mean of the uncached tokens computed per engine.

    python -m bench.placement_sim --traces conversation,synthetic --capacity-blocks 4096,1024
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.replay import TRACE_DIR, trace_path
from bench.replay_metrics import imbalance, lru_hit_ratio
from bench.replay_trace import TRACE_BLOCK, TraceRequest, infer_sessions, load_trace
from kvgate.middleware.framework.types import (
    KV_CAPACITY_TOKENS,
    Api,
    CycleState,
    Endpoint,
    EngineMetrics,
    InferenceRequest,
    RoutingDecision,
)
from kvgate.plugins.common.state import PREFIX_MATCH, SESSION_KEY, TOKEN_IDS, PrefixMatch
from kvgate.plugins.placement.scorer import KvPlacementScorer

POLICIES = ("placement", "placement-nopressure", "session-pin", "random", "least-prefill")


class Lookup:
    def lookup(self, name: str) -> object:
        raise KeyError(name)


class Engine:
    """One LRU cache of block hash ids and what it computed."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.prefill = 0

    def held_blocks(self, req: TraceRequest) -> int:
        n = 0
        for h in req.hash_ids[: (req.input_length - 1) // TRACE_BLOCK]:
            if h not in self.cache:
                break
            n += 1
        return n

    def serve(self, req: TraceRequest) -> int:
        """Cached tokens of ``req`` here; stores its full blocks (LRU)."""
        hit = self.held_blocks(req) * TRACE_BLOCK
        self.prefill += req.input_length - hit
        for h in req.hash_ids[: req.input_length // TRACE_BLOCK]:
            if h in self.cache:
                self.cache.move_to_end(h)
            else:
                self.cache[h] = None
                if len(self.cache) > self.capacity:
                    self.cache.popitem(last=False)
        return hit


def _endpoints(n: int, capacity_tokens: int) -> list[Endpoint]:
    metrics = EngineMetrics(extra={KV_CAPACITY_TOKENS: float(capacity_tokens)})
    return [Endpoint(id=f"e{i}", url=f"http://e{i}", kind="vllm", metrics=metrics)
            for i in range(n)]


def _request(i: int, tokens: int) -> InferenceRequest:
    return InferenceRequest(
        request_id=str(i), api=Api.COMPLETIONS, model="m", body={"max_tokens": 0},
        headers={}, stream=False, client_wants_usage=False, prompt_token_estimate=tokens,
        received_at=0.0)


def run_policy(policy: str, reqs: Sequence[TraceRequest], engines: int, capacity: int,
               params: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    """Route ``reqs`` with ``policy``; hit ratio and prefill imbalance."""
    fleet = [Engine(capacity) for _ in range(engines)]
    eps = _endpoints(engines, capacity * TRACE_BLOCK)
    sessions = infer_sessions(reqs)
    rng = random.Random(seed)
    if policy.startswith("placement"):
        extra = {"pressure_exponent": 0.0} if policy == "placement-nopressure" else {}
        scorer = KvPlacementScorer("kv-placement-scorer", KvPlacementScorer.Params.model_validate(
            {**params, **extra}), Lookup())
    hit = total = 0
    for i, (req, session) in enumerate(zip(reqs, sessions, strict=True)):
        held = {ep.id: fleet[k].held_blocks(req) * TRACE_BLOCK for k, ep in enumerate(eps)}
        if policy.startswith("placement"):
            state = CycleState()
            state.put(TOKEN_IDS, tuple(range(req.input_length)))
            state.put(PREFIX_MATCH, PrefixMatch(req.input_length, held, {}, True))
            state.put(SESSION_KEY, str(session))
            scores = scorer.score(_request(i, req.input_length), state, eps)
            top = max(scores.values())
            target = rng.choice([k for k, ep in enumerate(eps) if scores[ep.id] == top])
            asyncio.run(scorer.before_dispatch(_request(i, req.input_length), state,
                                               RoutingDecision(target=eps[target])))
        elif policy == "session-pin":
            target = random.Random(session).randrange(engines)
        elif policy == "random":
            target = rng.randrange(engines)
        else:  # least-prefill: the engine that computed least so far
            target = min(range(engines), key=lambda k: fleet[k].prefill)
        hit += fleet[target].serve(req)
        total += req.input_length
    return {"policy": policy, "hit_ratio": hit / total,
            "imbalance": imbalance({str(k): e.prefill for k, e in enumerate(fleet)})}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.placement_sim", description=__doc__)
    p.add_argument("--traces", default="conversation,synthetic")
    p.add_argument("--trace-dir", type=Path, default=TRACE_DIR)
    p.add_argument("--engines", type=int, default=8)
    p.add_argument("--capacity-blocks", default="4096,1024",
                   help="blocks of 512 tokens per engine, comma-separated")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--params", default="{}", help="kv-placement-scorer params (JSON)")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    params = json.loads(args.params)
    results: list[dict[str, Any]] = []
    for name in args.traces.split(","):
        reqs = load_trace(trace_path(name, args.trace_dir))
        for cap in (int(c) for c in args.capacity_blocks.split(",")):
            pooled = lru_hit_ratio(reqs, cap * args.engines, engine_view=True)
            print(f"{name} {args.engines} x {cap} blocks: pooled LRU {pooled:.3f}", flush=True)
            for policy in args.policies.split(","):
                row = run_policy(policy, reqs, args.engines, cap, params)
                row.update(trace=name, capacity_blocks=cap, pooled_lru=pooled)
                print(f"  {policy:22s} hit {row['hit_ratio']:.3f}  "
                      f"imbalance {row['imbalance']:.2f}", flush=True)
                results.append(row)
    doc = {"engines": args.engines, "params": params, "results": results}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"placement-sim-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(doc, indent=1))
    print(f"wrote {path}")
    return doc


if __name__ == "__main__":
    main()
