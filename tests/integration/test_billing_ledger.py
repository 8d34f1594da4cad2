"""The billing ledger through the gateway on SQLite and on a real PostgreSQL server started by
the tests: the Usage API (admin only), ``kvgate usage export`` (CSV and JSONL) and the
Prometheus counters agree with the ledger; the durable spool carries the records across a
database outage while the gateway keeps answering."""

from __future__ import annotations

import asyncio
import csv
import json
import random
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvgate.middleware.cli import main as kvgate_main
from kvgate.pricing.records import LedgerRecord
from tests.integration.billing_helpers import (
    Keys,
    billing_config,
    billing_of,
    expected_cost,
    ledger_rows,
    long_chat,
    write_keys,
)
from tests.integration.conftest import gateway, served, sim_fleet
from tests.pg_server import PgServer, pg_server

ROLES = ("admin", "user")  # tenants acme and globex


@pytest.fixture(scope="module")
def pg() -> Iterator[PgServer]:
    with pg_server() as server:
        yield server


def _ledger_url(kind: str, tmp: Path, request: pytest.FixtureRequest, name: str) -> str:
    if kind == "sqlite":
        return f"sqlite://{tmp}/ledger.sqlite"
    server: PgServer = request.getfixturevalue("pg")
    return server.fresh_db(name)


async def _traffic(client: httpx.AsyncClient, keys: Keys, seed: int, n: int) -> None:
    """``n`` seeded requests: two keys, JSON and streams, repeated and new prefixes."""
    rng = random.Random(seed)
    for i in range(n):
        stream = rng.random() < 0.5
        body = long_chat(rng.randrange(3), stream=stream, max_tokens=rng.randint(1, 12),
                         include_usage=rng.choice([None, True, False]) if stream else None)
        resp = await client.post("/v1/chat/completions", json=body,
                                 headers={**keys.auth(rng.choice(ROLES)),
                                          "x-request-id": f"req-{seed}-{i}"})
        assert resp.status_code == 200, resp.text


def _usage_totals(page: dict[str, Any]) -> dict[tuple[str, str, str], list[Any]]:
    out: dict[tuple[str, str, str], list[Any]] = defaultdict(lambda: [0, 0, 0, 0, Decimal(0)])
    for bucket in page["data"]:
        for r in bucket["results"]:
            acc = out[(r["model"], r["api_key_id"], r["project_id"])]
            for i, key in enumerate(("input_tokens", "input_cached_tokens", "output_tokens",
                                     "num_model_requests")):
                acc[i] += r[key]
            acc[4] += Decimal(r["kvgate"]["cost_usd"])
    return dict(out)


def _ledger_totals(rows: dict[str, LedgerRecord]) -> dict[tuple[str, str, str], list[Any]]:
    out: dict[tuple[str, str, str], list[Any]] = defaultdict(lambda: [0, 0, 0, 0, Decimal(0)])
    for r in rows.values():
        acc = out[(r.model, r.key_id, r.tenant)]
        for i, value in enumerate((r.prompt_tokens, r.cached_tokens or 0, r.completion_tokens,
                                   1, r.cost_total)):
            acc[i] += value
    return dict(out)


def _export(url: str, fmt: str, out: Path) -> list[dict[str, str]]:
    code = kvgate_main(["usage", "export", "--ledger", url, "--since", "2020-01-01",
                        "--until", "2100-01-01", "--format", fmt, "--out", str(out)])
    assert code == 0
    text = out.read_text()
    if fmt == "csv":
        return list(csv.DictReader(text.splitlines()))
    return [json.loads(line) for line in text.splitlines()]


def _metric(text: str, name: str) -> dict[tuple[str, ...], float]:
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                values[tuple(s.labels[k] for k in sorted(s.labels))] = s.value
    return values


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
async def test_usage_api_export_and_metrics_agree(tmp_path: Path, kind: str,
                                                  request: pytest.FixtureRequest) -> None:
    keys = write_keys(tmp_path)
    url = _ledger_url(kind, tmp_path, request, "agree")
    now = int(time.time())
    query = (f"/v1/organization/usage/completions?start_time={now - 3600}&end_time="
             f"{now + 3600}&bucket_width=1h&group_by=model,api_key_id,project_id")
    async with sim_fleet(2) as sims, \
            gateway(billing_config([s.url for s in sims], tmp_path, keys, ledger=url)) \
            as (app, client):
        await _traffic(client, keys, seed=7, n=30)
        rows = await ledger_rows(app)
        page = (await client.get(query, headers=keys.auth("admin"))).json()
        denied = await client.get(query, headers=keys.auth("user"))
        metrics = (await client.get("/metrics", headers=keys.auth("admin"))).text
    assert denied.status_code == 403
    assert len(rows) == 30
    for r in rows.values():
        assert r.cost_total == expected_cost(r.prompt_tokens, r.cached_tokens,
                                             r.completion_tokens, r.tenant)
    assert sum(r.cached_tokens or 0 for r in rows.values()) > 0
    assert _usage_totals(page) == _ledger_totals(rows)
    for fmt in ("csv", "jsonl"):
        exported = _export(url, fmt, tmp_path / f"usage.{fmt}")
        assert sorted(e["client_request_id"] for e in exported) == sorted(rows)
        for e in exported:
            r = rows[e["client_request_id"]]
            assert e["request_id"] == r.request_id != e["client_request_id"]
            assert Decimal(str(e["cost_total"])) == r.cost_total
            assert (int(e["prompt_tokens"]), str(e["cached_tokens"])) == (
                r.prompt_tokens, str(r.cached_tokens))
    tokens = _metric(metrics, "kvgate_billed_tokens_total")  # labels sorted: kind, model, tenant
    money = _metric(metrics, "kvgate_cost_usd_total")
    for tenant in ("acme", "globex"):
        mine = [r for r in rows.values() if r.tenant == tenant]
        assert tokens[("cached", "sim-model", tenant)] == sum(r.cached_tokens or 0 for r in mine)
        assert tokens[("prompt", "sim-model", tenant)] == sum(r.prompt_tokens for r in mine)
        assert tokens[("completion", "sim-model", tenant)] == sum(
            r.completion_tokens for r in mine)
        assert money[("sim-model", tenant)] == pytest.approx(
            float(sum((r.cost_total for r in mine), Decimal(0))), rel=1e-12)


async def test_spool_carries_records_across_a_database_outage(tmp_path: Path,
                                                              pg: PgServer) -> None:
    keys = write_keys(tmp_path)
    url = pg.fresh_db("outage")
    async with sim_fleet(1) as sims, \
            served(billing_config([sims[0].url], tmp_path, keys, ledger=url)) \
            as (app, client):  # through the HTTP front end kvgate serve runs
        ledger = billing_of(app).ledger
        assert ledger is not None
        await _traffic(client, keys, seed=1, n=5)
        assert await ledger.sync(10)
        await asyncio.to_thread(pg.stop)
        try:
            await _traffic(client, keys, seed=2, n=10)  # answered while the database is down
            assert not await ledger.sync(0.5)
            assert await ledger.backlog_bytes() > 0
            assert ledger.stats.db_errors >= 1
        finally:
            await asyncio.to_thread(pg.start)
        rows = await ledger_rows(app)
    assert Counter(r.split("-")[1] for r in rows) == {"1": 5, "2": 10}
    assert all(r.outcome == "done" and r.priced for r in rows.values())
