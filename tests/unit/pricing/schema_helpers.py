"""A ledger table in the schema before :data:`kvgate.pricing.backends.base.ADDED_COLUMNS` existed, to test
that opening a backend on it upgrades it in place."""

from __future__ import annotations

import datetime as dt

from kvgate.pricing.backends.base import ADDED_COLUMNS, TABLE, column_types
from kvgate.pricing.backends.select import open_backend
from kvgate.pricing.records import DECIMAL_FIELDS
from tests.unit.pricing.helpers import record

ALL = (dt.datetime(2000, 1, 1, tzinfo=dt.UTC), dt.datetime(2100, 1, 1, tzinfo=dt.UTC))


def old_table_sql(dialect: str) -> str:
    """``CREATE TABLE`` for the first schema (every current column but the added ones)."""
    cols = ", ".join(f"{n} {t}" for n, t in column_types(dialect) if n not in ADDED_COLUMNS)
    return f"CREATE TABLE {TABLE} ({cols})"


def old_row(dialect: str) -> tuple[object, ...]:
    """One row of the old schema (request id ``old-1``, zero money), in column order."""
    values: dict[str, object] = {
        "request_id": "old-1", "tenant": "acme", "key_id": "k1", "model": "m", "engine": "e0",
        "prompt_tokens": 10, "completion_tokens": 2, "cached_tokens": None,
        "cached_source": "unknown", "outcome": "done", "status": 200, "cache_write_tokens": 0,
    }
    out: list[object] = []
    for name, _ in column_types(dialect):
        if name in ADDED_COLUMNS:
            continue
        if name in values:
            out.append(values[name])
        elif name == "ts":
            out.append("2026-03-01T12:00:00+00:00" if dialect == "postgresql" else
                       1_772_366_400_000_000)
        elif name == "priced":
            out.append(True if dialect == "postgresql" else 1)
        else:
            out.append("0" if name in DECIMAL_FIELDS else None)  # the rest is nullable
    return tuple(out)


def check_upgraded(url: str) -> None:
    """Open the ledger at ``url`` (holding :func:`old_row` in the old schema) twice -- the second
    open, like a second replica's, finds the columns there -- writing and reading a record with
    the new columns; the old row reads back with them null."""
    new = record("new-1", client_request_id="client-7")
    for _ in range(2):
        backend = open_backend(url)
        try:
            backend.write([new])
            got = {r.request_id: r for r in backend.query(*ALL)}
        finally:
            backend.close()
        assert got["old-1"].client_request_id is None and got["old-1"].prompt_tokens == 10
        assert got["new-1"] == new
