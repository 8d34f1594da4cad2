"""What a quota store is asked and what it answers: scopes, asks, verdicts, settlements.

Money crosses the store boundary as integer *units* of 1e-10 USD (the ledger's quantum,
pricing/cost.py), so Redis adds them with ``HINCRBY`` exactly; ``Decimal`` everywhere else.
Token buckets hold ``limit`` tokens and refill ``limit`` per 60 s, continuously.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Protocol

#: 1 unit = 1e-10 USD (billing quantizes each cost line to this).
UNITS_PER_USD = Decimal(10) ** 10
#: Token buckets refill their whole capacity over this window (limits are per minute).
WINDOW_MS = 60_000
#: Bucket dimensions: requests, input tokens, output tokens.
DIMENSIONS = ("requests", "input_tokens", "output_tokens")


def to_units(usd: Decimal) -> int:
    """USD -> integer units, rounded up (a reservation never undercounts)."""
    return int((usd * UNITS_PER_USD).to_integral_value(rounding="ROUND_CEILING"))


def to_usd(units: int) -> Decimal:
    return Decimal(units) / UNITS_PER_USD


@dataclass(frozen=True, slots=True)
class ScopeLimits:
    """One scope's limits (0: none on that dimension; budget -1: none), store-ready."""

    scope: str  # "key:<id>" or "tenant:<name>"
    requests_per_min: int = 0
    input_tokens_per_min: int = 0
    output_tokens_per_min: int = 0
    max_concurrent: int = 0
    budget_units: int = -1

    @property
    def bucket_limits(self) -> tuple[int, int, int]:
        return (self.requests_per_min, self.input_tokens_per_min, self.output_tokens_per_min)

    @property
    def has_budget(self) -> bool:
        return self.budget_units >= 0

    @property
    def needs_lease(self) -> bool:
        """In-flight requests are tracked (concurrency, or budget reservations)."""
        return self.max_concurrent > 0 or self.has_budget


@dataclass(frozen=True, slots=True)
class Ask:
    """One request's admission: what it reserves in every scope it belongs to."""

    request_id: str
    scopes: tuple[ScopeLimits, ...]
    input_tokens: int
    output_tokens: int
    cost_units: int  # worst-case cost (0: unpriced)
    lease_ms: int  # a lease not settled by then is released by the store (crash safety)

    @property
    def amounts(self) -> tuple[int, int, int]:
        return (1, self.input_tokens, self.output_tokens)


@dataclass(frozen=True, slots=True)
class Quota:
    """One bucket as the response headers show it (after this request's reservation)."""

    limit: int
    remaining: int
    reset_ms: int  # until the bucket is full again


@dataclass(frozen=True, slots=True)
class Verdict:
    """Admitted (``ok``), or refused on ``dimension`` of ``scope`` (retry after ``retry_ms``).

    ``dimension``: requests, input_tokens, output_tokens, concurrent, budget.
    """

    ok: bool
    scope: str = ""
    dimension: str = ""
    retry_ms: int = 0
    requests: Quota | None = None
    tokens: Quota | None = None


@dataclass(frozen=True, slots=True)
class Settlement:
    """What the request really used (``cost_units``: its ledger cost)."""

    input_tokens: int
    output_tokens: int
    cost_units: int


@dataclass(slots=True)
class Bucket:
    """A token bucket: ``level`` tokens at ``at_ms`` (may be negative: debt from real usage
    above the reservation, paid back by the refill)."""

    level: float
    at_ms: int

    def refill(self, limit: int, now_ms: int) -> float:
        self.level = min(float(limit), self.level + (now_ms - self.at_ms) * limit / WINDOW_MS)
        self.at_ms = now_ms
        return self.level


def wait_ms(level: float, need: int, limit: int) -> int:
    """How long until a bucket at ``level`` holds ``need`` (capped at its limit)."""
    short = min(need, limit) - level
    return 0 if short <= 0 else math.ceil(short * WINDOW_MS / limit)


def full_in_ms(level: float, limit: int) -> int:
    return max(0, math.ceil((limit - level) * WINDOW_MS / limit))


def tightest(quotas: list[Quota]) -> Quota | None:
    """The quota with the smallest remaining fraction (what the headers report)."""
    return min(quotas, key=lambda q: q.remaining / q.limit, default=None)


class QuotaStore(Protocol):
    """Where quota and budget state lives (in-process, or Redis shared by replicas)."""

    async def admit(self, ask: Ask, now_ms: int) -> Verdict: ...

    async def settle(self, ask: Ask, used: Settlement, now_ms: int) -> None: ...

    async def seed(self, spent_units: dict[str, int]) -> None:
        """Set each scope's spend unless the store has it already (SET NX semantics)."""
        ...


@dataclass(slots=True)
class StoreStats:
    admitted: int = 0
    rejected: dict[tuple[str, str], int] = field(default_factory=dict)  # (dimension, scope kind)

    def reject(self, dimension: str, scope: str) -> None:
        key = (dimension, scope.partition(":")[0])
        self.rejected[key] = self.rejected.get(key, 0) + 1
