"""Opening the SQLite ledger on a table of the first schema adds the new columns in place and
keeps the old rows (PostgreSQL: tests/unit/pricing/test_postgres.py)."""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

from kvgate.pricing.backends.base import TABLE, add_columns_sql
from tests.unit.pricing.schema_helpers import check_upgraded, old_row, old_table_sql


def test_sqlite_table_of_the_first_schema_is_upgraded(tmp_path: Path) -> None:
    db = tmp_path / "old.sqlite"
    with contextlib.closing(sqlite3.connect(db)) as conn:
        conn.execute(old_table_sql("sqlite"))
        row = old_row("sqlite")
        conn.execute(f"INSERT INTO {TABLE} VALUES ({', '.join('?' for _ in row)})", row)
        conn.commit()
    check_upgraded(f"sqlite://{db}")


def test_add_columns_sql_only_adds_what_is_missing() -> None:
    assert add_columns_sql("sqlite", {"client_request_id", "service_tier"}) == []
    assert add_columns_sql("sqlite", {"client_request_id"}) == [
        f"ALTER TABLE {TABLE} ADD COLUMN service_tier TEXT"]
    assert add_columns_sql("sqlite", set()) == [
        f"ALTER TABLE {TABLE} ADD COLUMN client_request_id TEXT",
        f"ALTER TABLE {TABLE} ADD COLUMN service_tier TEXT"]
    assert add_columns_sql("postgresql") == [
        f"ALTER TABLE {TABLE} ADD COLUMN IF NOT EXISTS client_request_id TEXT",
        f"ALTER TABLE {TABLE} ADD COLUMN IF NOT EXISTS service_tier TEXT"]
