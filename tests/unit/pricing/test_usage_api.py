"""The OpenAI Usage-API shape: query parsing, buckets and pages, and agreement between the
pure aggregation and SQLite's (the same check runs against PostgreSQL in test_postgres)."""

from __future__ import annotations

import asyncio
import datetime as dt
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from kvgate.pricing.backends.base import LedgerBackend
from kvgate.pricing.backends.select import open_backend
from kvgate.pricing.ledger import Ledger
from kvgate.pricing.records import LedgerRecord
from kvgate.pricing.usage_api import (
    RESULT_OBJECT,
    UsageQuery,
    UsageQueryError,
    aggregate,
    build_page,
    page_bounds,
    parse_usage_params,
    usage_page,
)
from tests.unit.pricing.helpers import T0, random_records, record

DAY = 86400
START = int(T0.timestamp()) - int(T0.timestamp()) % DAY  # 2026-03-01T00:00Z


PARAMS = [
    ({"start_time": ["100"]}, UsageQuery(100, 999)),
    ({"start_time": ["100"], "end_time": ["200"], "bucket_width": ["1m"],
      "group_by": ["model,project_id"], "limit": ["5"]},
     UsageQuery(100, 200, "1m", ("model", "project_id"), 5)),
    ({"start_time": ["0"], "group_by[]": ["api_key_id"], "models": ["a", "b"],
      "project_ids": ["t1"], "api_key_ids": ["k1,k2"]},
     UsageQuery(0, 999, group_by=("api_key_id",), models=("a", "b"), project_ids=("t1",),
                api_key_ids=("k1", "k2"))),
]


@pytest.mark.parametrize(("params", "want"), PARAMS)
def test_parse_usage_params(params: dict[str, list[str]], want: UsageQuery) -> None:
    assert parse_usage_params(params, now=999) == want


PARAM_ERRORS = [
    ({}, "start_time"),
    ({"start_time": ["x"]}, "start_time"),
    ({"start_time": ["10"], "end_time": ["5"]}, "start_time"),
    ({"start_time": ["0"], "bucket_width": ["1w"]}, "bucket_width"),
    ({"start_time": ["0"], "bucket_width": ["1h"], "limit": ["169"]}, "limit"),
    ({"start_time": ["0"], "limit": ["0"]}, "limit"),
    ({"start_time": ["0"], "group_by": ["user_id"]}, "group_by"),
    ({"start_time": ["0"], "page": ["garbage"]}, "page"),
    ({"start_time": ["0"], "page": ["86401"]}, "page"),
]


@pytest.mark.parametrize(("params", "param"), PARAM_ERRORS)
def test_bad_usage_params_name_the_parameter(params: dict[str, list[str]], param: str) -> None:
    with pytest.raises(UsageQueryError) as info:
        parse_usage_params(params, now=10 * DAY)
    assert info.value.param == param


def test_pages_walk_aligned_buckets() -> None:
    q = UsageQuery(START + 3600, START + 10 * DAY, "1d", limit=3)
    seen, pages = [], 0
    page: str | None = None
    while True:
        out = build_page([], UsageQuery(q.start_time, q.end_time, "1d", limit=3, page=page))
        pages += 1
        seen += [(b["start_time"], b["end_time"]) for b in out["data"]]
        if not out["has_more"]:
            assert out["next_page"] is None
            break
        page = out["next_page"]
    assert pages == 4
    assert seen == [(START + i * DAY, START + (i + 1) * DAY) for i in range(10)]
    assert page_bounds(q) == (START + 3600, START + 3 * DAY)


def test_page_shape_matches_openai() -> None:
    records = [record("a", cached=800), record("b", cached=None),
               record("c", cached=None, estimate=300),
               record("d", ts=T0 + dt.timedelta(days=1), model="llama", key_id="k2")]
    page = usage_page(records, START, START + 2 * DAY, "1d", ["model"])
    assert set(page) == {"object", "data", "has_more", "next_page"}
    assert (page["object"], page["has_more"], page["next_page"]) == ("page", False, None)
    first, second = page["data"]
    assert set(first) == {"object", "start_time", "end_time", "results"}
    assert (first["object"], first["start_time"], first["end_time"]) == (
        "bucket", START, START + DAY)
    [result] = first["results"]
    assert result == {
        "object": RESULT_OBJECT, "input_tokens": 3000, "output_tokens": 300,
        "input_cached_tokens": 1100, "input_audio_tokens": 0, "output_audio_tokens": 0,
        "num_model_requests": 3, "project_id": None, "user_id": None, "api_key_id": None,
        "model": "kimi-k2.5", "batch": None,
        "kvgate": {"cost_usd": "0.0021500000", "input_cache_write_tokens": 0,
                   "cached_unknown_requests": 1, "cached_estimated_requests": 1}}
    assert [r["model"] for r in second["results"]] == ["llama"]


