"""Pure figures of the replay benchmark: the trace's reference hit ratios and the measured ones.

Reference hit ratios (what a router is compared against), for exactly the requests replayed:

* ``ideal`` — infinite cache: a request's hit is its longest prefix of blocks seen before;
* ``pooled_lru`` — one LRU cache of ``capacity`` blocks holding the whole fleet's capacity
  (every request's blocks touched in arrival order, least recently used evicted first).

Two accountings, selected by ``engine_view``:

* ``False`` — the trace README's: a hit of *k* blocks is worth ``min(k * 512, input_length)``
  tokens and every block of the prompt (the partial last one too) is inserted. This reproduces
  the README's figures (conversation 0.374 ideal / 0.342 at 32,768 blocks).
* ``True`` — what an engine can report: only full blocks are cached, and the last prompt token is
  always computed, so a hit is at most ``floor((input_length - 1) / 512)`` blocks. Measured
  ``cached_tokens`` can reach this, not the README's figure.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from bench.replay_trace import TRACE_BLOCK, TraceRequest


@dataclass(frozen=True, slots=True)
class Reference:
    """Reference hit ratios (fractions of all prompt tokens)."""

    ideal: float
    pooled_lru: float
    capacity_blocks: int
    engine_view: bool


def _hit_tokens(req: TraceRequest, blocks: int, engine_view: bool) -> int:
    if engine_view:
        return min(blocks, (req.input_length - 1) // TRACE_BLOCK) * TRACE_BLOCK
    return min(blocks * TRACE_BLOCK, req.input_length)


def _stored(req: TraceRequest, engine_view: bool) -> tuple[int, ...]:
    return req.hash_ids[: req.input_length // TRACE_BLOCK] if engine_view else req.hash_ids


def lru_hit_ratio(
    reqs: Sequence[TraceRequest], capacity_blocks: int | None, engine_view: bool = False
) -> float:
    """Hit ratio of one LRU cache of ``capacity_blocks`` (None: infinite) over ``reqs``.

    A request first looks up its longest cached prefix, then touches (inserts or refreshes) its
    blocks in prompt order, evicting the least recently used beyond the capacity."""
    cache: OrderedDict[int, None] = OrderedDict()
    hit = total = 0
    for req in reqs:
        total += req.input_length
        blocks = 0
        for hash_id in req.hash_ids:
            if hash_id not in cache:
                break
            blocks += 1
        hit += _hit_tokens(req, blocks, engine_view)
        for hash_id in _stored(req, engine_view):
            if hash_id in cache:
                cache.move_to_end(hash_id)
            else:
                cache[hash_id] = None
                if capacity_blocks is not None and len(cache) > capacity_blocks:
                    cache.popitem(last=False)
    return hit / total if total else 0.0


def reference(
    reqs: Sequence[TraceRequest], capacity_blocks: int, engine_view: bool = False
) -> Reference:
    """Ideal and pooled-LRU hit ratios of exactly ``reqs``."""
    return Reference(
        ideal=lru_hit_ratio(reqs, None, engine_view),
        pooled_lru=lru_hit_ratio(reqs, capacity_blocks, engine_view),
        capacity_blocks=capacity_blocks, engine_view=engine_view,
    )


def hit_ratio(cached: Iterable[int | None], prompt: Iterable[int]) -> float | None:
    """Σ cached / Σ prompt over requests; None when any cached count is unknown or no tokens."""
    cached_list, prompt_list = list(cached), list(prompt)
    if any(c is None for c in cached_list) or not sum(prompt_list):
        return None
    return sum(c for c in cached_list if c is not None) / sum(prompt_list)


def imbalance(per_engine: Mapping[str, float]) -> float | None:
    """max / mean of per-engine load (1.0 = perfectly even); None when there is no load."""
    if not per_engine:
        return None
    mean = sum(per_engine.values()) / len(per_engine)
    return max(per_engine.values()) / mean if mean > 0 else None


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) by linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def parse_prometheus(text: str, names: Sequence[str]) -> dict[str, float]:
    """Sum of the samples of each metric in ``names`` (labels ignored) in Prometheus text."""
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        metric = line.split("{", 1)[0].split(" ", 1)[0]
        if metric in out:
            out[metric] += float(line.rsplit(" ", 1)[1])
    return out
