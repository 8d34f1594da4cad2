"""Ledger storage: the backend interface, the shared schema, and ``open_backend(url)``.

``sqlite:///abs/path`` (embedded default, pricing/backends/sqlite.py) or ``postgresql://...``
(multi-replica, pricing/backends/postgres.py, psycopg 3). Both

* upsert by ``request_id``, **last write wins**: a retried request's final record replaces the
  earlier attempt's, and a spool replay re-applies records in their original order;
* store money exactly (TEXT decimal strings in SQLite, NUMERIC in PostgreSQL) and sum it
  exactly (a Decimal aggregate in SQLite, NUMERIC ``SUM`` in PostgreSQL);
* connect lazily and reconnect after a failure, so a database that is down when the gateway
  starts, or restarts later, only delays the writes (the spool holds them);
* are blocking (called from worker threads, never on the event loop) and thread-safe.

Errors: :class:`LedgerUnavailable` (down, locked, disk full, schema trouble: retry later, the
records stay in the spool) and :class:`LedgerRejected` (this data can never be stored: the
ledger retries record by record and quarantines the culprit).
"""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Callable, Collection, Iterator, Sequence
from decimal import Decimal
from typing import Generic, Protocol, TypeVar

from kvgate.pricing.records import COLUMNS, DECIMAL_FIELDS, LedgerRecord
from kvgate.pricing.usage_api import UsageQuery, UsageRow

TABLE = "kvgate_usage"
EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_INTS = {"prompt_tokens", "completion_tokens", "cached_tokens", "status", "cache_write_tokens"}
_FLOATS = {"ttft_s", "total_s"}
_NULLABLE = {"cached_tokens", "ttft_s", "total_s", "session", "prefill_engine",
             "client_request_id", "service_tier"}
#: Columns added after the ledger's first schema (all nullable): :func:`add_columns_sql` adds
#: them to an existing table in place, so upgrading kvgate needs no manual migration.
ADDED_COLUMNS = ("client_request_id", "service_tier")


class LedgerUnavailable(Exception):
    """The database cannot take the write now (down, locked, disk full): retry later."""


class LedgerRejected(Exception):
    """The database refuses this data for good (e.g. a value it cannot store)."""


class LedgerBackend(Protocol):
    """What the ledger and the export need from a database (all blocking)."""

    def write(self, records: Sequence[LedgerRecord]) -> None:
        """Upsert ``records`` in one transaction (last write wins)."""

    def query(self, since: dt.datetime, until: dt.datetime,
              limit: int | None = None) -> list[LedgerRecord]:
        """Records with ``since <= ts < until`` in time order (at most ``limit``)."""

    def iter_records(self, since: dt.datetime, until: dt.datetime,
                     batch: int = 1000) -> Iterator[LedgerRecord]:
        """Like :meth:`query`, streamed ``batch`` rows at a time (bounded memory)."""

    def usage_rows(self, q: UsageQuery, start: int, end: int) -> list[UsageRow]:
        """Usage-API sums per bucket and group for ``start <= ts < end`` (unix seconds)."""

    def spend_by_key(self, since: dt.datetime | None = None) -> dict[str, Decimal]:
        """Total ``cost_total`` per ``key_id`` (for budgets)."""

    def spend_by_tenant(self, since: dt.datetime | None = None) -> dict[str, Decimal]:
        """Total ``cost_total`` per ``tenant`` (for tenant budgets)."""

    def close(self) -> None: ...


class _Closable(Protocol):
    def close(self) -> None: ...


C = TypeVar("C", bound=_Closable)
E = TypeVar("E", bound=Exception)
T = TypeVar("T")


