"""``sqlite:///path``: the embedded job store (one file, WAL journal).

Every state change is one transaction committed with ``synchronous=FULL`` (fsync'd before the
call returns): a job accepted by ``enqueue`` survives a SIGKILL or a power cut, and a terminal
state written by ``finish`` is never rolled back. All calls run on one dedicated thread (the
connection is not shared between threads; the event loop never blocks on disk).

Claiming is one ``UPDATE ... RETURNING`` over the best queued rows: priority first, then
round-robin between tenants (each tenant's n-th oldest job ranks with the other tenants'
n-th), then age -- so one tenant's 50,000-line batch does not starve another's ten requests.
Only rows whose ``available_at`` has come are claimed (a retried job waits out its backoff).

Bounded: terminal jobs older than ``retention_s`` (default 30 days, the longest a client may
come back for batch results, as OpenAI keeps batch output files) are deleted by ``reap``; the
file holds at most ``max_jobs`` unfinished jobs (enqueue past it is a 429).
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from kvgate.asyncq.api import TERMINAL, Job, JobResult, JobSpec, JobState, QueueUnavailable
from kvgate.middleware.framework.errors import RateLimited

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
  id TEXT PRIMARY KEY, kind TEXT NOT NULL, method TEXT NOT NULL, path TEXT NOT NULL,
  body BLOB NOT NULL, tenant TEXT, key_id TEXT, created_at REAL NOT NULL, deadline REAL,
  priority INTEGER NOT NULL DEFAULT 0, batch_id TEXT, custom_id TEXT,
  prefix_key TEXT NOT NULL DEFAULT '', state TEXT NOT NULL, attempts INTEGER NOT NULL DEFAULT 0,
  owner TEXT, lease_until REAL, available_at REAL NOT NULL DEFAULT 0, started_at REAL,
  res_status INTEGER, res_body BLOB, res_ct TEXT, res_engine TEXT, finished_at REAL
);
CREATE INDEX IF NOT EXISTS jobs_queue ON jobs (state, priority DESC, created_at);
CREATE INDEX IF NOT EXISTS jobs_batch ON jobs (batch_id);
CREATE INDEX IF NOT EXISTS jobs_finished ON jobs (finished_at);
"""
_SPEC = ("id, kind, method, path, body, tenant, key_id, created_at, deadline, priority, "
         "batch_id, custom_id, prefix_key")
_COLS = (_SPEC + ", state, attempts, started_at, owner, res_status, res_body, res_ct, "
         "res_engine, finished_at")
_ACTIVE = ("queued", "running")


def _job(row: Sequence[Any]) -> Job:
    spec = JobSpec(*row[:13])
    state, attempts, started_at, owner = row[13:17]
    result = None if row[17] is None else JobResult(
        int(row[17]), bytes(row[18] or b""), row[19] or "application/json", row[20],
        float(row[21] or 0.0))
    return Job(spec, JobState(state), int(attempts), result, started_at, owner)


def expired_result(now: float) -> JobResult:
    return JobResult(408, b'{"error": {"message": "the job was not started before its '
                          b'deadline", "type": "invalid_request_error", "param": null, '
                          b'"code": "expired"}}', "application/json", None, now)


def cancelled_result(now: float) -> JobResult:
    return JobResult(499, b'{"error": {"message": "the job was cancelled", "type": '
                          b'"invalid_request_error", "param": null, "code": "cancelled"}}',
                     "application/json", None, now)


