"""The usage ledger's record: one per request that reached an engine.

Token fields follow OpenAI semantics (``prompt_tokens`` includes ``cached_tokens`` and
``cache_write_tokens``). ``cached_tokens`` is the engine-reported count (``cached_source``
``reported``), the routing estimate that was billed as cached (``estimated``), or ``None`` when
nothing is known (``unknown``: billed as uncached). Money fields are ``Decimal`` USD, quantized
to 1e-10, and always add up: ``cost_total = input + cached_input + cache_write + output -
discount``. Records are validated on construction, so nothing malformed reaches the spool.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass, fields
from decimal import Decimal
from typing import Any

from kvgate.pricing.cost import Cost
from kvgate.pricing.money import QUANTUM, ZERO, money_str

DECIMAL_FIELDS = ("cost_input", "cost_cached_input", "cost_output", "cost_cache_write",
                  "cost_discount", "cost_total")
INT_FIELDS = ("prompt_tokens", "completion_tokens", "cache_write_tokens", "status")
OUTCOMES = ("done", "upstream_error", "client_disconnect")
CACHED_SOURCES = ("reported", "estimated", "unknown")


class RecordError(ValueError):
    """A ledger record that breaks an invariant (the message says which)."""


@dataclass(frozen=True, slots=True)
class LedgerRecord:
    """Tokens, money and timing of one request (see the module docstring)."""

    request_id: str
    ts: dt.datetime
    tenant: str
    key_id: str
    model: str
    engine: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None
    cached_source: str
    cost_input: Decimal
    cost_cached_input: Decimal
    cost_output: Decimal
    cost_cache_write: Decimal
    cost_discount: Decimal
    cost_total: Decimal
    outcome: str
    status: int
    ttft_s: float | None = None
    total_s: float | None = None
    session: str | None = None
    prefill_engine: str | None = None
    priced: bool = True
    cache_write_tokens: int = 0
    #: The client's ``x-request-id``, if it sent one. ``request_id`` is kvgate's own and unique
    #: per request, so a client that reuses an id gets one record (and one bill) per request.
    client_request_id: str | None = None
    #: The pricing tier of a deferred run (``batch``, ``queued``, ``background``); None for
    #: live traffic. Its discount (billing ``tier_discounts``) is part of ``cost_discount``.
    service_tier: str | None = None

    def __post_init__(self) -> None:
        if not self.request_id:
            raise RecordError("request_id must not be empty")
        if self.ts.tzinfo is None:
            raise RecordError(f"{self.request_id}: ts must be timezone-aware")
        object.__setattr__(self, "ts", self.ts.astimezone(dt.UTC))
        self._check_tokens()
        self._check_money()
        if self.outcome not in OUTCOMES:
            raise RecordError(f"{self.request_id}: outcome {self.outcome!r} not in {OUTCOMES}")

    def _check_tokens(self) -> None:
        for name in INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise RecordError(f"{self.request_id}: {name} must be an int >= 0, not {value!r}")
        cached = self.cached_tokens
        if cached is not None and not 0 <= cached <= self.prompt_tokens:
            raise RecordError(f"{self.request_id}: cached_tokens {cached} outside "
                              f"[0, prompt_tokens={self.prompt_tokens}]")
        if self.cached_source not in CACHED_SOURCES:
            raise RecordError(f"{self.request_id}: cached_source {self.cached_source!r} "
                              f"not in {CACHED_SOURCES}")
        if (self.cached_source == "reported" and cached is None) or (
                self.cached_source == "unknown" and cached is not None):
            raise RecordError(f"{self.request_id}: cached_tokens {cached} contradicts "
                              f"cached_source {self.cached_source!r}")

    def _check_money(self) -> None:
        for name in DECIMAL_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, Decimal) or not value.is_finite():
                raise RecordError(f"{self.request_id}: {name} must be a finite Decimal, "
                                  f"not {value!r}")
        lines = (self.cost_input + self.cost_cached_input + self.cost_cache_write
                 + self.cost_output - self.cost_discount)
        if abs(lines - self.cost_total) >= QUANTUM:
            raise RecordError(f"{self.request_id}: cost_total {self.cost_total} != the sum of "
                              f"its breakdown {lines}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready values: ISO-8601 UTC time, money as decimal strings."""
        data = {name: getattr(self, name) for name in COLUMNS}
        data["ts"] = self.ts.isoformat(timespec="microseconds")
        for name in DECIMAL_FIELDS:
            data[name] = money_str(data[name])
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"), ensure_ascii=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LedgerRecord:
        """Inverse of :meth:`to_dict` (also takes native ``datetime``/``Decimal`` values and
        ignores unknown keys, so spools written by a newer kvgate still replay)."""
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        ts = values["ts"]
        values["ts"] = ts if isinstance(ts, dt.datetime) else dt.datetime.fromisoformat(ts)
        for name in DECIMAL_FIELDS:
            values[name] = Decimal(str(values[name]))
        values["priced"] = bool(values.get("priced", True))
        return cls(**values)

    @classmethod
    def from_json(cls, line: str | bytes) -> LedgerRecord:
        return cls.from_dict(json.loads(line))


def cost_fields(c: Cost | None) -> dict[str, Any]:
    """The record's money and cached-token fields from a :class:`~kvgate.pricing.cost.Cost`
    (``None``: unpriced, all zero). ``cached_tokens`` for an unpriced request is the caller's."""
    if c is None:
        return {name: ZERO for name in DECIMAL_FIELDS}
    return {"cost_input": c.input, "cost_cached_input": c.cached_input,
            "cost_output": c.output, "cost_cache_write": c.cache_write,
            "cost_discount": c.discount, "cost_total": c.total,
            "cached_source": c.cached_source.value,
            "cached_tokens": None if c.cached_source == "unknown" else c.cached_tokens}


COLUMNS = tuple(f.name for f in fields(LedgerRecord))
