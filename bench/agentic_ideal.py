"""Pure figures of the KV-pressure benchmark: ideal cached tokens, live working set, summaries.

**Ideal cached tokens** of a request: what one infinite cache would have served it. Every request
that *completed before it was sent* leaves in that cache the full blocks of what its engine
computed: its prompt and its generated tokens except the last (the last sampled token is never
fed back). The request's ideal is its longest prefix of cached blocks, capped the way vLLM caps a
hit: ``get_computed_blocks`` looks up at most ``num_tokens - 1`` tokens (the last prompt token is
always recomputed for its logits) in full blocks, so at most
``floor((prompt - 1) / block) * block`` (vllm/v1/core/kv_cache_manager.py, vLLM 0.32).
Requests overlapping in time do not count for each other, so a system can exceed the ideal on
a request when an engine reuses blocks of a request still running (rare: it has to be the same
prefix at the same moment).

**Live working set**: at each request's send time, the distinct blocks of the latest computed
sequence of every live session (sent its first request, not yet done with its last), i.e. what
must stay cached for every live session's next turn to hit. ``partitioned`` places the sessions
on ``engines`` engines in turn by first request (a router that spreads sessions and keeps them)
and gives the fullest engine's blocks; ``concentrated`` is the whole set on one engine, which is
also what every engine needs when sessions are spread at random (each engine ends up holding
every session). The benchmark sizes the engines' KV between the two (bench/kv_pressure.py).
"""

from __future__ import annotations

import hashlib
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from bench.agentic_client import Record

BLOCK = 128


def chain(ids: Sequence[int], block: int = BLOCK) -> list[bytes]:
    """Chained digests of the full blocks of ``ids``: element k names the prefix of k+1 blocks."""
    keys: list[bytes] = []
    parent = b""
    for start in range(0, len(ids) - block + 1, block):
        data = parent + b"".join(t.to_bytes(4, "little") for t in ids[start:start + block])
        parent = hashlib.blake2b(data, digest_size=16).digest()
        keys.append(parent)
    return keys


def computed(rec: Record) -> tuple[int, ...]:
    """The tokens whose KV the engine computed for ``rec``: prompt + output minus the last."""
    return rec.prompt_ids + rec.output_ids[:-1]


def ideal_cached(records: Sequence[Record], block: int = BLOCK) -> list[int]:
    """Ideal cached tokens per record (0 for failed ones), in the records' order."""
    ok = [r for r in records if r.ok]
    done = sorted(ok, key=lambda r: r.done_s or 0.0)
    cache: set[bytes] = set()
    ideal: dict[int, int] = {}
    j = 0
    for rec in sorted(ok, key=lambda r: r.sent_s):
        while j < len(done) and (done[j].done_s or 0.0) <= rec.sent_s:
            cache.update(chain(computed(done[j]), block))
            j += 1
        hit = 0
        for key in chain(rec.prompt_ids, block):
            if key not in cache:
                break
            hit += 1
        cap = max(len(rec.prompt_ids) - 1, 0) // block
        ideal[rec.index] = min(hit, cap) * block
    return [ideal.get(r.index, 0) for r in records]


@dataclass(frozen=True, slots=True)
class WorkingSet:
    """Blocks the live sessions need, over every request's send time: (p50, p95, max)."""

    concentrated: tuple[int, int, int]
    partitioned: tuple[int, int, int]


def _spread(values: Sequence[int]) -> tuple[int, int, int]:
    if not values:
        return (0, 0, 0)
    ordered = sorted(values)
    return (ordered[len(ordered) // 2], ordered[min(len(ordered) - 1, len(ordered) * 95 // 100)],
            ordered[-1])


def live_working_set(records: Sequence[Record], engines: int = 2,
                     block: int = BLOCK) -> WorkingSet:
    """The live working set of a run (see the module docstring)."""
    ok = sorted((r for r in records if r.ok), key=lambda r: r.sent_s)
    first = {r.sid: r.sent_s for r in reversed(ok)}
    last = {r.sid: r.done_s or 0.0 for r in ok}
    home = {sid: i % engines for i, sid in enumerate(sorted(first, key=first.__getitem__))}
    blocks = {r.index: chain(computed(r), block) for r in ok}
    whole: list[int] = []
    parts: list[int] = []
    for rec in ok:
        now = rec.sent_s
        latest: dict[str, Record] = {}
        for r in ok:
            live = (r.done_s or 0.0) <= now and first[r.sid] <= now <= last[r.sid]
            if live and (r.sid not in latest
                         or (latest[r.sid].done_s or 0.0) < (r.done_s or 0.0)):
                latest[r.sid] = r
        per = [set[bytes]() for _ in range(engines)]
        for sid, r in latest.items():
            per[home[sid]].update(blocks[r.index])
        whole.append(len(set().union(*per)))
        parts.append(max(len(p) for p in per))
    return WorkingSet(_spread(whole), _spread(parts))


def median(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


@dataclass(frozen=True, slots=True)
class RunSummary:
    """One system x level x mode run."""

    system: str
    level: str
    mode: str
    requests: int
    failed: int
    prompt_tokens: int
    cached_tokens: int
    ideal_tokens: int
    share_of_ideal: float | None
    over_ideal_requests: int
    ttft_p50_s: float | None
    latency_p50_s: float | None
    engine_requests: Mapping[str, float]
    engine_prefill_tokens: Mapping[str, float]
    engine_preemptions: Mapping[str, float]
    routed_by_header: Mapping[str, int]
    wall_s: float


def summarize(system: str, level: str, mode: str, records: Sequence[Record],
              engines: Mapping[str, Mapping[str, float]], wall_s: float,
              block: int = BLOCK) -> RunSummary:
    """Figures of one run; ``engines`` holds each engine's metric deltas over the run."""
    ideal = ideal_cached(records, block)
    ok = [(r, i) for r, i in zip(records, ideal, strict=True) if r.ok]
    cached = sum(r.cached_tokens or 0 for r, _ in ok)
    total_ideal = sum(i for _, i in ok)
    routed: dict[str, int] = {}
    for r, _ in ok:
        routed[r.engine or "?"] = routed.get(r.engine or "?", 0) + 1
    return RunSummary(
        system=system, level=level, mode=mode, requests=len(records),
        failed=len(records) - len(ok), prompt_tokens=sum(len(r.prompt_ids) for r, _ in ok),
        cached_tokens=cached, ideal_tokens=total_ideal,
        share_of_ideal=cached / total_ideal if total_ideal else None,
        over_ideal_requests=sum(1 for r, i in ok if (r.cached_tokens or 0) > i),
        ttft_p50_s=median(r.ttft_s for r, _ in ok),
        latency_p50_s=median(r.latency_s for r, _ in ok),
        engine_requests={e: m.get("requests", 0.0) for e, m in engines.items()},
        engine_prefill_tokens={e: m.get("prefill_tokens", 0.0) for e, m in engines.items()},
        engine_preemptions={e: m.get("preemptions", 0.0) for e, m in engines.items()},
        routed_by_header=routed, wall_s=round(wall_s, 1),
    )
