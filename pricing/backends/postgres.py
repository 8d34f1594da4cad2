"""``postgresql://user[:password]@host[:port]/db``: the shared ledger of a multi-replica
deployment (psycopg 3: ``pip install 'kvgate[postgres]'``).

``ts`` is TIMESTAMPTZ, money NUMERIC (exact, summed exactly), tokens BIGINT. The connection is
opened on first use and dropped after any connection-level error, so the next retry reconnects
(a database restarted under a running gateway only delays writes). Error messages never carry
the URL (it may hold a password).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator, Sequence
from decimal import Decimal
from typing import Any

import psycopg

from kvgate.pricing.backends.base import (
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
from kvgate.pricing.records import COLUMNS, LedgerRecord
from kvgate.pricing.usage_api import UsageQuery, UsageRow

Conn = psycopg.Connection[tuple[Any, ...]]


def _classify(exc: psycopg.Error) -> Exception:
    message = f"postgresql: {type(exc).__name__}: {str(exc).strip()[:300]}"
    if isinstance(exc, (psycopg.DataError, psycopg.IntegrityError)):
        return LedgerRejected(message)
    return LedgerUnavailable(message)


def _from_row(row: Sequence[Any]) -> LedgerRecord:
    return LedgerRecord.from_dict(dict(zip(COLUMNS, row, strict=True)))


class PostgresBackend:
    """See the module docstring. ``connect_timeout_s``: how long a connection attempt waits."""

    def __init__(self, url: str, connect_timeout_s: float = 5.0) -> None:
        self._url = url
        self.connect_timeout_s = connect_timeout_s
        self._conn = LazyConnection(self._open, psycopg.Error, _classify, chain=False)

    def _connect(self, autocommit: bool = True) -> Conn:
        return psycopg.connect(self._url, autocommit=autocommit,
                               connect_timeout=max(1, round(self.connect_timeout_s)))

    def _open(self) -> Conn:
        db = self._connect()
        for sql in [*create_table_sql("postgresql"), *add_columns_sql("postgresql")]:
            db.execute(sql)
        return db

    def write(self, records: Sequence[LedgerRecord]) -> None:
        rows = [tuple(getattr(r, c) for c in COLUMNS) for r in records]

        def work(db: Conn) -> None:
            with db.transaction(), db.cursor() as cur:
                cur.executemany(upsert_sql("%s"), rows)

        self._conn.run(work)

    def query(self, since: dt.datetime, until: dt.datetime,
              limit: int | None = None) -> list[LedgerRecord]:
        sql = select_sql("%s", limit=True)
        rows = self._conn.run(lambda db: db.execute(sql, (since, until, limit)).fetchall())
        return [_from_row(r) for r in rows]

    def iter_records(self, since: dt.datetime, until: dt.datetime,
                     batch: int = 1000) -> Iterator[LedgerRecord]:
        """Streams through a server-side cursor on its own connection."""
        sql = select_sql("%s")
        try:
            db = self._connect(autocommit=False)
        except psycopg.Error as exc:
            raise _classify(exc) from None
        try:
            with db.cursor(name="kvgate_export") as cur:
                cur.itersize = batch
                cur.execute(sql, (since, until))
                yield from (_from_row(r) for r in cur)
        except psycopg.Error as exc:
            raise _classify(exc) from None
        finally:
            db.close()

    def usage_rows(self, q: UsageQuery, start: int, end: int) -> list[UsageRow]:
        bucket = f"(floor(extract(epoch from ts) / {q.width_s}) * {q.width_s})::bigint"
        sql, params = usage_sql(q, bucket, "SUM", "%s")
        args = [_at(start), _at(end), *params]
        rows = self._conn.run(lambda db: db.execute(sql, args).fetchall())
        return [usage_row(r) for r in rows]

    def spend_by_key(self, since: dt.datetime | None = None) -> dict[str, Decimal]:
        return self._spend_by("key_id", since)

    def spend_by_tenant(self, since: dt.datetime | None = None) -> dict[str, Decimal]:
        return self._spend_by("tenant", since)

    def _spend_by(self, column: str, since: dt.datetime | None) -> dict[str, Decimal]:
        sql = f"SELECT {column}, SUM(cost_total) FROM {TABLE} WHERE ts >= %s GROUP BY {column}"
        start = since if since is not None else _at(0)
        rows = self._conn.run(lambda db: db.execute(sql, (start,)).fetchall())
        return {str(k): Decimal(str(v)) for k, v in rows}

    def close(self) -> None:
        self._conn.close()


def _at(seconds: int) -> dt.datetime:
    return dt.datetime.fromtimestamp(seconds, tz=dt.UTC)
