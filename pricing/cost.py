"""The cost of one request, with the cached-input discount.

OpenAI semantics: ``prompt_tokens`` *includes* the cached tokens (and, where an engine reports
them, the cache-write tokens), so::

    cost = (prompt - cached - cache_write) x input
         + cached x cached_input + cache_write x cache_write_price + completion x output

then the tenant's discount (a fraction of that gross). LiteLLM computes the same split
(``text_tokens = prompt_tokens - cached_tokens - cache_creation_tokens``), so kvgate's cost
equals ``litellm.completion_cost`` for the same usage and prices (tests/unit/pricing).

``cached`` unknown (``None``: the engine did not report it) is billed as uncached and flagged
``unknown`` -- never silently 0 cached with a "reported" flag -- unless the caller supplies an
estimate (e.g. from the routing index), which is clamped to ``[0, prompt - cache_write]``,
billed at the cached rate and flagged ``estimated``.

Rounding: each line item is quantized to 1e-10 USD (half-even, see pricing/money.py), the
discount is quantized from the sum of the quantized lines, and ``total`` is exactly
``input + cached_input + cache_write + output - discount``, so a breakdown always adds up.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from decimal import Decimal

from kvgate.pricing.money import ZERO, exact_sum, fraction_of, times, usd
from kvgate.pricing.prices import ModelPrice


class CachedSource(enum.StrEnum):
    REPORTED = "reported"
    ESTIMATED = "estimated"
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class TokenCounts:
    """Token usage of one request (OpenAI semantics: ``prompt`` includes ``cached`` and
    ``cache_write``). ``cached`` None: not reported."""

    prompt: int
    completion: int
    cached: int | None = None
    cache_write: int = 0


@dataclass(frozen=True, slots=True)
class Cost:
    """Breakdown in USD (each quantized to 1e-10); ``cached_tokens`` is what was billed at the
    cached rate (0 when unknown)."""

    input: Decimal
    cached_input: Decimal
    output: Decimal
    cache_write: Decimal
    discount: Decimal
    total: Decimal
    cached_tokens: int
    cached_source: CachedSource

    @property
    def gross(self) -> Decimal:
        """The cost before the discount."""
        return self.total + self.discount


def _validate(counts: TokenCounts, discount: Decimal) -> None:
    if min(counts.prompt, counts.completion, counts.cache_write) < 0:
        raise ValueError(f"token counts must be non-negative: {counts}")
    if counts.cache_write > counts.prompt:
        raise ValueError(f"cache-write tokens {counts.cache_write} > prompt {counts.prompt}")
    if counts.cached is not None and not 0 <= counts.cached <= counts.prompt - counts.cache_write:
        raise ValueError(f"cached tokens {counts.cached} outside "
                         f"[0, prompt - cache_write = {counts.prompt - counts.cache_write}]")
    if not ZERO <= discount <= 1:
        raise ValueError(f"discount {discount} outside [0, 1]")


def _cached(counts: TokenCounts, estimate: int | None) -> tuple[int, CachedSource]:
    if counts.cached is not None:
        return counts.cached, CachedSource.REPORTED
    if estimate is not None:
        return min(max(estimate, 0), counts.prompt - counts.cache_write), CachedSource.ESTIMATED
    return 0, CachedSource.UNKNOWN


def cost(counts: TokenCounts, price: ModelPrice, discount: Decimal = ZERO,
         cached_estimate: int | None = None) -> Cost:
    """Price one request.

    Raises ValueError on impossible input: a negative count, ``cached`` (or ``cache_write``)
    beyond the prompt, a discount outside [0, 1].
    """
    _validate(counts, discount)
    cached, source = _cached(counts, cached_estimate)
    uncached = counts.prompt - cached - counts.cache_write
    lines = [usd(times(uncached, price.input)), usd(times(cached, price.cached_input)),
             usd(times(counts.cache_write, price.cache_write_rate)),
             usd(times(counts.completion, price.output))]
    gross = exact_sum(lines)
    off = usd(fraction_of(gross, discount))
    return Cost(input=lines[0], cached_input=lines[1], cache_write=lines[2], output=lines[3],
                discount=off, total=exact_sum([gross, -off]), cached_tokens=cached,
                cached_source=source)
