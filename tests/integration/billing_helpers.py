"""Shared pieces of the billing integration tests: a price book, API keys, a gateway config with
the ``api-keys`` and ``billing`` plugins, an independent cost formula, and ledger readers."""

from __future__ import annotations

import datetime as dt
import json
import time
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import yaml

from kvgate.middleware.app import KvgateApp
from kvgate.plugins.billing.plugin import Billing
from kvgate.plugins.tenancy.auth import hash_key, new_key
from kvgate.pricing.backends.select import open_backend
from kvgate.pricing.records import LedgerRecord
from tests.integration.conftest import gateway_config

#: Workers AI's Kimi K2.5 prices, USD per million tokens (the issue's reference).
INPUT, CACHED, OUTPUT = Decimal("0.60"), Decimal("0.10"), Decimal("3.00")
MILLION = Decimal(1_000_000)
DISCOUNT = {"globex": Decimal("0.25")}
ALL = (dt.datetime(2000, 1, 1, tzinfo=dt.UTC), dt.datetime(2100, 1, 1, tzinfo=dt.UTC))
PRICES_YAML = """\
models:
  sim-model:
    - effective_from: 2020-01-01
      input_per_mtok: 0.60
      cached_input_per_mtok: 0.10
      output_per_mtok: 3.00
tenants:
  globex: {discount: 0.25}
"""


def expected_cost(prompt: int, cached: int | None, completion: int,
                  tenant: str = "acme") -> Decimal:
    """The issue's formula, written out independently of pricing/cost.py."""
    hit = cached or 0
    gross = ((prompt - hit) * INPUT + hit * CACHED + completion * OUTPUT) / MILLION
    return gross - gross * DISCOUNT.get(tenant, Decimal(0))


@dataclass(frozen=True)
class Keys:
    """Plain-text keys by role; the file only holds their hashes."""

    admin: str  # tenant acme, admin
    user: str  # tenant globex (25 % discount)
    narrow: str  # tenant acme, may only use other-model
    budget: str  # tenant acme, budget 0.00001 USD
    path: Path

    def auth(self, role: str) -> dict[str, str]:
        return {"authorization": f"Bearer {getattr(self, role)}"}


def write_keys(tmp: Path) -> Keys:
    keys = {role: new_key() for role in ("admin", "user", "narrow", "budget")}
    entries = [
        {"id": "acme-admin", "tenant": "acme", "sha256": hash_key(keys["admin"]), "admin": True},
        {"id": "globex-1", "tenant": "globex", "sha256": hash_key(keys["user"])},
        {"id": "acme-narrow", "tenant": "acme", "sha256": hash_key(keys["narrow"]),
         "models": ["other-model"]},
        {"id": "acme-budget", "tenant": "acme", "sha256": hash_key(keys["budget"]),
         "budget_usd": "0.00001"},
    ]
    path = tmp / "keys.yaml"
    path.write_text(yaml.safe_dump({"keys": entries}))
    return Keys(path=path, **keys)


def billing_config(urls: list[str], tmp: Path, keys: Keys, *, ledger: str | None = None,
                   server: dict[str, Any] | None = None, picker: str = "max-score-picker",
                   plugins_before: list[dict[str, Any]] | None = None,
                   **billing: Any) -> dict[str, Any]:
    """``gateway_config(urls)`` with api-keys and billing (SQLite in ``tmp`` by default)."""
    prices = tmp / "prices.yaml"
    prices.write_text(PRICES_YAML)
    params = {"prices": str(prices), "ledger": ledger or f"sqlite://{tmp}/ledger.sqlite",
              "spool": str(tmp / "spool"), **billing}
    data = gateway_config(urls, picker, **({"server": server} if server else {}))
    data["plugins"] = [{"type": "api-keys", "params": {"file": str(keys.path)}},
                       *(plugins_before or []), {"type": "billing", "params": params},
                       {"type": "quotas"}, *data["plugins"]]
    return data


def billing_of(app: KvgateApp) -> Billing:
    plugin = app.pipeline.plugins["billing"]
    assert isinstance(plugin, Billing)
    return plugin


async def ledger_list(app: KvgateApp) -> list[LedgerRecord]:
    """Every committed record in time order (after the spool caught up)."""
    ledger = billing_of(app).ledger
    assert ledger is not None
    assert await ledger.sync(15), "the ledger did not catch up"
    return await ledger.query(*ALL)


async def ledger_rows(app: KvgateApp) -> dict[str, LedgerRecord]:
    """Every committed record by the id the client saw in ``x-request-id`` (its own when it
    sent one, kvgate's otherwise); the test's ids must be unique."""
    rows = await ledger_list(app)
    by_id = {r.client_request_id or r.request_id: r for r in rows}
    assert len(by_id) == len(rows), "a test reused a client request id"
    return by_id


def final_ledger_rows(ledger: Path, ids: list[str], limit_s: float = 10.0, *,
                      by: str = "client_request_id", final: bool = True,
                      ) -> dict[str, LedgerRecord]:
    """The final rows of the SQLite ``ledger`` by client request id (``by``: another id
    field, e.g. ``request_id``, a deferred job's id), for ``ids``, waiting for the writer.
    Billing writes each request twice under one id: an early record before the answer ends
    (no ``ttft_s`` yet), replaced by the final one when the dispatch completes, after the
    client has its answer (and the writer batches): reading between the two races. ``final``
    False: any row counts."""
    deadline = time.monotonic() + limit_s
    while True:
        backend = open_backend(f"sqlite://{ledger}")
        try:
            rows = {str(getattr(r, by)): r for r in backend.query(*ALL)
                    if getattr(r, by) in ids and (r.ttft_s is not None or not final)}
        finally:
            backend.close()
        if len(rows) == len(ids) or time.monotonic() > deadline:
            assert sorted(rows) == sorted(ids)
            return rows
        time.sleep(0.1)


def sse_events(text: str) -> list[Any]:
    out: list[Any] = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def long_chat(turn: int = 0, *, stream: bool = False, include_usage: bool | None = None,
              max_tokens: int = 5) -> dict[str, Any]:
    """A chat whose system prompt spans many KV blocks (a cache hit from the second call)."""
    body: dict[str, Any] = {
        "model": "sim-model", "max_tokens": max_tokens, "stream": stream,
        "messages": [{"role": "system", "content": "You are a billing test. " * 60},
                     {"role": "user", "content": f"question {turn}"}]}
    if include_usage is not None:
        body["stream_options"] = {"include_usage": include_usage}
    return body