class LazyConnection(Generic[C, E]):
    """The one connection of a backend: opened by ``connect`` on first use and used under a lock
    (backends are called from worker threads). A driver error (an ``error``) is raised as
    ``classify(error)``; when that is :class:`LedgerUnavailable` the connection is also dropped,
    so the next call reconnects. ``chain``: keep the driver error as the ``__cause__`` (off where
    its text may carry a secret, such as a URL with a password)."""

    def __init__(self, connect: Callable[[], C], error: type[E],
                 classify: Callable[[E], Exception], chain: bool) -> None:
        self._connect = connect
        self._error = error
        self._classify = classify
        self._chain = chain
        self._lock = threading.Lock()
        self._db: C | None = None

    def run(self, work: Callable[[C], T]) -> T:
        """``work(connection)`` under the lock, errors mapped (and the connection dropped)."""
        with self._lock:
            try:
                if self._db is None:
                    self._db = self._connect()
                return work(self._db)
            except self._error as exc:
                mapped = self._classify(exc)
                if isinstance(mapped, LedgerUnavailable):
                    self._drop()
                raise mapped from (exc if self._chain else None)

    def close(self) -> None:
        with self._lock:
            self._drop()

    def _drop(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None


def column_types(dialect: str) -> list[tuple[str, str]]:
    """(column, SQL type) for ``sqlite`` or ``postgresql``, request_id first."""
    pg = dialect == "postgresql"
    out = []
    for name in COLUMNS:
        if name == "request_id":
            sql = "TEXT PRIMARY KEY"
        elif name == "ts":
            sql = "TIMESTAMPTZ" if pg else "INTEGER"  # SQLite: microseconds since the epoch
        elif name in DECIMAL_FIELDS:
            sql = "NUMERIC" if pg else "TEXT"
        elif name in _INTS:
            sql = "BIGINT" if pg else "INTEGER"
        elif name in _FLOATS:
            sql = "DOUBLE PRECISION" if pg else "REAL"
        elif name == "priced":
            sql = "BOOLEAN" if pg else "INTEGER"
        else:
            sql = "TEXT"
        if name not in _NULLABLE and name != "request_id":
            sql += " NOT NULL"
        out.append((name, sql))
    return out


def create_table_sql(dialect: str) -> list[str]:
    cols = ", ".join(f"{n} {t}" for n, t in column_types(dialect))
    return [f"CREATE TABLE IF NOT EXISTS {TABLE} ({cols})",
            f"CREATE INDEX IF NOT EXISTS {TABLE}_ts ON {TABLE} (ts)"]


def add_columns_sql(dialect: str, existing: Collection[str] = ()) -> list[str]:
    """``ALTER TABLE`` statements adding the :data:`ADDED_COLUMNS` an older table lacks.
    PostgreSQL: ``IF NOT EXISTS`` (replicas may race); SQLite lacks that, so the caller passes the
    table's ``existing`` columns and gets only the missing ones."""
    types = dict(column_types(dialect))
    if dialect == "postgresql":
        return [f"ALTER TABLE {TABLE} ADD COLUMN IF NOT EXISTS {n} {types[n]}"
                for n in ADDED_COLUMNS]
    return [f"ALTER TABLE {TABLE} ADD COLUMN {n} {types[n]}"
            for n in ADDED_COLUMNS if n not in existing]


def select_sql(mark: str, limit: bool = False) -> str:
    """Every column of the records with ``since <= ts < until`` in (ts, request_id) order (both
    dialects), placeholders ``mark``; with ``limit``, a third placeholder bounds the count."""
    sql = (f"SELECT {', '.join(COLUMNS)} FROM {TABLE} WHERE ts >= {mark} AND ts < {mark} "
           "ORDER BY ts, request_id")
    return f"{sql} LIMIT {mark}" if limit else sql


def upsert_sql(mark: str) -> str:
    """``INSERT ... ON CONFLICT (request_id) DO UPDATE`` (both dialects), placeholders ``mark``."""
    updates = ", ".join(f"{c} = excluded.{c}" for c in COLUMNS[1:])
    return (f"INSERT INTO {TABLE} ({', '.join(COLUMNS)}) "
            f"VALUES ({', '.join(mark for _ in COLUMNS)}) "
            f"ON CONFLICT (request_id) DO UPDATE SET {updates}")


def usage_sql(q: UsageQuery, bucket_expr: str, money_sum: str,
              mark: str) -> tuple[str, list[object]]:
    """The aggregation behind the Usage API; the caller binds ``(start, end, *returned)``."""
    groups = [f"{col} AS {name}" if name in q.group_by else f"NULL AS {name}"
              for name, col in (("model", "model"), ("api_key_id", "key_id"),
                                ("project_id", "tenant"))]
    where = ["ts >= " + mark, "ts < " + mark]
    params: list[object] = []
    for col, values in (("model", q.models), ("tenant", q.project_ids),
                        ("key_id", q.api_key_ids)):
        if values:
            where.append(f"{col} IN ({', '.join(mark for _ in values)})")
            params.extend(values)
    grouped = [str(i + 2) for i, name in enumerate(("model", "api_key_id", "project_id"))
               if name in q.group_by]
    sql = (f"SELECT {bucket_expr} AS bucket, {', '.join(groups)}, SUM(prompt_tokens), "
           "SUM(COALESCE(cached_tokens, 0)), SUM(cache_write_tokens), SUM(completion_tokens), "
           "COUNT(*), SUM(CASE WHEN cached_source = 'unknown' THEN 1 ELSE 0 END), "
           "SUM(CASE WHEN cached_source = 'estimated' THEN 1 ELSE 0 END), "
           f"{money_sum}(cost_total) FROM {TABLE} WHERE {' AND '.join(where)} "
           f"GROUP BY {', '.join(['1', *grouped])}")
    return sql, params


def usage_row(row: Sequence[object]) -> UsageRow:
    """A :class:`UsageRow` from one row of :func:`usage_sql` (driver types normalized)."""
    n = [int(str(v)) for v in row[4:11]]
    return UsageRow(
        bucket=int(str(row[0])), model=_opt_str(row[1]), api_key_id=_opt_str(row[2]),
        project_id=_opt_str(row[3]), input_tokens=n[0], input_cached_tokens=n[1],
        input_cache_write_tokens=n[2], output_tokens=n[3], num_model_requests=n[4],
        cached_unknown_requests=n[5], cached_estimated_requests=n[6],
        cost_usd=Decimal(str(row[11])))


def _opt_str(value: object) -> str | None:
    return None if value is None else str(value)
