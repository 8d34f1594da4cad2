"""Where a timed replay's hit ratio went: its per-request routing decisions replayed offline.

    .venv/bin/python -m bench.replay_moves bench/results/replay-XXXX.json [--system NAME]

Reads a ``bench.replay`` result (per request: engine, cached tokens, send lateness, latency)
and the trace it replayed, then walks the requests in the order they were sent, over per-engine
LRU caches of the run's capacity (``bench.placement_sim``'s model: full 512-token blocks, a hit
capped at ``(input - 1) // 512`` blocks). Reported, as shares of all prompt tokens:

* ``model_hit_ratio`` — the same assignment through the untimed model. Equal to the measured
  hit ratio when the engines' own timing (concurrent requests, admission-time lookup, the
  eviction order of released chains) changes nothing; ``engine_above_model`` /
  ``engine_below_model`` sum the per-request differences.
* ``decisions`` — per request, ``home`` (sent to an engine holding the most of its prompt),
  ``moved`` (another engine held more) or ``cold`` (every engine held the same), and
  ``moved_lost``: the tokens a moved request left behind (most held minus held where it went).
* ``moved_by`` — for kvgate's ``kv-placement-scorer`` (default params, or ``--params``): each
  move re-priced with the queue the gateway saw (the in-flight requests at its send time,
  charged as token-load-scorer charges them: uncached prompt + 4 x output tokens) and the
  insertion ledger of the decisions so far: ``queue`` when the holding engine is cheapest
  without the queue term but not with it, ``pressure`` when it is not cheapest even without
  it (turnover, pin), ``unexplained`` when the shadow would have kept the request home (what
  the gateway saw differed: event lag, speculative entries, ties).

The shadow cannot see the gateway's event lag or its speculative index entries; it prices what
the engines held when the request was sent. Pure apart from reading the two files.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.placement_sim import Engine, Lookup, _endpoints
from bench.replay import TRACE_DIR, trace_path
from bench.replay_trace import TRACE_BLOCK, TraceRequest, infer_sessions, load_trace, send_offsets
from kvgate.middleware.framework.types import (
    Api,
    CycleState,
    Endpoint,
    InferenceRequest,
    RoutingDecision,
)
from kvgate.plugins.common.state import PREFIX_MATCH, SESSION_KEY, TOKEN_IDS, PrefixMatch
from kvgate.plugins.load.token_load import TokenLoadScorer
from kvgate.plugins.placement.scorer import KvPlacementScorer

#: token-load-scorer's default weight of an in-flight decode token [prefill tokens]
DECODE_TOKEN_WEIGHT: float = TokenLoadScorer.Params.model_fields["decode_token_weight"].default
#: the replay's default cap on output tokens (bench.replay --max-output)
MAX_OUTPUT = 32


@dataclass(frozen=True, slots=True)
class Sent:
    """One replayed request as the load generator saw it (wall-clock seconds)."""

    engine: int
    cached: int
    sent_s: float
    done_s: float


class QueueView:
    """The in-flight work per engine at one moment (what ``TokenLoadScorer.works`` returns)."""

    def __init__(self) -> None:
        self.queue: dict[str, float] = {}

    def work(self, endpoint: str) -> float:
        return self.queue.get(endpoint, 0.0)

    def works(self, endpoints: Sequence[str]) -> dict[str, float]:
        return {e: self.work(e) for e in endpoints}


def read_outcomes(doc: Mapping[str, Any], trace: str, system: str,
                  trace_dir: Path) -> tuple[list[TraceRequest], list[Sent]]:
    """The trace's replayed requests and what happened to each, in trace order (the trace
    file where the run read it, else by name in ``trace_dir``)."""
    res = doc["results"][trace]
    path = Path(res["trace"])
    if not path.exists():
        path = trace_path(path.name, trace_dir)
    reqs = load_trace(path, int(res["requests"]))
    fields: list[str] = res["outcomes"]["fields"]
    if "latency_wall_s" not in fields:
        raise ValueError("the result has no per-request latency (bench.replay before it "
                         "recorded late_wall_s and latency_wall_s): rerun it")
    rows = sorted((dict(zip(fields, r, strict=False)) for r in res["outcomes"][system]),
                  key=lambda r: int(r["index"]))
    offsets = send_offsets(reqs, float(doc["speedup"]))
    out = []
    for row, offset in zip(rows, offsets, strict=True):
        sent = offset + float(row.get("late_wall_s") or 0.0)
        out.append(Sent(int(str(row["engine"]).rsplit("-", 1)[1]), int(row["cached_tokens"] or 0),
                        sent, sent + float(row.get("latency_wall_s") or 0.0)))
    return reqs, out


def _request(i: int, req: TraceRequest) -> InferenceRequest:
    return InferenceRequest(
        request_id=str(i), api=Api.COMPLETIONS, model="m",
        body={"max_tokens": max(1, min(req.output_length, MAX_OUTPUT))}, headers={},
        stream=False, client_wants_usage=False, prompt_token_estimate=req.input_length,
        received_at=0.0)


class Shadow:
    """kv-placement-scorer fed the replay's own decisions, pricing each one again."""

    def __init__(self, engines: int, capacity_blocks: int, params: Mapping[str, Any]) -> None:
        self.eps: list[Endpoint] = _endpoints(engines, capacity_blocks * TRACE_BLOCK)
        self.scorer = KvPlacementScorer(
            "kv-placement-scorer", KvPlacementScorer.Params.model_validate(dict(params)), Lookup())
        self.view = QueueView()
        self.scorer.load = self.view  # type: ignore[assignment]  # duck-typed works(endpoints)

    def moved_by(self, i: int, req: TraceRequest, session: int, held: Sequence[int],
                 home: int) -> str:
        """Why a request left ``home`` (module docstring): queue, pressure or unexplained."""
        costs = self.scorer.place(_request(i, req), self._state(req, session, held),
                                  self.eps).costs
        weight = self.scorer.p.load_weight
        unqueued = {e: c - weight * self.view.work(e) for e, c in costs.items()}
        key = self.eps[home].id
        if unqueued[key] > min(unqueued.values()) + 1e-6:
            return "pressure"
        return "unexplained" if costs[key] <= min(costs.values()) + 1e-6 else "queue"

    def dispatched(self, i: int, req: TraceRequest, session: int, held: Sequence[int],
                   target: int) -> None:
        decision = RoutingDecision(target=self.eps[target])
        asyncio.run(self.scorer.before_dispatch(
            _request(i, req), self._state(req, session, held), decision))

    def _state(self, req: TraceRequest, session: int, held: Sequence[int]) -> CycleState:
        state = CycleState()
        state.put(TOKEN_IDS, tuple(range(req.input_length)))
        device = {ep.id: h for ep, h in zip(self.eps, held, strict=True)}
        state.put(PREFIX_MATCH, PrefixMatch(req.input_length, device, {}, True))
        state.put(SESSION_KEY, str(session))
        return state


