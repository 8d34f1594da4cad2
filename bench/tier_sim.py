"""A shared KV tier in a fleet of simulated engines, replayed in virtual time (issue 16).

Each engine is the simulator's own continuous-batching
:class:`~kvgate.engines.sim.core.scheduler.Scheduler` (prefix cache, chunked prefill, preemption)
with its H100 :class:`~kvgate.engines.sim.core.timing.TimingModel`; the fleet optionally shares one
:class:`~kvgate.engines.sim.core.shared_tier.SharedTier`. A discrete-event loop runs the trace on
its own schedule (H100-equivalent seconds, no sleeping, so a run takes seconds to minutes on 2 cores
instead of a timed replay's wall time), routes every arrival with the real ``kv-placement-scorer``
over the engines' exact GPU prefixes (precise mode) and their in-flight uncached tokens (charged at
dispatch, released at the first token), optionally tier-aware
(:func:`kvgate.plugins.prefix.shared_tier.fold_shared`, ``other_tier_weight`` = the derived credit),
and reports the hit ratio (GPU and tier), TTFT percentiles and preemptions.

Setups of one run (``--gpu-blocks`` C per engine, ``--engines`` N):

* ``no-tier``: N x C GPU blocks (the fleet of record);
* ``tier``: the same GPUs plus a shared tier of ``--tier-blocks`` (default N x C: host DRAM as
  large as the fleet's HBM), routing unaware of it;
* ``tier-aware``: the same, routing credits the tier;
* ``tier-aware-codec``: the tier holding 1 / (1 - saving) more blocks (the KV codec's saving,
  read from ``--codec-saving`` JSON; the issue's entropy bound 0.33 when the file is missing);
  with ``--codec-speed`` (a ``kvgate codec bench --speed`` JSON) its loads also move encoded
  bytes and pay the measured decode time, in the TTFT (:mod:`bench.tier_codec`); without it the
  codec's time is not charged, and the output says so;
* ``equal-total``: N x (C - x) GPU blocks plus a tier of N x x (x = C / 4), tier-aware: the same
  total blocks as ``no-tier``;
* ``tier-aware-evicted``: as ``tier-aware``, but engines write a block to the tier when their
  GPU evicts it (an exclusive tier) instead of every computed block (what the connectors do);
* ``tier-aware-w0.5``: as ``tier-aware`` with the tier credited 0.5 (placement's default
  ``other_tier_weight``) instead of the derived credit: what the derivation is worth;
* ``equal-total-evicted``: as ``equal-total`` with the tier written on GPU eviction.

    python -m bench.tier_sim --traces conversation:2000,synthetic:2000 --gpu-blocks 1024,4096
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from bench.placement_sim import Lookup, _request
from bench.replay import TRACE_DIR, trace_path
from bench.replay_metrics import lru_hit_ratio, percentile
from bench.replay_trace import TRACE_BLOCK, TraceRequest, infer_sessions, load_trace, prompt_tokens
from bench.tier_codec import (
    NOT_CHARGED,
    NOT_CHARGED_SHORT,
    CodecSpeed,
    CodecTier,
    load_speed,
    make_tier,
    row_label,
)
from kvgate.engines.sim.core.config import SimConfig
from kvgate.engines.sim.core.prefix_cache import block_hashes
from kvgate.engines.sim.core.scheduler import Planned, Scheduler, SeqSpec
from kvgate.engines.sim.core.shared_tier import TierParams
from kvgate.engines.sim.core.timing import TimingModel
from kvgate.middleware.framework.types import (
    KV_CAPACITY_TOKENS,
    CycleState,
    Endpoint,
    EngineMetrics,
    RoutingDecision,
)
from kvgate.plugins.common.state import PREFIX_MATCH, SESSION_KEY, TOKEN_IDS, PrefixMatch
from kvgate.plugins.placement.scorer import KvPlacementScorer
from kvgate.plugins.prefix.shared_tier import TierLink, fold_shared

#: The issue's entropy bound on the codec's saving, used (and labelled) when no measurement.
SAVING_BOUND = 0.33


@dataclass(frozen=True, slots=True)
class Setup:
    """One fleet: GPU blocks per engine, shared-tier blocks (0: none), codec factor, routing."""

    name: str
    gpu_blocks: int
    tier_blocks: int = 0
    capacity_factor: float = 1.0
    aware: bool = False
    write: Literal["through", "evicted"] = "through"
    #: The tier's credit in routing when ``aware``; None: derived (:class:`TierLink`).
    credit: float | None = None
    #: The codec's measured speed charged to the tier's loads; None: codec time not charged.
    codec: CodecSpeed | None = None


class Fleet:
    """N schedulers, an optional shared tier, the placement scorer and the event loop."""

    def __init__(self, setup: Setup, engines: int, seed: int = 0) -> None:
        self.setup = setup
        self.tier = None if not setup.tier_blocks else make_tier(TierParams(
            capacity_blocks=setup.tier_blocks, block_size=TRACE_BLOCK,
            capacity_factor=setup.capacity_factor, write=setup.write), setup.codec)
        cfg = [SimConfig(engine_id=f"e{k}", block_size=TRACE_BLOCK,
                         capacity_blocks=setup.gpu_blocks,
                         max_model_len=TRACE_BLOCK * setup.gpu_blocks, seed=k)
               for k in range(engines)]
        self.scheds = [Scheduler(c, self.tier) for c in cfg]
        self.max_len = cfg[0].effective_max_model_len
        self.rejected = 0
        self.timing = TimingModel(cfg[0].timing)
        metrics = EngineMetrics(extra={KV_CAPACITY_TOKENS: float(cfg[0].capacity_tokens)})
        self.ids = [f"e{k}" for k in range(engines)]
        self.in_flight = [0] * engines
        self.busy = [False] * engines
        self.metrics = metrics
        params: dict[str, Any] = {}
        if setup.aware:
            params["other_tier_weight"] = (TierLink().credit if setup.credit is None
                                           else setup.credit)
        self.scorer = KvPlacementScorer("kv-placement-scorer",
                                        KvPlacementScorer.Params.model_validate(params), Lookup())
        self.rng = random.Random(seed)
        #: Each served request's TTFT (H100 seconds) by request id, in first-token order.
        self.ttfts: dict[str, float] = {}
        self.events: list[tuple[float, int, int, Any]] = []
        self._n = 0

    def _push(self, t: float, kind: int, payload: Any) -> None:
        self._n += 1
        heapq.heappush(self.events, (t, self._n, kind, payload))

    def _endpoints(self) -> list[Endpoint]:
        return [Endpoint(id=e, url=f"http://{e}", kind="vllm", metrics=self.metrics,
                         in_flight_tokens=self.in_flight[k]) for k, e in enumerate(self.ids)]

    def route(self, i: int, tokens: list[int], session: int) -> tuple[int, int]:
        """The engine for request ``i`` and the uncached tokens charged to it."""
        limit = (len(tokens) - 1) // TRACE_BLOCK
        hashes = block_hashes(tokens, TRACE_BLOCK)[:limit]
        device = {e: s.cache.match_blocks(hashes) * TRACE_BLOCK
                  for e, s in zip(self.ids, self.scheds, strict=True)}
        match = PrefixMatch(len(tokens), device, {}, True, frozenset(self.ids))
        if self.setup.aware and self.tier is not None:
            match = fold_shared(match, self.tier.match_blocks(hashes) * TRACE_BLOCK, self.ids)
        state = CycleState()
        state.put(TOKEN_IDS, tokens)
        state.put(PREFIX_MATCH, match)
        state.put(SESSION_KEY, str(session))
        req = _request(i, len(tokens))
        eps = self._endpoints()
        scores = self.scorer.score(req, state, eps)
        top = max(scores.values())
        k = self.rng.choice([k for k, ep in enumerate(eps) if scores[ep.id] == top])
        asyncio.run(self.scorer.before_dispatch(req, state, RoutingDecision(target=eps[k])))
        return k, max(0, len(tokens) - device[self.ids[k]])

    def _start(self, k: int, t: float) -> None:
        """Engine ``k`` runs its next step from ``t`` (idle when nothing can run)."""
        sched = self.scheds[k]
        for _ in range(2):  # a step that only preempted: re-admission runs in the next one
            plan = sched.schedule()
            if plan:
                seconds = self.timing.step_seconds(Scheduler.chunks(plan)) + sched.tier_seconds
                self.busy[k] = True
                self._push(t + seconds, 1, (k, plan))
                return
        self.busy[k] = False

    def run(self, reqs: Sequence[TraceRequest], max_output: int) -> dict[str, Any]:
        """Replay ``reqs`` on their schedule; the run's figures."""
        sessions = infer_sessions(reqs)
        t0 = reqs[0].timestamp_ms / 1000 if reqs else 0.0
        for i, r in enumerate(reqs):
            self._push(r.timestamp_ms / 1000 - t0, 0, i)
        arrival: dict[str, tuple[float, int, int]] = {}
        ttft: list[float] = []
        cached: list[int] = []
        while self.events:
            t, _, kind, payload = heapq.heappop(self.events)
            if kind == 0:
                r = reqs[payload]
                out_len = max(1, min(r.output_length, max_output))
                if r.input_length + out_len > self.max_len:  # vLLM's 400: never admitted
                    self.rejected += 1
                    continue
                tokens = prompt_tokens(r)
                k, charge = self.route(payload, tokens, sessions[payload])
                self.in_flight[k] += charge
                arrival[str(payload)] = (t, k, charge)
                self.scheds[k].add(SeqSpec(str(payload), tokens, out_len, ignore_eos=True))
                if not self.busy[k]:
                    self._start(k, t)
                continue
            k, plan = payload
            self._complete(k, plan, t, arrival, ttft, cached)
            self._start(k, t)
        return self._figures(reqs, ttft, cached)

    def _complete(self, k: int, plan: list[Planned], t: float,
                  arrival: dict[str, tuple[float, int, int]], ttft: list[float],
                  cached: list[int]) -> None:
        for seq, _tok in self.scheds[k].complete(plan):
            if seq.num_output == 1:
                sent, engine, charge = arrival.pop(seq.request_id)
                ttft.append(t - sent)
                self.ttfts[seq.request_id] = t - sent
                cached.append(seq.cached_tokens or 0)
                self.in_flight[engine] -= charge

    def _figures(self, reqs: Sequence[TraceRequest], ttft: list[float],
                 cached: list[int]) -> dict[str, Any]:
        prompt = sum(r.input_length for r in reqs)
        gpu = sum(s.stats.prompt_tokens_cache_hit for s in self.scheds)
        tier = sum(s.stats.prompt_tokens_tier for s in self.scheds)
        out: dict[str, Any] = {
            **asdict(self.setup), "requests": len(reqs), "first_tokens": len(ttft),
            "rejected_too_long": self.rejected,
            "hit_ratio": sum(cached) / prompt, "gpu_hit_ratio": gpu / prompt,
            "tier_hit_ratio": tier / prompt,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90),
            "ttft_p99_s": percentile(ttft, 99),
            "ttft_mean_s": sum(ttft) / len(ttft) if ttft else None,
            "preemptions": sum(s.stats.preemptions for s in self.scheds),
        }
        if self.tier is not None:
            out["tier"] = {**asdict(self.tier.stats), "capacity": self.tier.capacity}
        out["codec_time"] = (self.tier.figures() if isinstance(self.tier, CodecTier)
                             else {"charged": False, "label": NOT_CHARGED,
                                   "short": NOT_CHARGED_SHORT})
        return out


