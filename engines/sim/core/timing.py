"""Duration of one continuous-batching step (seconds of an H100, before ``time_scale``).

A step runs every scheduled sequence's chunk in one forward pass. A chunk is ``new`` tokens of
one sequence whose first ``context`` tokens already have KV (a cached prefix, earlier prefill
chunks, or for a decode step the whole sequence so far, with ``new == 1``). The model::

    step = step_overhead
         + prefill_overhead                              if any chunk has new > 1
         + max(weight_read, prefill_s_per_token * Σ new)  GEMMs: memory- then compute-bound
         + attention_s_per_pair * Σ (new * context + new² / 2)   causal attention compute
         + kv_read_s_per_token * Σ context                reading every context's KV

So a prefill costs by its uncached tokens (linear) and their attention (quadratic, plus linear
in the cached prefix), decode steps cost the weight read plus the KV of every running context,
and both grow with concurrent load. Constants and their calibration: :class:`TimingParams`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvgate.engines.sim.core.config import TimingParams


@dataclass(frozen=True, slots=True)
class Chunk:
    """One sequence's share of a step: ``new`` tokens computed over ``context`` cached ones."""

    new: int
    context: int


class TimingModel:
    """Step durations from :class:`TimingParams`. Pure: no clock, no state."""

    def __init__(self, params: TimingParams) -> None:
        self.params = params

    def step_seconds(self, chunks: Iterable[Chunk]) -> float:
        """Modelled duration of a step that runs ``chunks``; 0.0 for an empty step."""
        p = self.params
        tokens = 0
        pairs = 0.0
        context = 0
        prefill = False
        for c in chunks:
            tokens += c.new
            pairs += c.new * c.context + c.new * c.new / 2
            context += c.context
            prefill = prefill or c.new > 1
        if tokens == 0:
            return 0.0
        return (
            p.step_overhead_s
            + (p.prefill_overhead_s if prefill else 0.0)
            + max(p.weight_read_s, p.prefill_s_per_token * tokens)
            + p.attention_s_per_pair * pairs
            + p.kv_read_s_per_token * context
        )

    def prefill_seconds(self, prompt_tokens: int, cached_tokens: int = 0) -> float:
        """A lone prompt's prefill in one step (no chunking), e.g. for calibration checks."""
        return self.step_seconds([Chunk(prompt_tokens - cached_tokens, cached_tokens)])

    def decode_step_seconds(self, contexts: Iterable[int]) -> float:
        """A decode-only step of sequences at the given context lengths."""
        return self.step_seconds(Chunk(1, c) for c in contexts)
