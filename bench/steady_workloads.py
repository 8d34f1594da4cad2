"""A seeded family of agentic workloads for steady-state routing benchmarks (issue 28).

One *workload* is a few concurrent agent sessions sharing one system+tools prompt: each session
sends growing turns (its whole conversation again plus a new user message) with short replies
and think times; sessions end and new ones start while others run; some sessions spawn a
sub-agent (a short side conversation on the same shared prompt). A *sequence* is several
workloads served one after the other by the same long-running gateway over the same engines,
nothing reset in between: the engines' caches are full of the previous workloads.

Ranges (each workload draws its own from its seed; docs/routing.md, "Steady state"):

| parameter | range | unit |
|---|---|---|
| concurrent sessions | 3-16 | sessions |
| sessions in all | 1.5-3 x concurrent | sessions (the rest start as others end) |
| shared prefix | 200-4,000 | tokens (one per workload; 1 in 3 workloads reuse an earlier one) |
| turns per session | 4-24 | turns |
| turn growth (user message) | 50-600 | tokens |
| reply | 16-512 | tokens |
| think time | 0-5 | seconds |
| sub-agents | 0-30 % of sessions, 2-6 turns | |
| KV per engine | 0.6-2 x the partitioned working set | (the fleet's choice, not the workload's) |

The token ids are abstract (block ids of ``block`` tokens): a request is its chain of block
ids, the shared prefix's first, then the session's own. Engines hold full blocks only.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Iterator
from dataclasses import dataclass, field

RANGES: dict[str, tuple[float, float]] = {
    "concurrent": (3, 16), "sessions_factor": (1.5, 3.0), "shared": (200, 4000),
    "turns": (4, 24), "growth": (50, 600), "reply": (16, 512), "think_s": (0.0, 5.0),
    "sub_agent_share": (0.0, 0.3), "sub_turns": (2, 6),
}


@dataclass(frozen=True, slots=True)
class Request:
    """One turn: the prompt's token count and its full block ids; its session (and whether
    the client sends that session as a header); the reply's tokens."""

    at: float
    session: str
    prompt: int
    blocks: tuple[int, ...]
    reply: int
    #: The blocks of prompt + reply (what the engine caches after answering).
    after: tuple[int, ...]
    index: int  # the session's index in its workload (pinning by index)
    #: The prompt's token ids (what the gateway's tokenizer would give).
    tokens: tuple[int, ...] = ()


@dataclass(slots=True)
class _Session:
    name: str
    index: int
    shared: list[int]  # the shared prefix's token ids
    tokens: list[int]
    turns_left: int
    growth: tuple[int, int]
    reply: tuple[int, int]


@dataclass
class Workload:
    seed: int
    concurrent: int
    sessions: int
    shared_tokens: int
    requests: list[Request] = field(default_factory=list)

    def working_set(self) -> float:
        """Mean over time of the live sessions' footprint [tokens]: the largest prompt+reply
        of each session, summed over the ``concurrent`` sessions alive at once (approx.)."""
        last: dict[str, int] = {}
        for r in self.requests:
            last[r.session] = r.prompt + r.reply
        sizes = sorted(last.values(), reverse=True)
        mean = sum(sizes) / max(1, len(sizes))
        return mean * self.concurrent


class _Tokens:
    """Fresh token ids (unique across the whole sequence: no accidental sharing)."""

    def __init__(self) -> None:
        self.next = 1

    def take(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def _blocks(tokens: list[int], block: int, upto: int) -> tuple[int, ...]:
    """Chain ids of the full blocks of ``tokens[:upto]`` (hash of the whole prefix)."""
    out: list[int] = []
    h = 0
    for i in range(0, upto - block + 1, block):
        h = hash((h, tuple(tokens[i:i + block])))
        out.append(h)
    return tuple(out)


def _draw(rng: random.Random, key: str) -> float:
    lo, hi = RANGES[key]
    return rng.uniform(lo, hi)


def build(seed: int, ids: _Tokens, shared_pool: list[list[int]], name: str,
          block: int) -> Workload:
    """One workload from ``seed`` (its sessions, turns and timings)."""
    rng = random.Random(seed)
    concurrent = round(_draw(rng, "concurrent"))
    total = max(concurrent, int(concurrent * _draw(rng, "sessions_factor")))
    if shared_pool and rng.random() < 1 / 3:
        shared = rng.choice(shared_pool)
    else:
        shared = ids.take(int(_draw(rng, "shared")))
        shared_pool.append(shared)
    lo_g = rng.randint(50, 300)
    growth = (lo_g, rng.randint(lo_g, 600))
    lo_r = rng.randint(16, 128)
    reply = (lo_r, rng.randint(lo_r, 512))
    think = _draw(rng, "think_s")
    sub_share = _draw(rng, "sub_agent_share")
    wl = Workload(seed, concurrent, total, len(shared))
    pending = [_Session(f"{name}-s{i}", i, shared, list(shared),
                        int(_draw(rng, "turns")), growth, reply) for i in range(total)]
    heap: list[tuple[float, int, _Session]] = []
    tie = 0
    for s in pending[:concurrent]:
        heapq.heappush(heap, (rng.uniform(0, 1.0), tie, s))
        tie += 1
    waiting = pending[concurrent:]
    subs = 0
    while heap:
        at, _, s = heapq.heappop(heap)
        s.tokens += ids.take(rng.randint(*s.growth))
        prompt = len(s.tokens)
        out = rng.randint(*s.reply)
        s.tokens += ids.take(out)
        wl.requests.append(Request(at, s.name, prompt, _blocks(s.tokens, block, prompt), out,
                                   _blocks(s.tokens, block, len(s.tokens)), s.index,
                                   tuple(s.tokens[:prompt])))
        s.turns_left -= 1
        nxt = at + rng.uniform(0, think) + 0.05 + out / 2000
        if s.turns_left > 0:
            heapq.heappush(heap, (nxt, tie, s))
            tie += 1
            if "-sub" not in s.name and rng.random() < sub_share / max(1, s.turns_left):
                sub = _Session(f"{s.name}-sub{subs}", s.index, s.shared, list(s.shared),
                               int(_draw(rng, "sub_turns")), s.growth, (16, 128))
                subs += 1
                heapq.heappush(heap, (nxt, tie, sub))
                tie += 1
        elif waiting and "-sub" not in s.name:
            heapq.heappush(heap, (nxt, tie, waiting.pop(0)))
            tie += 1
    return wl


def sequence(seed: int, workloads: int, block: int) -> Iterator[Workload]:
    """``workloads`` consecutive workloads of one seeded family (the sequence's seed)."""
    ids = _Tokens()
    pool: list[list[int]] = []
    rng = random.Random(seed)
    for k in range(workloads):
        yield build(rng.randrange(1 << 30), ids, pool, f"w{k}", block)


__all__ = ["RANGES", "Request", "Workload", "build", "sequence"]
