"""Routing in steady state, without timing: one long-running router per fleet serves a
sequence of agentic workloads (bench/steady_workloads.py) over per-engine LRU caches that are
never reset, and each workload's share of the ideal cached tokens is reported per system.

The real ``kv-placement-scorer`` (kvgate's default decision) runs on every request with the
prefix each engine holds, precise (the engines' true LRU contents, as KV events give) or
approximate (the gateway's own record: kvgate's ``prefix-cache-producer`` in ``approximate``
mode fed with the request's token ids), with or without session headers. Baselines: sessions
pinned by index, random, least-loaded (fewest prefill tokens computed so far), consistent
hash on the session id (vllm-router ``consistent_hash``) and a cache-aware router
(vllm-router / sglang-router ``cache_aware``: the engine holding the largest share of the
prompt when that share is at least 0.5, else the least loaded).

A *cell* is (sequence seed, engines, KV ratio); its workloads alternate with and without
session headers. From the second workload on, every workload of every cell is reported, and the
worst. The ideal is one cache of unbounded size: every full block seen before is a hit.

    python -m bench.steady_sim --seeds 1,2,3 --engines 2,4,8 --ratios 0.6,1,2

Untimed (requests one after another, no queues): the real-engine family is
``bench.kv_pressure --steady`` (docs/routing.md, "Steady state").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.placement_sim import Lookup
from bench.steady_workloads import Request, Workload, sequence
from kvgate.middleware.framework.types import (
    KV_CAPACITY_TOKENS,
    Api,
    CycleState,
    Endpoint,
    EngineMetrics,
    InferenceRequest,
    RoutingDecision,
)
from kvgate.plugins.common.broadcast import Broadcast, Channel
from kvgate.plugins.common.state import (
    PREFIX_MATCH,
    PROMPT_CHAIN,
    SESSION_KEY,
    SESSION_PIN,
    TOKEN_IDS,
    PrefixMatch,
)
from kvgate.plugins.placement.scorer import KvPlacementScorer
from kvgate.plugins.prefix.producer import PrefixCacheProducer

SYSTEMS = ("kvgate", "kvgate-approx", "pin-index", "random", "least-loaded", "consistent-hash",
           "cache-aware")
BLOCK = 128


class Engine:
    """One vLLM prefix cache of ``capacity_blocks`` blocks and the prefill it computed.

    vLLM's semantics (engine venv ``vllm/v1/core``), which decide what a router can still find:

    * a hit is the longest run of leading full blocks present, at most ``(prompt - 1) // BLOCK``
      (the last prompt token is always recomputed);
    * every block past the hit is computed into a *newly allocated* block, even when a copy of
      it is still cached behind a missing one (``block_pool.py``: "We currently don't
      de-duplicate the blocks in the cache"); each allocation evicts the least recently freed
      cached block;
    * a finished request's blocks are freed in *reverse* order (``single_type_kv_cache_manager``
      ``free``: ``free_blocks(reversed(...))``), so a conversation is evicted from its tail and
      its head (the shared prompt, the oldest turns) last.

    Entries are (block id, copy) pairs, least recently freed first."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self.cache: OrderedDict[tuple[int, int], None] = OrderedDict()
        self.copies: dict[int, list[int]] = {}  # block id -> copies cached
        self.prefill = 0
        self._next = 0

    def held(self, blocks: Sequence[int], prompt: int) -> int:
        n = 0
        for h in blocks[: (prompt - 1) // BLOCK]:
            if h not in self.copies:
                break
            n += 1
        return n * BLOCK

    def serve(self, req: Request) -> int:
        hit = self.held(req.blocks, req.prompt)
        self.prefill += req.prompt - hit
        hit_blocks = hit // BLOCK
        in_use: list[tuple[int, int]] = []
        for h in req.after[:hit_blocks]:  # referenced: out of the free queue while running
            key = (h, self.copies[h][0])
            del self.cache[key]
            in_use.append(key)
        for h in req.after[hit_blocks:]:
            while self.cache and len(self.cache) + len(in_use) >= self.capacity:
                self._evict()
            self._next += 1
            in_use.append((h, self._next))
            self.copies.setdefault(h, []).append(self._next)
        for key in reversed(in_use):  # freed tail first: evicted first
            self.cache[key] = None
        return hit

    def _evict(self) -> None:
        (h, copy), _ = self.cache.popitem(last=False)
        left = self.copies[h]
        left.remove(copy)
        if not left:
            del self.copies[h]


class Router:
    """One system's routing state, kept across the whole sequence (a long-running router).

    kvgate with ``replicas`` > 1: that many gateways behind a round-robin load balancer, each
    with its own scorer (and record), sharing what ``--redis`` shares: every replica's
    insertions reach the others' ledgers (token-load's counter exchange, here after every
    request: the ideal of its 1 s rounds), the session table's pin (``SESSION_PIN``), with
    the record, every insertion (plugins/prefix/shared_record.py), and unless
    ``share_memory`` is off (the gateway before it was shared), the placement's session memory
    (plugins/placement/shared.py: each session's own insertions, header-less conversations),
    told through the real broadcast's queue and JSON, after every request."""

    def __init__(self, system: str, engines: int, capacity_tokens: int, seed: int,
                 params: dict[str, Any], replicas: int = 1, share_memory: bool = True) -> None:
        self.system = system
        self.n = engines
        self.rng = random.Random(seed)
        metrics = EngineMetrics(extra={KV_CAPACITY_TOKENS: float(capacity_tokens)})
        self.eps = [Endpoint(id=f"e{i}", url=f"http://e{i}", kind="vllm", metrics=metrics)
                    for i in range(engines)]
        self.scorers: list[KvPlacementScorer] = []
        self.records: list[PrefixCacheProducer] = []
        self.clock = 0.0
        #: Seconds of the workloads served before (the record's clock only moves forward).
        self.base = 0.0
        self.turn = 0
        #: The shared session table (replicas > 1 only): session -> engine it went to last.
        self.table: dict[str, str] | None = {} if replicas > 1 else None
        if system.startswith("kvgate"):
            self.scorers = [KvPlacementScorer(
                "kv-placement-scorer", KvPlacementScorer.Params.model_validate(params),
                Lookup()) for _ in range(replicas)]
            if replicas > 1 and share_memory:
                for i, scorer in enumerate(self.scorers):
                    scorer.shared = Broadcast(None, None, scorer.apply_shared, Channel(
                        "sim", "sim", "sim", "sim"), me=f"r{i}", flush_s=0.0, timeout_s=1.0,
                        retry_s=1.0, max_pending=1024)
        if system == "kvgate-approx":
            self.records = [PrefixCacheProducer(
                "prefix-cache-producer", PrefixCacheProducer.Params.model_validate(
                    {"mode": "approximate"}), Lookup(), clock=lambda: self.clock)
                for _ in range(replicas)]

    def route(self, req: Request, fleet: list[Engine], headers: bool) -> int:
        held = [e.held(req.blocks, req.prompt) for e in fleet]
        if self.scorers:
            return self._placement(req, held, headers)
        if self.system == "pin-index":
            return req.index % self.n
        if self.system == "random":
            return self.rng.randrange(self.n)
        if self.system == "consistent-hash":
            return zlib.crc32(req.session.encode()) % self.n
        least = min(range(self.n), key=lambda k: fleet[k].prefill)
        if self.system == "cache-aware":
            best = max(range(self.n), key=held.__getitem__)
            return best if held[best] >= 0.5 * req.prompt else least
        return least

    def _state(self, req: Request, held: list[int], headers: bool) -> CycleState:
        state = CycleState()
        state.put(TOKEN_IDS, req.tokens)
        if not self.records:  # precise: what the engines hold, as their KV events say
            state.put(PREFIX_MATCH, PrefixMatch(
                req.prompt, {ep.id: h for ep, h in zip(self.eps, held, strict=True)}, {}, True))
            state.put(PROMPT_CHAIN, (BLOCK, req.blocks))  # the producer's event hashes
        if headers:
            session = req.session.split("-sub")[0]
            state.put(SESSION_KEY, session)
            pin = None if self.table is None else self.table.get(session)
            if pin is not None:
                state.put(SESSION_PIN, pin)
        return state

    def _placement(self, req: Request, held: list[int], headers: bool) -> int:
        k = self.turn % len(self.scorers)
        self.turn += 1
        scorer = self.scorers[k]
        state = self._state(req, held, headers)
        ireq = InferenceRequest(
            request_id=req.session, api=Api.CHAT, model="m", body={"max_tokens": req.reply},
            headers={}, stream=False, client_wants_usage=False,
            prompt_token_estimate=req.prompt, received_at=0.0)
        if self.records:
            self.clock = self.base + req.at
            asyncio.run(self.records[k].prepare(ireq, state, self.eps))
        scores = scorer.score(ireq, state, self.eps)
        top = max(scores.values())
        target = self.rng.choice([i for i, ep in enumerate(self.eps) if scores[ep.id] == top])
        decision = RoutingDecision(target=self.eps[target])
        before = scorer.stats.inserted_tokens
        asyncio.run(scorer.before_dispatch(ireq, state, decision))
        self._share(k, state, ireq, decision, scorer.stats.inserted_tokens - before)
        return target

    def _share(self, k: int, state: CycleState, ireq: InferenceRequest,
               decision: RoutingDecision, inserted: int) -> None:
        """What the replicas share through Redis: insertions, the session pin, the record."""
        if self.table is not None and state.get(SESSION_KEY) is not None:
            self.table[state.require(SESSION_KEY)] = decision.target.id
        told = self.scorers[k].shared
        items = [] if told is None else json.loads(json.dumps(told.drain()))
        for i, other in enumerate(self.scorers):
            if i != k:
                other.add_remote({decision.target.id: float(inserted)})
                for item in items:
                    other.apply_shared(item)
        for record in self.records:  # the router's own, and the others' through shared_record
            asyncio.run(record.before_dispatch(ireq, state, decision))


def ideal(wl: Workload, seen: set[int]) -> int:
    """Cached tokens of one unbounded cache that has seen everything before (``seen`` grows)."""
    total = 0
    for r in wl.requests:
        n = 0
        for h in r.blocks[: (r.prompt - 1) // BLOCK]:
            if h not in seen:
                break
            n += 1
        total += n * BLOCK
        seen.update(r.after)
    return total


def capacity_blocks(wls: Sequence[Workload], engines: int, ratio: float) -> int:
    """``ratio`` x the partitioned working set per engine (the median workload's: its shared
    prefix once plus its share of the concurrent sessions' own tokens)."""
    per_engine = []
    for wl in wls:
        last: dict[str, int] = {}
        for r in wl.requests:
            last[r.session] = r.prompt + r.reply - wl.shared_tokens
        own = statistics.mean(last.values())
        per_engine.append(wl.shared_tokens + own * wl.concurrent / engines)
    return max(8, int(ratio * statistics.median(per_engine) / BLOCK))


def run_cell(seed: int, engines: int, ratio: float, workloads: int, systems: Sequence[str],
             params: dict[str, Any], replicas: int = 1, share_memory: bool = True
             ) -> dict[str, Any]:
    wls = list(sequence(seed, workloads, BLOCK))
    cap = capacity_blocks(wls, engines, ratio)
    seen: set[int] = set()
    ideals = [ideal(wl, seen) for wl in wls]
    rows: dict[str, list[dict[str, Any]]] = {}
    for system in systems:
        fleet = [Engine(cap) for _ in range(engines)]
        router = Router(system, engines, cap * BLOCK, seed, params, replicas, share_memory)
        rows[system] = [_serve(wl, k, fleet, router, ideals[k]) for k, wl in enumerate(wls)]
    return {"seed": seed, "engines": engines, "ratio": ratio, "capacity_blocks": cap,
            "workloads": [{"concurrent": wl.concurrent, "sessions": wl.sessions,
                           "shared": wl.shared_tokens, "requests": len(wl.requests),
                           "headers": k % 2 == 0} for k, wl in enumerate(wls)],
            "systems": rows}


def _serve(wl: Workload, k: int, fleet: list[Engine], router: Router, ideal_tokens: int
           ) -> dict[str, Any]:
    headers = k % 2 == 0
    hit = 0
    per_engine = [0] * len(fleet)
    for req in wl.requests:
        target = router.route(req, fleet, headers)
        per_engine[target] += 1
        hit += fleet[target].serve(req)
    router.base += wl.requests[-1].at + 10.0
    return {"share": hit / ideal_tokens if ideal_tokens else 1.0,
            "max_engine_share": max(per_engine) / max(1, sum(per_engine))}


def summarize(cells: Sequence[dict[str, Any]], systems: Sequence[str]) -> dict[str, Any]:
    """Per system, with and without headers: the mean and the worst workload (2nd on), and the
    gates of issue 28 for kvgate (against pinning and random in the same workload)."""
    out: dict[str, Any] = {}
    for headers in (True, False):
        for system in systems:
            vals = [c["systems"][system][k]["share"] for c in cells
                    for k in range(1, len(c["workloads"]))
                    if c["workloads"][k]["headers"] is headers]
            out[f"{system}/{'headers' if headers else 'no-headers'}"] = {
                "mean": statistics.mean(vals), "worst": min(vals), "n": len(vals)}
    out["gates"] = _gates(cells)
    return out


def _gates(cells: Sequence[dict[str, Any]]) -> dict[str, Any]:
    worst_pin = worst_random = 1.0
    lopsided = 0.0
    where: dict[str, Any] = {}
    for c in cells:
        for k in range(1, len(c["workloads"])):
            kv = c["systems"]["kvgate"][k]
            if c["workloads"][k]["headers"] and "pin-index" in c["systems"]:
                m = kv["share"] - c["systems"]["pin-index"][k]["share"]
                if m < worst_pin:
                    worst_pin, where["pin"] = m, (c["seed"], c["engines"], c["ratio"], k)
            if not c["workloads"][k]["headers"] and "random" in c["systems"]:
                m = kv["share"] - c["systems"]["random"][k]["share"]
                if m < worst_random:
                    worst_random, where["random"] = m, (c["seed"], c["engines"], c["ratio"], k)
            if c["engines"] == 2:
                lopsided = max(lopsided, kv["max_engine_share"])
    return {"worst_vs_pinning_with_headers": worst_pin, "worst_vs_random_without": worst_random,
            "max_engine_share_two_engines": lopsided, "where": where}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.steady_sim", description=__doc__)
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--engines", default="2,4,8")
    p.add_argument("--ratios", default="0.6,1,2")
    p.add_argument("--workloads", type=int, default=5)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--params", default="{}", help="kv-placement-scorer params (JSON)")
    p.add_argument("--replicas", type=int, default=1,
                   help="kvgate replicas behind a round-robin balancer, sharing as --redis")
    p.add_argument("--no-shared-memory", dest="share_memory", action="store_false",
                   help="replicas without the shared session memory (the gateway before it)")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None, show: Callable[[str], None] = print
         ) -> dict[str, Any]:
    args = parse_args(argv)
    systems = args.systems.split(",")
    params = json.loads(args.params)
    cells = []
    for seed in (int(s) for s in args.seeds.split(",")):
        for engines in (int(e) for e in args.engines.split(",")):
            for ratio in (float(r) for r in args.ratios.split(",")):
                cell = run_cell(seed, engines, ratio, args.workloads, systems, params,
                                args.replicas, args.share_memory)
                cells.append(cell)
                line = "  ".join(
                    f"{s}=" + "/".join(f"{w['share']:.2f}" for w in cell["systems"][s][1:])
                    for s in systems)
                show(f"seed {seed} engines {engines} ratio {ratio}: {line}")
    summary = summarize(cells, systems)
    for key, row in summary.items():
        if key != "gates":
            show(f"{key:32s} mean {row['mean']:.3f}  worst {row['worst']:.3f}  (n={row['n']})")
    show(f"gates: {json.dumps(summary['gates'])}")
    doc = {"params": params, "replicas": args.replicas, "share_memory": args.share_memory,
           "cells": cells, "summary": summary}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"steady-sim-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(doc, indent=1))
    show(f"wrote {path}")
    return doc


if __name__ == "__main__":
    main()
