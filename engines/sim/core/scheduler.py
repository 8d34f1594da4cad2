"""Continuous-batching scheduler of the simulated engine: synchronous, no clock, no I/O.

One engine step is :meth:`Scheduler.schedule` (pick the work, reserve KV blocks) followed, a
modelled duration later, by :meth:`Scheduler.complete` (apply it, sample tokens). It follows
vLLM V1's scheduler:

* A sequence's tokens are its prompt plus what it generated; ``computed`` of them have KV. Each
  step a sequence gets a chunk of ``min(len(tokens) - computed, budget left)`` tokens — a whole
  or partial prefill (chunked prefill), or exactly one token when decoding. When a chunk
  reaches the end of the tokens, the sequence samples one new token.
* Running sequences are served first, in admission order; then waiting ones are admitted first
  come first served while the token budget (``max_num_batched_tokens``), ``max_num_seqs`` and
  free KV blocks allow. No admission in a step that had to preempt.
* Admission looks the prompt's full blocks up in the prefix cache; the hit is at most
  ``len(tokens) - 1`` tokens (the last one is always computed, to sample from), so cached
  counts are multiples of ``block_size``. Only the rest is prefilled.
* Blocks are reserved before a chunk runs; newly full blocks are committed (hashed, cached,
  reported as ``BlockStored``) after it ran. Evictions to make room are ``BlockRemoved``.
* Out of blocks for a running sequence, the most recently admitted one is preempted (vLLM's
  recompute mode): it frees its blocks and goes back to the front of the queue; when
  re-admitted its tokens so far (prompt and output) are prefilled again, mostly from the cache.
* With a shared tier (:mod:`kvgate.engines.sim.core.shared_tier`), admission continues the GPU match
in the
  tier and loads those blocks instead of computing them (counted as cached, like vLLM counts a
  connector's loaded tokens); their load time is :attr:`Scheduler.tier_seconds` of the step.
  Every newly full block is also saved to the tier (write-through), or, with ``write="evicted"``,
  every block the GPU cache evicts.
"""

from __future__ import annotations

import enum
import hashlib
import random
import struct
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvgate.engines.sim.core.config import SimConfig
from kvgate.engines.sim.core.kv_events import BlockRemoved, BlockStored, KvEvent
from kvgate.engines.sim.core.prefix_cache import CacheFull, PrefixCache, chain_hash, root_hash
from kvgate.engines.sim.core.shared_tier import SharedTier
from kvgate.engines.sim.core.timing import Chunk
from kvgate.engines.sim.core.tokenizer import output_piece, piece_id

_MASK64 = (1 << 64) - 1


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class SeqSpec:
    """What a request asks the engine to run.

    ``max_tokens``: completion limit in tokens; ``min_tokens``: no natural stop before it;
    ``ignore_eos``: run to ``max_tokens``; ``seed``: the request's seed, mixed into the text.
    """

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    cache_salt: str | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    seed: int | None = None
    #: Prompt tokens whose KV a prefill engine transferred (decode role): admitted as
    #: computed, beyond the local cache hit, up to all but the last prompt token.
    external_tokens: int = 0


@dataclass(frozen=True, slots=True)
class TokenOut:
    """One sampled token; ``finish_reason`` is set on a sequence's last one."""

    token_id: int
    text: str
    finish_reason: str | None = None


@dataclass(frozen=True, slots=True)
class Planned:
    """One sequence's chunk in a step."""

    seq: SeqState
    new: int
    context: int


@dataclass(slots=True)
class SchedulerStats:
    """Cumulative counters (tokens unless named otherwise), read by ``/metrics``."""

    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prompt_tokens: int = 0
    prompt_tokens_local_compute: int = 0
    prompt_tokens_cache_hit: int = 0
    prompt_tokens_external: int = 0
    prompt_tokens_tier: int = 0  # loaded from the shared tier (part of the cached tokens)
    generation_tokens: int = 0
    preemptions: int = 0
    steps: int = 0
    finished: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0})


def _output_rng(engine_seed: int, spec: SeqSpec) -> random.Random:
    """Deterministic per (engine seed, request seed, prompt) generator of the output text."""
    seeds = struct.pack("<QQ", engine_seed & _MASK64, (spec.seed or 0) & _MASK64)
    tokens = struct.pack(f"<{len(spec.prompt_ids)}I", *spec.prompt_ids)
    digest = hashlib.blake2b(seeds + tokens, digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "big"))