def _queue(sent: Sequence[Sent], charge: Mapping[int, float], i: int) -> dict[str, float]:
    """In-flight work per engine when request ``i`` was sent (charges of requests sent before
    it and not yet answered)."""
    out: dict[str, float] = {}
    now = sent[i].sent_s
    for j, amount in charge.items():
        if sent[j].sent_s <= now < sent[j].done_s:
            key = f"e{sent[j].engine}"
            out[key] = out.get(key, 0.0) + amount
    return out


def decompose(reqs: Sequence[TraceRequest], sent: Sequence[Sent], engines: int,
              capacity_blocks: int, params: Mapping[str, Any]) -> dict[str, Any]:
    """The figures of the module docstring (shares of all prompt tokens)."""
    fleet = [Engine(capacity_blocks) for _ in range(engines)]
    shadow = Shadow(engines, capacity_blocks, params)
    sessions = infer_sessions(reqs)
    kinds: Counter[str] = Counter()
    tokens: Counter[str] = Counter()
    charge: dict[int, float] = {}
    for i in sorted(range(len(reqs)), key=lambda k: sent[k].sent_s):
        req, target = reqs[i], sent[i].engine
        held = [e.held_blocks(req) * TRACE_BLOCK for e in fleet]
        shadow.view.queue = _queue(sent, charge, i)
        kind = _kind(held, target)
        kinds[kind] += 1
        if kind == "moved":
            why = shadow.moved_by(i, req, sessions[i], held, held.index(max(held)))
            kinds[f"moved_by_{why}"] += 1
            tokens["moved_lost"] += max(held) - held[target]
            tokens[f"moved_by_{why}_lost"] += max(held) - held[target]
        shadow.dispatched(i, req, sessions[i], held, target)
        hit = fleet[target].serve(req)
        tokens["model_hit"] += hit
        tokens["engine_above_model"] += max(0, sent[i].cached - hit)
        tokens["engine_below_model"] += max(0, hit - sent[i].cached)
        charge[i] = req.input_length - held[target] + DECODE_TOKEN_WEIGHT * max(
            1, min(req.output_length, MAX_OUTPUT))
        _drop_finished(charge, sent, sent[i].sent_s)
    return _figures(reqs, sent, kinds, tokens)


def _kind(held: Sequence[int], target: int) -> str:
    if max(held) == min(held):
        return "cold"
    return "home" if held[target] == max(held) else "moved"


def _drop_finished(charge: dict[int, float], sent: Sequence[Sent], now: float) -> None:
    """Forget charges of requests answered before ``now`` (sends are in time order)."""
    for j in [j for j in charge if sent[j].done_s <= now]:
        del charge[j]


def _figures(reqs: Sequence[TraceRequest], sent: Sequence[Sent], kinds: Counter[str],
             tokens: Counter[str]) -> dict[str, Any]:
    total = sum(r.input_length for r in reqs) or 1
    share = {k: round(v / total, 5) for k, v in sorted(tokens.items())}
    return {
        "requests": len(reqs),
        "measured_hit_ratio": round(sum(s.cached for s in sent) / total, 5),
        "model_hit_ratio": share.pop("model_hit", 0.0),
        "decisions": dict(sorted(kinds.items())),
        "lost_and_differences": share,
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.replay_moves", description=__doc__)
    p.add_argument("result", type=Path, help="a bench.replay JSON")
    p.add_argument("--system", default="kvgate-default")
    p.add_argument("--params", type=json.loads, default=None,
                   help="kv-placement-scorer params of the shadow (JSON; default: the run's "
                        "--placement-params, else the shipped defaults)")
    p.add_argument("--trace-dir", type=Path, default=TRACE_DIR)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    doc = json.loads(args.result.read_text())
    params = args.params if args.params is not None else doc.get("placement_params") or {}
    out: dict[str, Any] = {}
    for trace, res in doc["results"].items():
        reqs, sent = read_outcomes(doc, trace, args.system, args.trace_dir)
        fleet = res["fleet"]
        out[trace] = decompose(reqs, sent, int(fleet["engines"]), int(fleet["capacity_blocks"]),
                               params)
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
