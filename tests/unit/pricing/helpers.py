"""Shared builders for the pricing tests (seeded, no I/O)."""

from __future__ import annotations

import datetime as dt
import random
from decimal import Decimal

from kvgate.pricing.cost import TokenCounts, cost
from kvgate.pricing.prices import ModelPrice
from kvgate.pricing.records import LedgerRecord, cost_fields

T0 = dt.datetime(2026, 3, 1, 12, 0, tzinfo=dt.UTC)
KIMI = ModelPrice(input=Decimal("0.60") / 10**6, cached_input=Decimal("0.10") / 10**6,
                  output=Decimal("3.00") / 10**6)


def record(request_id: str, *, ts: dt.datetime = T0, tenant: str = "acme", key_id: str = "k1",
           model: str = "kimi-k2.5", prompt: int = 1000, cached: int | None = 800,
           completion: int = 100, estimate: int | None = None, outcome: str = "done",
           status: int = 200, client_request_id: str | None = None) -> LedgerRecord:
    """A priced record (Kimi K2.5 prices) for ``request_id``."""
    c = cost(TokenCounts(prompt, completion, cached), KIMI, Decimal(0), estimate)
    return LedgerRecord(request_id=request_id, ts=ts, tenant=tenant, key_id=key_id,
                        model=model, engine="e0", prompt_tokens=prompt,
                        completion_tokens=completion, outcome=outcome, status=status,
                        ttft_s=0.05, total_s=0.5, session="s1",
                        client_request_id=client_request_id, **cost_fields(c))


def random_records(seed: int, n: int, span_s: int = 3 * 86400) -> list[LedgerRecord]:
    """``n`` varied records over ``span_s`` seconds from T0 (deterministic for ``seed``)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = rng.randint(1, 20_000)
        kind = rng.random()
        cached = None if kind < 0.2 else rng.randint(0, prompt)
        estimate = rng.randint(0, prompt) if cached is None and kind < 0.1 else None
        out.append(record(
            f"r{seed}-{i}", ts=T0 + dt.timedelta(seconds=rng.uniform(0, span_s)),
            tenant=rng.choice(["acme", "globex", "initech"]), key_id=rng.choice(["k1", "k2"]),
            model=rng.choice(["kimi-k2.5", "llama-3-8b"]), prompt=prompt, cached=cached,
            completion=rng.randint(0, 2000), estimate=estimate,
            client_request_id=rng.choice([None, f"c{i % 7}"])))
    return out
