"""Ledger records: invariants checked on construction, JSON and CSV forms."""

from __future__ import annotations

import dataclasses
import datetime as dt
from decimal import Decimal
from typing import Any

import pytest

from kvgate.pricing.cli import csv_row
from kvgate.pricing.records import COLUMNS, LedgerRecord, RecordError
from tests.unit.pricing.helpers import T0, record


def test_json_round_trip_is_exact() -> None:
    r = record("a", cached=None, estimate=300)
    line = r.to_json()
    assert '"cost_total":"0.0007500000"' in line  # 700x0.6 + 300x0.1 + 100x3 (per M)
    assert LedgerRecord.from_json(line) == r
    assert LedgerRecord.from_json(line.encode()) == r


def test_unknown_fields_are_ignored_on_replay() -> None:
    data = record("a").to_dict() | {"added_in_a_later_version": 1}
    assert LedgerRecord.from_dict(data) == record("a")


def test_time_is_normalized_to_utc() -> None:
    r = record("a", ts=T0.astimezone(dt.timezone(dt.timedelta(hours=9))))
    assert r.ts.tzinfo == dt.UTC
    assert r.ts == T0


def _bad(**changes: Any) -> None:
    dataclasses.replace(record("a"), **changes)


BAD = [
    ({"request_id": ""}, "request_id"),
    ({"ts": dt.datetime(2026, 1, 1)}, "timezone-aware"),
    ({"prompt_tokens": -1}, "prompt_tokens"),
    ({"completion_tokens": 1.5}, "completion_tokens"),
    ({"status": True}, "status"),
    ({"cached_tokens": 5000}, "outside"),
    ({"cached_source": "guessed"}, "cached_source"),
    ({"cached_tokens": None}, "contradicts"),  # reported but None
    ({"outcome": "exploded"}, "outcome"),
    ({"cost_total": 0.1}, "finite Decimal"),
    ({"cost_total": Decimal("NaN")}, "finite Decimal"),
    ({"cost_total": Decimal("1")}, "sum of its breakdown"),
]


@pytest.mark.parametrize(("changes", "message"), BAD, ids=[m for _, m in BAD])
def test_invalid_records_are_refused(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(RecordError, match=message):
        _bad(**changes)


def test_unknown_source_requires_no_count() -> None:
    r = record("a", cached=None)
    assert (r.cached_tokens, r.cached_source) == (None, "unknown")
    with pytest.raises(RecordError, match="contradicts"):
        dataclasses.replace(r, cached_tokens=5)


def test_csv_row() -> None:
    row = dict(zip(COLUMNS, csv_row(record("a", cached=None)), strict=True))
    assert row["cached_tokens"] == ""
    assert row["cached_source"] == "unknown"
    assert row["priced"] == "true"
    assert row["ts"] == "2026-03-01T12:00:00.000000+00:00"
    assert row["cost_cached_input"] == "0.0000000000"