class SqliteJobStore:
    """See the module docstring. ``path``: the database file (created with its directory)."""

    backend = "sqlite"

    def __init__(self, path: str | Path, *, retention_s: float = 30 * 86400,
                 max_jobs: int = 1_000_000) -> None:
        self.path = Path(path)
        self.retention_s = retention_s
        self.max_jobs = max_jobs
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvgate-jobs")
        self._db: sqlite3.Connection | None = None
        self._error: str | None = None

    async def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._call, fn)

    def _call(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        if self._db is None:
            raise QueueUnavailable("the job store is closed")
        db = self._db
        try:
            db.execute("BEGIN IMMEDIATE")  # one transaction: committed (fsync'd) or rolled back
            try:
                out = fn(db)
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
        except sqlite3.OperationalError as exc:
            self._error = str(exc)
            raise QueueUnavailable(f"job store: {exc}") from None
        self._error = None
        return out

    async def open(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._pool, self._open)

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.execute("PRAGMA busy_timeout=5000")
        db.executescript(_SCHEMA)
        self._db = db

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._pool, self._close)
        self._pool.shutdown(wait=True)

    def _close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    async def enqueue(self, specs: Sequence[JobSpec]) -> int:
        rows = [(s.id, s.kind, s.method, s.path, s.body, s.tenant, s.key_id, s.created_at,
                 s.deadline, s.priority, s.batch_id, s.custom_id, s.prefix_key) for s in specs]

        def go(db: sqlite3.Connection) -> int:
            (active,) = db.execute("SELECT count(*) FROM jobs WHERE state IN (?, ?)",
                                   _ACTIVE).fetchone()
            if active + len(rows) > self.max_jobs:
                raise RateLimited(f"the queue holds {active} unfinished jobs (at most "
                                  f"{self.max_jobs}); retry later", code="queue_full")
            before = db.total_changes
            db.executemany(f"INSERT OR IGNORE INTO jobs ({_SPEC}, state) VALUES "
                           "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'queued')", rows)
            return db.total_changes - before
        return await self._run(go)

    async def claim(self, consumer: str, limit: int, lease_s: float,
                    now: float) -> Sequence[Job]:
        def go(db: sqlite3.Connection) -> list[Job]:
            ids = [r[0] for r in db.execute(
                "SELECT id FROM (SELECT id, priority, created_at, ROW_NUMBER() OVER ("
                "PARTITION BY tenant ORDER BY priority DESC, created_at) AS turn FROM jobs "
                "WHERE state = 'queued' AND available_at <= ?) "
                "ORDER BY priority DESC, turn, created_at LIMIT ?", (now, limit))]
            if not ids:
                return []
            marks = ",".join("?" * len(ids))
            rows = db.execute(
                f"UPDATE jobs SET state = 'running', owner = ?, lease_until = ?, "
                f"attempts = attempts + 1, started_at = ? WHERE id IN ({marks}) "
                f"AND state = 'queued' RETURNING {_COLS}",
                (consumer, now + lease_s, now, *ids)).fetchall()
            order = {job_id: i for i, job_id in enumerate(ids)}
            return sorted((_job(r) for r in rows), key=lambda j: order[j.spec.id])
        return await self._run(go)

    async def renew(self, consumer: str, job_ids: Sequence[str], lease_s: float,
                    now: float) -> None:
        if not job_ids:
            return
        marks = ",".join("?" * len(job_ids))
        await self._run(lambda db: db.execute(
            f"UPDATE jobs SET lease_until = ? WHERE owner = ? AND state = 'running' "
            f"AND id IN ({marks})", (now + lease_s, consumer, *job_ids)))

    async def finish(self, job_id: str, state: JobState, result: JobResult | None) -> bool:
        assert state in TERMINAL
        r = result

        def go(db: sqlite3.Connection) -> bool:
            cur = db.execute(
                "UPDATE jobs SET state = ?, owner = NULL, lease_until = NULL, res_status = ?, "
                "res_body = ?, res_ct = ?, res_engine = ?, finished_at = ? "
                "WHERE id = ? AND state IN ('queued', 'running')",
                (str(state), r and r.status, r and r.body, r and r.content_type,
                 r and r.engine, r.finished_at if r else time.time(), job_id))
            return cur.rowcount == 1
        return await self._run(go)

    async def release(self, job_id: str, consumer: str, delay_s: float = 0.0) -> bool:
        def go(db: sqlite3.Connection) -> bool:
            cur = db.execute(
                "UPDATE jobs SET state = 'queued', owner = NULL, lease_until = NULL, "
                "available_at = ? WHERE id = ? AND owner = ? AND state = 'running'",
                (time.time() + delay_s, job_id, consumer))
            return cur.rowcount == 1
        return await self._run(go)

    async def cancel(self, job_id: str, now: float) -> Job | None:
        res = cancelled_result(now)

        def go(db: sqlite3.Connection) -> Job | None:
            db.execute(
                "UPDATE jobs SET state = 'cancelled', owner = NULL, lease_until = NULL, "
                "res_status = ?, res_body = ?, res_ct = ?, finished_at = ? "
                "WHERE id = ? AND state IN ('queued', 'running')",
                (res.status, res.body, res.content_type, now, job_id))
            row = db.execute(f"SELECT {_COLS} FROM jobs WHERE id = ?", (job_id,)).fetchone()
            return None if row is None else _job(row)
        return await self._run(go)

    async def cancel_batch(self, batch_id: str, now: float) -> int:
        res = cancelled_result(now)

        def go(db: sqlite3.Connection) -> int:
            return db.execute(
                "UPDATE jobs SET state = 'cancelled', owner = NULL, lease_until = NULL, "
                "res_status = ?, res_body = ?, res_ct = ?, finished_at = ? "
                "WHERE batch_id = ? AND state IN ('queued', 'running')",
                (res.status, res.body, res.content_type, now, batch_id)).rowcount
        return await self._run(go)

    async def get(self, job_id: str) -> Job | None:
        def go(db: sqlite3.Connection) -> Job | None:
            row = db.execute(f"SELECT {_COLS} FROM jobs WHERE id = ?", (job_id,)).fetchone()
            return None if row is None else _job(row)
        return await self._run(go)

    async def batch_jobs(self, batch_id: str) -> Sequence[Job]:
        return await self._run(lambda db: [_job(r) for r in db.execute(
            f"SELECT {_COLS} FROM jobs WHERE batch_id = ? ORDER BY created_at, id",
            (batch_id,))])

    async def batch_counts(self, batch_id: str) -> Mapping[JobState, int]:
        return await self._run(lambda db: {JobState(s): n for s, n in db.execute(
            "SELECT state, count(*) FROM jobs WHERE batch_id = ? GROUP BY state",
            (batch_id,))})

    async def counts(self) -> Mapping[tuple[str, JobState], int]:
        return await self._run(lambda db: {(k, JobState(s)): n for k, s, n in db.execute(
            "SELECT kind, state, count(*) FROM jobs WHERE state IN (?, ?) GROUP BY kind, state",
            _ACTIVE)})

    async def reap(self, now: float) -> Sequence[Job]:
        res = expired_result(now)

        def go(db: sqlite3.Connection) -> list[Job]:
            back = db.execute(
                f"UPDATE jobs SET state = 'queued', owner = NULL, lease_until = NULL "
                f"WHERE state = 'running' AND lease_until < ? RETURNING {_COLS}",
                (now,)).fetchall()
            gone = db.execute(
                f"UPDATE jobs SET state = 'expired', res_status = ?, res_body = ?, res_ct = ?, "
                f"finished_at = ? WHERE state = 'queued' AND deadline IS NOT NULL "
                f"AND deadline < ? RETURNING {_COLS}",
                (res.status, res.body, res.content_type, now, now)).fetchall()
            db.execute("DELETE FROM jobs WHERE finished_at < ? AND state NOT IN (?, ?)",
                       (now - self.retention_s, *_ACTIVE))
            expired = {r[0] for r in gone}
            return [_job(r) for r in back if r[0] not in expired] + [_job(r) for r in gone]
        return await self._run(go)

    def health(self) -> Mapping[str, object]:
        return {"backend": self.backend, "ok": self._error is None,
                **({"error": self._error} if self._error else {})}


__all__ = ["SqliteJobStore", "cancelled_result", "expired_result"]
