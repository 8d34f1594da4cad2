"""``sqlite:///path``: the embedded ledger (one file, WAL journal).

``synchronous=FULL``: each batch's commit is fsync'd, because the spool in front deletes its
copy of a batch once the commit returns -- with ``NORMAL`` a power cut could lose a batch that
both the spool and the WAL had let go. (It costs one fsync per batch, not per record.)
``ts`` is stored as integer microseconds since the epoch (UTC), money as exact decimal text,
summed with a Decimal aggregate registered on the connection.
"""

from __future__ import annotations

import datetime as dt
import sqlite3
from collections.abc import Iterator, Sequence
from decimal import Decimal
from pathlib import Path
from typing import Any, cast

from kvgate.pricing.backends.base import (
    EPOCH,
    TABLE,
    LazyConnection,
    LedgerRejected,
    LedgerUnavailable,
    add_columns_sql,
    create_table_sql,
    select_sql,
    upsert_sql,
    usage_row,
    usage_sql,
)
from kvgate.pricing.money import ZERO, exact_sum, money_str
from kvgate.pricing.records import COLUMNS, DECIMAL_FIELDS, LedgerRecord
from kvgate.pricing.usage_api import UsageQuery, UsageRow

_US = dt.timedelta(microseconds=1)


def to_us(t: dt.datetime) -> int:
    """Microseconds since the epoch (a naive time is taken as UTC)."""
    return ((t if t.tzinfo else t.replace(tzinfo=dt.UTC)) - EPOCH) // _US


class _DecimalSum:
    """``decsum(text)``: the exact sum of decimal strings, as a decimal string."""

    def __init__(self) -> None:
        self.total = ZERO

    def step(self, value: str | None) -> None:
        if value is not None:
            self.total = exact_sum([self.total, Decimal(value)])

    def finalize(self) -> str:
        return money_str(self.total)


def _to_row(r: LedgerRecord) -> tuple[Any, ...]:
    out: list[Any] = []
    for name in COLUMNS:
        value = getattr(r, name)
        if name == "ts":
            value = to_us(value)
        elif name in DECIMAL_FIELDS:
            value = money_str(value)
        elif name == "priced":
            value = int(value)
        out.append(value)
    return tuple(out)


def _from_row(row: Sequence[Any]) -> LedgerRecord:
    data = dict(zip(COLUMNS, row, strict=True))
    data["ts"] = EPOCH + data["ts"] * _US
    return LedgerRecord.from_dict(data)


def _classify(exc: sqlite3.Error) -> Exception:
    if isinstance(exc, (sqlite3.IntegrityError, sqlite3.DataError)):
        return LedgerRejected(f"sqlite: {exc}")
    return LedgerUnavailable(f"sqlite: {exc}")


class SqliteBackend:
    """See the module docstring. ``busy_timeout_s``: how long a write waits for a lock held by
    another connection before the batch is retried later."""

    def __init__(self, path: str, busy_timeout_s: float = 5.0) -> None:
        self.path = path
        self.busy_timeout_s = busy_timeout_s
        self._conn = LazyConnection(self._connect, sqlite3.Error, _classify, chain=True)

    def _connect(self) -> sqlite3.Connection:
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, timeout=self.busy_timeout_s, isolation_level=None,
                             check_same_thread=False)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            for sql in create_table_sql("sqlite"):
                db.execute(sql)
            existing = {row[1] for row in db.execute(f"PRAGMA table_info({TABLE})")}
            for sql in add_columns_sql("sqlite", existing):
                db.execute(sql)
            db.create_aggregate("decsum", 1, cast(Any, _DecimalSum))  # typeshed: int-only
        except sqlite3.Error:
            db.close()
            raise
        return db

    def write(self, records: Sequence[LedgerRecord]) -> None:
        rows = [_to_row(r) for r in records]

        def work(db: sqlite3.Connection) -> None:
            db.execute("BEGIN IMMEDIATE")
            try:
                db.executemany(upsert_sql("?"), rows)
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise

        self._conn.run(work)

    def query(self, since: dt.datetime, until: dt.datetime,
              limit: int | None = None) -> list[LedgerRecord]:
        sql = select_sql("?", limit=True)
        args = (to_us(since), to_us(until), -1 if limit is None else limit)
        rows = self._conn.run(lambda db: db.execute(sql, args).fetchall())
        return [_from_row(r) for r in rows]

    def iter_records(self, since: dt.datetime, until: dt.datetime,
                     batch: int = 1000) -> Iterator[LedgerRecord]:
        """Streams from its own read-only connection (WAL: readers never block the writer)."""
        uri = f"{Path(self.path).resolve().as_uri()}?mode=ro"
        try:
            db = sqlite3.connect(uri, uri=True, timeout=self.busy_timeout_s)
        except sqlite3.Error as exc:
            raise LedgerUnavailable(f"sqlite: {exc}") from exc
        try:
            cur = db.execute(select_sql("?"), (to_us(since), to_us(until)))
            while rows := cur.fetchmany(batch):
                yield from (_from_row(r) for r in rows)
        except sqlite3.Error as exc:
            raise LedgerUnavailable(f"sqlite: {exc}") from exc
        finally:
            db.close()

    def usage_rows(self, q: UsageQuery, start: int, end: int) -> list[UsageRow]:
        width_us = q.width_s * 1_000_000
        sql, params = usage_sql(q, f"(ts / {width_us}) * {q.width_s}", "decsum", "?")
        args = [start * 1_000_000, end * 1_000_000, *params]
        rows = self._conn.run(lambda db: db.execute(sql, args).fetchall())
        return [usage_row(r) for r in rows]

    def spend_by_key(self, since: dt.datetime | None = None) -> dict[str, Decimal]:
        return self._spend_by("key_id", since)

    def spend_by_tenant(self, since: dt.datetime | None = None) -> dict[str, Decimal]:
        return self._spend_by("tenant", since)

    def _spend_by(self, column: str, since: dt.datetime | None) -> dict[str, Decimal]:
        sql = f"SELECT {column}, decsum(cost_total) FROM {TABLE} WHERE ts >= ? GROUP BY {column}"
        start = 0 if since is None else to_us(since)
        rows = self._conn.run(lambda db: db.execute(sql, (start,)).fetchall())
        return {str(k): Decimal(v) for k, v in rows}

    def close(self) -> None:
        self._conn.close()