class SeqState:
    """A request inside the scheduler. ``hashes[:held]`` are the cached blocks it references;
    ``private`` more blocks are reserved for it."""

    __slots__ = (
        "cached_tokens", "computed", "external", "finish_reason", "hashes", "held", "natural_len",
        "num_prompt", "private", "rng", "root", "spec", "status", "tokens",
    )

    def __init__(self, spec: SeqSpec, engine_seed: int, natural_len: tuple[int, int]) -> None:
        self.spec = spec
        self.tokens: list[int] = list(spec.prompt_ids)
        self.num_prompt = len(spec.prompt_ids)
        self.computed = 0
        self.hashes: list[int] = []
        self.held = 0
        self.private = 0
        self.root = root_hash(spec.cache_salt)
        self.cached_tokens: int | None = None
        self.external = 0  # tokens loaded from a KV transfer at the first admission
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.rng = _output_rng(engine_seed, spec)
        self.natural_len = self.rng.randint(*natural_len)

    @property
    def request_id(self) -> str:
        return self.spec.request_id

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.num_prompt

    def extend_hashes(self, block_size: int, full_blocks: int) -> None:
        """Hash blocks up to ``full_blocks`` (incrementally; they never change)."""
        while len(self.hashes) < full_blocks:
            j = len(self.hashes)
            parent = self.hashes[-1] if j else self.root
            block = self.tokens[j * block_size : (j + 1) * block_size]
            self.hashes.append(chain_hash(parent, block))

    def sample(self) -> TokenOut:
        """Append the next deterministic token and say whether the sequence is done."""
        text = output_piece(self.rng)
        token = piece_id(text)
        self.tokens.append(token)
        n = self.num_output
        reason: str | None = None
        if not self.spec.ignore_eos and n >= max(self.natural_len, self.spec.min_tokens):
            reason = "stop"
        elif n >= self.spec.max_tokens:
            reason = "length"
        return TokenOut(token, text, reason)