def codec_factor(path: Path) -> tuple[float, str]:
    """1 / (1 - saving) from the codec's result file, else from :data:`SAVING_BOUND`; with a
    label saying which."""
    try:
        saving = float(json.loads(path.read_text())["saving"])
        source = f"measured: {path} saving={saving:.4f}"
    except (OSError, ValueError, KeyError, TypeError):
        saving = SAVING_BOUND
        source = f"bound, not measured: saving={saving} ({path} missing or unreadable)"
    if not 0.0 <= saving < 1.0:
        raise SystemExit(f"{path}: saving {saving} is not in [0, 1)")
    return 1.0 / (1.0 - saving), source


def setups(engines: int, gpu: int, tier: int | None, factor: float,
           names: Sequence[str], codec: CodecSpeed | None = None) -> list[Setup]:
    """The setups of one capacity (module docstring), in ``names``' order; ``codec`` is
    charged to ``tier-aware-codec`` only."""
    tier_blocks = engines * gpu if tier is None else tier
    moved = gpu // 4
    every = {
        "no-tier": Setup("no-tier", gpu),
        "tier": Setup("tier", gpu, tier_blocks),
        "tier-aware": Setup("tier-aware", gpu, tier_blocks, aware=True),
        "tier-aware-codec": Setup("tier-aware-codec", gpu, tier_blocks, factor, aware=True,
                                  codec=codec),
        "equal-total": Setup("equal-total", gpu - moved, engines * moved, aware=True),
        "tier-aware-evicted": Setup("tier-aware-evicted", gpu, tier_blocks, aware=True,
                                    write="evicted"),
        "tier-aware-w0.5": Setup("tier-aware-w0.5", gpu, tier_blocks, aware=True, credit=0.5),
        "equal-total-evicted": Setup("equal-total-evicted", gpu - moved, engines * moved,
                                     aware=True, write="evicted"),
    }
    return [every[n] for n in names]


