"""The management plane's SQLite database: file metadata, batches and the webhook outbox in one
file (``<data_dir>/mgmt.sqlite``, WAL journal) next to the uploaded files.

Every call runs in a worker thread (``asyncio.to_thread``) inside one ``BEGIN IMMEDIATE``
transaction, so concurrent writers -- tasks of this process, or another process on the same
file (a restarted gateway, replicas sharing a volume) -- serialise on SQLite's own lock.
The connection is opened lazily on first use (no work at import or construction).
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS files (
        id TEXT PRIMARY KEY, tenant TEXT NOT NULL, bytes INTEGER NOT NULL,
        created_at INTEGER NOT NULL, filename TEXT NOT NULL, purpose TEXT NOT NULL,
        lines INTEGER NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS files_tenant ON files (tenant, created_at, id)",
    """CREATE TABLE IF NOT EXISTS batches (
        id TEXT PRIMARY KEY, tenant TEXT NOT NULL, key_id TEXT, doc TEXT NOT NULL,
        status TEXT NOT NULL, created_at INTEGER NOT NULL, lease_until REAL NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS batches_tenant ON batches (tenant, created_at, id)",
    "CREATE INDEX IF NOT EXISTS batches_status ON batches (status)",
    """CREATE TABLE IF NOT EXISTS outbox (
        id TEXT PRIMARY KEY, tenant TEXT NOT NULL, type TEXT NOT NULL, body BLOB NOT NULL,
        created_at REAL NOT NULL, attempts INTEGER NOT NULL, next_at REAL NOT NULL,
        state TEXT NOT NULL, last_error TEXT)""",
    "CREATE INDEX IF NOT EXISTS outbox_due ON outbox (state, next_at)",
)


class Db:
    """One lazily opened SQLite connection used from worker threads under a lock."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._conn: sqlite3.Connection | None = None
        self._lock = threading.Lock()

    def _connect(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None,
                               timeout=30)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        for stmt in _SCHEMA:
            conn.execute(stmt)
        return conn

    def _call(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        with self._lock:
            if self._conn is None:
                self._conn = self._connect()
            conn = self._conn
            conn.execute("BEGIN IMMEDIATE")
            try:
                out = fn(conn)
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
            return out

    async def run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """``fn(conn)`` in one transaction, in a worker thread."""
        return await asyncio.to_thread(self._call, fn)

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