class Scheduler:
    """Waiting queue, running batch and KV blocks of one engine. See the module docstring.

    Bounded: ``running`` ≤ ``max_num_seqs``; ``waiting`` ≤ ``max_waiting_requests`` (checked by
    :meth:`can_accept`); ``events`` grows within a step and is drained by the engine after it.
    """

    def __init__(self, config: SimConfig, tier: SharedTier | None = None) -> None:
        self.config = config
        #: The fleet's shared KV tier, if any (shared with other engines' schedulers).
        self.tier = tier
        #: Seconds the last :meth:`schedule` spends loading blocks from the tier.
        self.tier_seconds = 0.0
        self.block_size = config.block_size
        self.cache = PrefixCache(config.capacity_blocks, config.block_size)
        self.waiting: deque[SeqState] = deque()
        self.running: list[SeqState] = []
        self.stats = SchedulerStats()
        self.events: list[KvEvent] = []
        self._preempted = False  # set by a preemption in the current schedule()

    # ---- queue ------------------------------------------------------------------------------

    def can_accept(self) -> bool:
        return len(self.waiting) < self.config.max_waiting_requests

    def add(self, spec: SeqSpec) -> SeqState:
        seq = SeqState(spec, self.config.seed, self.config.natural_output_len)
        self.waiting.append(seq)
        return seq

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def abort(self, seq: SeqState) -> bool:
        """Remove a sequence wherever it is and free its blocks; False if already finished."""
        if seq.status is Status.WAITING:
            self.waiting.remove(seq)
        elif seq.status is Status.RUNNING:
            self._free(seq)
            self.running.remove(seq)
        else:
            return False
        self._mark_finished(seq, "abort")
        return True

    @property
    def preempted(self) -> bool:
        """Whether the last :meth:`schedule` preempted a sequence."""
        return self._preempted

    def drain_events(self) -> list[KvEvent]:
        events, self.events = self.events, []
        return events

    # ---- one step ---------------------------------------------------------------------------

    def schedule(self) -> list[Planned]:
        """Choose this step's chunks and reserve their blocks."""
        budget = self.config.max_num_batched_tokens
        plan: list[Planned] = []
        self._preempted = False
        self.tier_seconds = 0.0
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            new = min(len(seq.tokens) - seq.computed, budget)
            if not self._reserve(seq, new):
                continue
            plan.append(Planned(seq, new, seq.computed))
            budget -= new
        while self.waiting and budget > 0 and not self._preempted:
            if len(self.running) >= self.config.max_num_seqs:
                break
            planned = self._admit(self.waiting[0], budget)
            if planned is None:
                break
            plan.append(planned)
            budget -= planned.new
        return plan

    def complete(self, plan: Sequence[Planned]) -> list[tuple[SeqState, TokenOut]]:
        """Apply a step's chunks; returns the tokens sampled (finished sequences included)."""
        out: list[tuple[SeqState, TokenOut]] = []
        self.stats.steps += 1
        for p in plan:
            seq = p.seq
            if seq.status is not Status.RUNNING:
                continue  # aborted while the step ran
            seq.computed += p.new
            self._commit_full_blocks(seq)
            if seq.computed < len(seq.tokens):
                continue  # a prefill chunk that did not reach the end
            tok = seq.sample()
            self.stats.generation_tokens += 1
            out.append((seq, tok))
            if tok.finish_reason is not None:
                self._free(seq)
                self.running.remove(seq)
                self._mark_finished(seq, tok.finish_reason)
        return out

    @staticmethod
    def chunks(plan: Sequence[Planned]) -> list[Chunk]:
        """The timing model's view of a plan."""
        return [Chunk(p.new, p.context) for p in plan]

    # ---- internals --------------------------------------------------------------------------

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _allocate(self, n: int) -> None:
        """Reserve blocks; evictions become ``BlockRemoved`` events (one hash each, as vLLM)."""
        for h in self.cache.allocate(n):
            self.events.append(BlockRemoved([h]))
            if self.tier is not None and self.tier.params.write == "evicted":
                self.tier.put([h], None, [])

    def _reserve(self, seq: SeqState, new: int) -> bool:
        """Blocks for ``new`` more tokens of a running sequence, preempting from the back."""
        need = self._blocks_for(seq.computed + new) - seq.held - seq.private
        while True:
            try:
                self._allocate(need)
            except CacheFull:
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    return False
                continue
            seq.private += max(0, need)
            return True

    def _admit(self, seq: SeqState, budget: int) -> Planned | None:
        """Admit the head of the queue with its cached prefix, or None if blocks lack."""
        n = len(seq.tokens)
        seq.extend_hashes(self.block_size, n // self.block_size)
        limit = (n - 1) // self.block_size
        hit = self.cache.match_blocks(seq.hashes[:limit])
        cached = hit * self.block_size
        loaded = 0 if self.tier is None else self.tier.match_blocks(seq.hashes[hit:limit])
        start = cached + loaded * self.block_size
        if seq.cached_tokens is None:  # transferred KV counts at the first admission only
            start = max(start, min(seq.spec.external_tokens, n - 1))
        new = min(n - start, budget)
        need = self._blocks_for(start + new) - hit
        self.cache.acquire(seq.hashes[:hit])  # pinned before allocating evicts anything
        try:
            self._allocate(need)
        except CacheFull:
            self.cache.release(seq.hashes[:hit], 0)
            return None
        seq.held, seq.private, seq.computed = hit, need, start
        self.waiting.popleft()
        self.running.append(seq)
        seq.status = Status.RUNNING
        if self.tier is not None and loaded:
            self.tier_seconds += self.tier.load(seq.hashes[hit : hit + loaded])
        self._count_admission(seq, n, cached, start - cached - loaded * self.block_size,
                              loaded * self.block_size)
        return Planned(seq, new, start)

    def _count_admission(
        self, seq: SeqState, tokens: int, cached: int, external: int, tier: int = 0
    ) -> None:
        s = self.stats
        s.prefix_cache_queries += tokens
        s.prefix_cache_hits += cached
        if seq.cached_tokens is None:  # the first admission is what usage reports
            seq.cached_tokens = cached + external + tier  # vLLM counts loaded KV as cached
            seq.external = external
            s.prompt_tokens += seq.num_prompt
            s.prompt_tokens_cache_hit += cached
            s.prompt_tokens_external += external
            s.prompt_tokens_tier += tier
            s.prompt_tokens_local_compute += seq.num_prompt - cached - external - tier

    def _commit_full_blocks(self, seq: SeqState) -> None:
        """Cache blocks that became full; runs of new ones become ``BlockStored`` events."""
        full = seq.computed // self.block_size
        if full <= seq.held:
            return
        seq.extend_hashes(self.block_size, full)
        run_start: int | None = None
        for j in range(seq.held, full):
            stored = self.cache.commit(seq.hashes[j])
            seq.private -= 1
            if stored and run_start is None:
                run_start = j
            elif not stored and run_start is not None:
                self._stored_event(seq, run_start, j)
                run_start = None
        if run_start is not None:
            self._stored_event(seq, run_start, full)
        if self.tier is not None and self.tier.params.write == "through":
            bs = self.block_size
            self.tier.put(seq.hashes[seq.held : full],
                          seq.hashes[seq.held - 1] if seq.held else None,
                          seq.tokens[seq.held * bs : full * bs])
        seq.held = full

    def _stored_event(self, seq: SeqState, start: int, end: int) -> None:
        """``BlockStored`` for blocks ``[start, end)`` of ``seq``."""
        bs = self.block_size
        salt = seq.spec.cache_salt
        extra: list[tuple[Any, ...] | None] | None = None
        if salt is not None and start == 0:  # vLLM keys the salt into the first block only
            extra = [(salt,)] + [None] * (end - start - 1)
        self.events.append(
            BlockStored(
                block_hashes=seq.hashes[start:end],
                parent_block_hash=seq.hashes[start - 1] if start else None,
                token_ids=seq.tokens[start * bs : end * bs],
                block_size=bs,
                extra_keys=extra,
            )
        )

    def _free(self, seq: SeqState) -> None:
        self.cache.release(seq.hashes[: seq.held], seq.private)
        seq.held = seq.private = 0

    def _preempt(self, seq: SeqState) -> None:
        self._free(seq)
        seq.computed = 0
        seq.status = Status.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.stats.preemptions += 1
        self._preempted = True

    def _mark_finished(self, seq: SeqState, reason: str) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