def _naive(records: list[LedgerRecord], q: UsageQuery) -> dict[tuple[object, ...], tuple[
        int, int, int, Decimal]]:
    """The sums the slow, obvious way: (bucket, model, key, tenant) -> (in, cached, n, $)."""
    out: dict[tuple[object, ...], tuple[int, int, int, Decimal]] = {}
    starts, _ = q.window()
    for r in records:
        t = r.ts.timestamp()
        if not q.start_time <= t < q.end_time or (q.models and r.model not in q.models):
            continue
        bucket = int(t) // q.width_s * q.width_s
        if bucket not in starts:
            continue
        key = (bucket, r.model if "model" in q.group_by else None,
               r.key_id if "api_key_id" in q.group_by else None,
               r.tenant if "project_id" in q.group_by else None)
        a, b, n, c = out.get(key, (0, 0, 0, Decimal(0)))
        out[key] = (a + r.prompt_tokens, b + (r.cached_tokens or 0), n + 1, c + r.cost_total)
    return out


def _flat(page: dict[str, Any]) -> dict[tuple[object, ...], tuple[int, int, int, Decimal]]:
    out: dict[tuple[object, ...], tuple[int, int, int, Decimal]] = {}
    for bucket in page["data"]:
        for r in bucket["results"]:
            key = (bucket["start_time"], r["model"], r["api_key_id"], r["project_id"])
            out[key] = (r["input_tokens"], r["input_cached_tokens"], r["num_model_requests"],
                        Decimal(r["kvgate"]["cost_usd"]))
    return out


GROUPINGS = [(), ("model",), ("api_key_id", "project_id"), ("model", "api_key_id", "project_id")]
QUERIES = [UsageQuery(START, START + 3 * DAY, "1d", g, 31) for g in GROUPINGS] + [
    UsageQuery(START + 7200, START + DAY, "1h", ("model",), 168),
    UsageQuery(START + 600, START + 3 * DAY, "1h", (), 10, page=str(START + 3600 * 5)),
    UsageQuery(START, START + 7200, "1m", ("project_id",), 1440, models=("llama-3-8b",)),
    UsageQuery(START, START + 3 * DAY, "1d", ("model",), project_ids=("acme",),
               api_key_ids=("k2",)),
]


def check_backend_agrees(backend: LedgerBackend, records: list[LedgerRecord]) -> None:
    """``backend`` (already holding ``records``) aggregates exactly like the pure function
    and like a naive sum."""
    for q in QUERIES:
        low, high = page_bounds(q)
        ours = build_page(backend.usage_rows(q, low, high), q)
        pure = build_page(aggregate(records, q, low, high), q)
        assert ours == pure, q
        if not (q.project_ids or q.api_key_ids):
            assert _flat(ours) == _naive(records, q)


def test_sqlite_aggregation_agrees(tmp_path: Path) -> None:
    records = random_records(seed=3, n=2000)
    backend = open_backend(f"sqlite://{tmp_path / 'l.sqlite'}")
    for i in range(0, len(records), 300):
        backend.write(records[i:i + 300])
    check_backend_agrees(backend, records)
    spend = backend.spend_by_key()
    assert spend == {k: sum((r.cost_total for r in records if r.key_id == k), Decimal(0))
                     for k in ("k1", "k2")}
    tenants = {r.tenant for r in records}
    assert backend.spend_by_tenant() == {
        t: sum((r.cost_total for r in records if r.tenant == t), Decimal(0)) for t in tenants}
    assert len(list(backend.iter_records(T0, T0 + dt.timedelta(days=1), batch=7))) == len(
        [r for r in records if r.ts < T0 + dt.timedelta(days=1)])
    backend.close()


def test_ledger_usage_page(tmp_path: Path) -> None:
    records = random_records(seed=4, n=300)

    async def go() -> None:
        ledger = Ledger(open_backend(f"sqlite://{tmp_path / 'l.sqlite'}"), tmp_path / "spool",
                        batch_interval_s=0.001)
        await ledger.start()
        for r in records:
            await ledger.submit(r)
        assert await ledger.sync(10)
        q = UsageQuery(START, START + 3 * DAY, "1d", ("model",))
        assert await ledger.usage_page(q) == usage_page(records, START, START + 3 * DAY, "1d",
                                                        ["model"])
        assert len(await ledger.query(START_DT, START_DT + dt.timedelta(days=9), limit=5)) == 5
        await ledger.stop()

    asyncio.run(go())


START_DT = dt.datetime.fromtimestamp(START, tz=dt.UTC)