SETUPS = ("no-tier", "tier", "tier-aware", "tier-aware-codec", "equal-total",
          "tier-aware-evicted", "tier-aware-w0.5", "equal-total-evicted")


def references(name: str, reqs: Sequence[TraceRequest], fleet: int) -> dict[str, Any]:
    """Pooled-LRU hit ratios (engine view) of one cache of 1x and 2x the fleet's GPU blocks:
    what the fleet alone, and the fleet plus a tier as large, could reach if nothing were
    duplicated; the infinite cache's is the ideal."""
    row = {"trace": name, "requests": len(reqs), "fleet_blocks": fleet,
           "pooled_lru_1x": lru_hit_ratio(reqs, fleet, engine_view=True),
           "pooled_lru_2x": lru_hit_ratio(reqs, 2 * fleet, engine_view=True),
           "ideal": lru_hit_ratio(reqs, None, engine_view=True)}
    print(f"{name}:{len(reqs)} pooled LRU {fleet} blocks {row['pooled_lru_1x']:.3f}, "
          f"{2 * fleet} blocks {row['pooled_lru_2x']:.3f}, ideal {row['ideal']:.3f}", flush=True)
    return row


def markdown(doc: dict[str, Any]) -> str:
    """The results as one markdown table per trace and capacity."""
    out: list[str] = [f"Codec time: {doc.get('codec_time', NOT_CHARGED)}"]
    refs = {(r["trace"], r["fleet_blocks"]): r for r in doc["references"]}
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in doc["results"]:
        fleet = doc["engines"] * (row["gpu_blocks"] + row["tier_blocks"] // doc["engines"])
        key = (row["trace"], fleet if row["name"].startswith("equal-total") else
               doc["engines"] * row["gpu_blocks"])
        groups.setdefault(key, []).append(row)
    for (trace, fleet), rows in groups.items():
        ref = refs[(trace, fleet)]
        out += [f"\n{trace}, first {ref['requests']} requests, {doc['engines']} engines x "
                f"{fleet // doc['engines']} GPU blocks (pooled LRU {ref['pooled_lru_1x']:.3f}, "
                f"2x {ref['pooled_lru_2x']:.3f}, ideal {ref['ideal']:.3f}):\n",
                "| setup | GPU blocks/engine | tier blocks | hit | GPU hit | tier hit "
                "| TTFT p50 s | p90 s | p99 s | mean s | preemptions | served |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            tier = r.get("tier", {}).get("capacity", 0)
            out.append(f"| {row_label(r)} | {r['gpu_blocks']} | {tier} | {r['hit_ratio']:.3f} | "
                       f"{r['gpu_hit_ratio']:.3f} | {r['tier_hit_ratio']:.3f} | "
                       f"{r['ttft_p50_s']:.3f} | {r['ttft_p90_s']:.3f} | {r['ttft_p99_s']:.3f} | "
                       f"{r['ttft_mean_s']:.3f} | {r['preemptions']} | "
                       f"{r['first_tokens']}/{r['requests']} |")
    return "\n".join(out)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.tier_sim", description=__doc__)
    p.add_argument("--traces", default="conversation:2000,synthetic:2000",
                   help="NAME[:N] (first N requests), comma-separated")
    p.add_argument("--trace-dir", type=Path, default=TRACE_DIR)
    p.add_argument("--engines", type=int, default=8)
    p.add_argument("--gpu-blocks", default="1024,4096", help="blocks of 512 tokens per engine")
    p.add_argument("--tier-blocks", type=int, default=None,
                   help="shared tier blocks (default: engines x gpu blocks)")
    p.add_argument("--setups", default=",".join(SETUPS))
    p.add_argument("--max-output", type=int, default=32, help="output cap, as bench.replay")
    p.add_argument("--codec-saving", type=Path, default=Path("bench/results/codec-saving.json"))
    p.add_argument("--codec-speed", type=Path, default=None,
                   help="a `kvgate codec bench --speed` JSON: tier-aware-codec's loads pay its "
                        "decode time in the TTFT (default: codec time not charged)")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--report", type=Path, default=None,
                   help="print the markdown tables of a results JSON and exit")
    args = p.parse_args(argv)
    unknown = set(args.setups.split(",")) - set(SETUPS)
    if unknown:
        p.error(f"unknown setup(s): {', '.join(sorted(unknown))}")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.report is not None:
        report: dict[str, Any] = json.loads(args.report.read_text())
        print(markdown(report))
        return report
    factor, source = codec_factor(args.codec_saving)
    speed = None if args.codec_speed is None else load_speed(args.codec_speed)
    codec_time = NOT_CHARGED if speed is None else speed.label
    print(f"codec capacity factor {factor:.3f} ({source})\n{codec_time}", flush=True)
    doc: dict[str, Any] = {
        "benchmark": "tier_sim", "engines": args.engines, "max_output_tokens": args.max_output,
        "codec_factor": factor, "codec_source": source, "codec_time": codec_time,
        "codec_speed": None if speed is None else asdict(speed), "tier_credit": TierLink().credit,
        "tier_link": TierLink().model_dump(), "tier_params": TierParams(
            capacity_blocks=1, block_size=TRACE_BLOCK).model_dump(
                exclude={"capacity_blocks", "capacity_factor"}),
        "references": [], "results": []}
    for spec in args.traces.split(","):
        name, _, limit = spec.partition(":")
        reqs = load_trace(trace_path(name, args.trace_dir), int(limit) if limit else None)
        for gpu in (int(c) for c in args.gpu_blocks.split(",")):
            doc["references"].append(references(name, reqs, args.engines * gpu))
            for setup in setups(args.engines, gpu, args.tier_blocks, factor,
                                args.setups.split(","), speed):
                started = time.monotonic()
                row = Fleet(setup, args.engines).run(reqs, args.max_output)
                row.update(trace=name, wall_s=round(time.monotonic() - started, 1))
                doc["results"].append(row)
                print(f"{name}:{len(reqs)} {args.engines}x{gpu} {row_label(row):17s} "
                      f"hit {row['hit_ratio']:.3f} (gpu {row['gpu_hit_ratio']:.3f} tier "
                      f"{row['tier_hit_ratio']:.3f})  TTFT p50 {row['ttft_p50_s']:.3f} "
                      f"p90 {row['ttft_p90_s']:.3f} p99 {row['ttft_p99_s']:.3f} s  "
                      f"[{row['wall_s']} s]", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"tier-sim-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(doc, indent=1))
    print(markdown(doc))
    print(f"wrote {path}", flush=True)
    return doc


if __name__ == "__main__":
    main()
