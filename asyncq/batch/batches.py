"""OpenAI's Batch API on the durable job queue: create, retrieve, list, cancel, finalise.

Status machine (OpenAI's): ``validating -> in_progress -> finalizing -> completed``;
``validating -> failed`` (no runnable line); ``... -> finalizing -> expired`` (some request
was not started within the completion window); ``validating | in_progress -> cancelling ->
(finalizing ->) cancelled`` (queued requests cancelled, running ones finish first).

Create: the batch row is stored as ``validating`` first; then every input line is validated
(asyncq/batch/lines.py), bad lines are kept for the error file, and the good ones are
submitted as ``JobSpec`` s (kind ``batch``, id derived from batch id + custom_id, deadline =
created + window) in chunks of ``SUBMIT_CHUNK``; only then is the batch ``in_progress``.
Submitting is idempotent by job id, so a gateway killed half-way is finished by the sweep
(below) of any process sharing the database: it re-validates and re-submits once the
validation lease (``lease_s``) has lapsed.

Finalisation is driven by a ``JobListener`` (a batch request reaching a terminal state marks
its batch for a check, coalesced for ``COALESCE_S``) and by a sweep every
``finalize_interval_s`` over unfinished batches -- so a restarted or other replica finishes a
batch whose requests it never ran. When every job of a batch is terminal, the process that
wins the ``UPDATE ... WHERE status IN (in_progress, cancelling)`` (or finds a ``finalizing``
lease lapsed) writes the output and error files from the store's final job states -- one line
per request however often it ran -- under deterministic ids, then sets the final status, the
timestamps and the counts in one transaction together with the webhook event.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import sqlite3
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from kvgate.asyncq.api import TERMINAL, Job, JobSpec, JobState, QueueService
from kvgate.asyncq.batch.files import FileStore, iter_lines
from kvgate.asyncq.batch.lines import (
    BadLine,
    bad_line_row,
    job_id,
    job_row,
    output_file_id,
    validate_lines,
)
from kvgate.asyncq.batch.mgmt_db import Db
from kvgate.asyncq.batch.objects import (
    BatchCreate,
    BatchError,
    BatchErrors,
    BatchList,
    BatchObject,
    Conflict,
    RequestCounts,
)
from kvgate.asyncq.tasks import cancel
from kvgate.asyncq.webhooks import Webhooks
from kvgate.middleware.framework.errors import BadRequest, HTTPError, NotFound

log = logging.getLogger("kvgate.asyncq.batches")

#: OpenAI accepts only "24h" today; the window in seconds.
WINDOWS = {"24h": 24 * 3600}
SUBMIT_CHUNK = 1000
#: How long a burst of finished requests is coalesced before their batches are checked.
COALESCE_S = 0.2
#: Batches marked for a check at most (beyond that the periodic sweep covers them).
MAX_DIRTY = 10_000
ACTIVE = ("validating", "in_progress", "cancelling", "finalizing")


def _finished() -> dict[str, int]:
    return {"completed": 0, "failed": 0, "expired": 0, "cancelled": 0}


@dataclass
class BatchCounters:
    created: int = 0
    finished: dict[str, int] = field(default_factory=_finished)
    requests_submitted: int = 0
    invalid_lines: int = 0
    sweep_errors: int = 0
    degraded_since: float | None = None


@dataclass(frozen=True, slots=True)
class BatchRow:
    tenant: str
    key_id: str | None
    obj: BatchObject


def _row(r: Sequence[Any]) -> BatchRow:
    return BatchRow(str(r[0]), None if r[1] is None else str(r[1]),
                    BatchObject.model_validate_json(r[2]))


class BatchManager:
    """The Batch API's state: rows in ``db``, files in ``files``, jobs in ``service``."""

    def __init__(self, service: QueueService, db: Db, files: FileStore, webhooks: Webhooks,
                 work_dir: Path, *, max_lines: int, lease_s: float,
                 finalize_interval_s: float) -> None:
        self.service = service
        self.db = db
        self.files = files
        self.webhooks = webhooks
        self.work_dir = work_dir
        self.max_lines = max_lines
        self.lease_s = lease_s
        self.interval_s = finalize_interval_s
        self.counters = BatchCounters()
        self._dirty: set[str] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # -- rows ------------------------------------------------------------------------------
    async def _load(self, batch_id: str, tenant: str | None = None) -> BatchRow:
        sql = "SELECT tenant, key_id, doc FROM batches WHERE id = ?"
        args: tuple[str, ...] = (batch_id,)
        if tenant is not None:
            sql += " AND tenant = ?"
            args = (batch_id, tenant)
        row = await self.db.run(lambda c: c.execute(sql, args).fetchone())
        if row is None:
            raise NotFound(f"no such batch: {batch_id!r}", param="batch_id")
        return _row(row)

    @staticmethod
    def _save(c: sqlite3.Connection, obj: BatchObject, lease_until: float = 0.0) -> None:
        c.execute("UPDATE batches SET doc = ?, status = ?, lease_until = ? WHERE id = ?",
                  (obj.model_dump_json(), obj.status, lease_until, obj.id))

    async def _claim(self, batch_id: str, statuses: Sequence[str], now: float,
                     finalizing: bool = False) -> BatchRow | None:
        """Take the batch's lease if it is in ``statuses`` and nobody holds a live lease on it
        (``finalizing``: and move it to ``finalizing`` in the same transaction). None: someone
        else has it, or it is in another status."""
        def claim(c: sqlite3.Connection) -> BatchRow | None:
            r = c.execute("SELECT tenant, key_id, doc, status, lease_until FROM batches "
                          "WHERE id = ?", (batch_id,)).fetchone()
            if r is None or r[3] not in statuses or float(r[4]) > now:
                return None
            row = _row(r)
            if finalizing:
                if row.obj.in_progress_at is None:
                    return None
                obj = row.obj.model_copy(update={
                    "status": "finalizing", "finalizing_at": row.obj.finalizing_at or int(now)})
                row = BatchRow(row.tenant, row.key_id, obj)
                self._save(c, obj, now + self.lease_s)
            else:
                c.execute("UPDATE batches SET lease_until = ? WHERE id = ?",
                          (now + self.lease_s, batch_id))
            return row
        return await self.db.run(claim)

    # -- API -------------------------------------------------------------------------------
    async def create(self, tenant: str, key_id: str | None, req: BatchCreate) -> BatchObject:
        rec = await self.files.get(tenant, req.input_file_id)
        if rec.purpose != "batch":
            raise BadRequest("the input file's purpose must be 'batch'", param="input_file_id")
        if rec.lines > self.max_lines:
            raise BadRequest(f"a batch holds at most {self.max_lines} requests",
                             param="input_file_id")
        now = int(time.time())
        obj = BatchObject(
            id="batch_" + secrets.token_hex(12), endpoint=req.endpoint,
            input_file_id=req.input_file_id, completion_window=req.completion_window,
            status="validating", created_at=now,
            expires_at=now + WINDOWS[req.completion_window], metadata=req.metadata,
            request_counts=RequestCounts(total=rec.lines))
        await self.db.run(lambda c: c.execute(
            "INSERT INTO batches (id, tenant, key_id, doc, status, created_at, lease_until) "
            "VALUES (?,?,?,?,?,?,?)", (obj.id, tenant, key_id, obj.model_dump_json(),
                                       obj.status, now, time.time() + self.lease_s)))
        self.counters.created += 1
        try:
            return await self._validate(BatchRow(tenant, key_id, obj))
        except HTTPError as exc:  # e.g. the queue is unavailable: the sweep resumes it
            log.warning("batch %s: submission deferred (%s); the sweep will resume it",
                        obj.id, exc.message)
            return obj

    async def get(self, tenant: str, batch_id: str) -> BatchObject:
        row = await self._load(batch_id, tenant)
        return await self._with_live_counts(row.obj)

    async def _with_live_counts(self, obj: BatchObject) -> BatchObject:
        if obj.status not in ("in_progress", "cancelling", "finalizing"):
            return obj
        counts = await self.service.batch_counts(obj.id)
        invalid = obj.request_counts.failed if obj.in_progress_at else 0
        done = counts.get(JobState.SUCCEEDED, 0)
        failed = sum(counts.get(s, 0) for s in TERMINAL if s is not JobState.SUCCEEDED)
        rc = RequestCounts(total=obj.request_counts.total, completed=done,
                           failed=failed + invalid)
        return obj.model_copy(update={"request_counts": rc})

    async def page(self, tenant: str, limit: int, after: str | None) -> BatchList:
        def query(c: sqlite3.Connection) -> list[tuple[Any, ...]]:
            where, args = "tenant = ?", [tenant]
            if after is not None:
                ref = c.execute("SELECT created_at FROM batches WHERE id = ? AND tenant = ?",
                                (after, tenant)).fetchone()
                if ref is not None:
                    where += " AND (created_at, id) < (?, ?)"
                    args += [ref[0], after]
            return list(c.execute(
                f"SELECT tenant, key_id, doc FROM batches WHERE {where} "
                "ORDER BY created_at DESC, id DESC LIMIT ?", (*args, limit + 1)).fetchall())
        rows = await self.db.run(query)
        data = [await self._with_live_counts(_row(r).obj) for r in rows[:limit]]
        return BatchList(data=data, first_id=data[0].id if data else None,
                         last_id=data[-1].id if data else None, has_more=len(rows) > limit)

    async def cancel(self, tenant: str, batch_id: str) -> BatchObject:
        now = int(time.time())

        def mark(c: sqlite3.Connection) -> BatchObject:
            r = c.execute("SELECT tenant, key_id, doc FROM batches WHERE id = ? AND "
                          "tenant = ?", (batch_id, tenant)).fetchone()
            if r is None:
                raise NotFound(f"no such batch: {batch_id!r}", param="batch_id")
            obj = _row(r).obj
            if obj.status in ("cancelling", "cancelled"):
                return obj
            if obj.status not in ("validating", "in_progress"):
                raise Conflict(f"cannot cancel a batch with status {obj.status!r}")
            obj = obj.model_copy(update={"status": "cancelling", "cancelling_at": now})
            c.execute("UPDATE batches SET doc = ?, status = ? WHERE id = ?",
                      (obj.model_dump_json(), obj.status, obj.id))
            return obj
        obj = await self.db.run(mark)
        await self.service.cancel_batch(batch_id)
        self.mark_dirty(batch_id)
        return await self._with_live_counts(obj)

    # -- validation and submission -----------------------------------------------------------
    def _invalid_path(self, batch_id: str) -> Path:
        return self.work_dir / f"{batch_id}.invalid.jsonl"

    async def _validate(self, row: BatchRow) -> BatchObject:
        """Validate the input, submit the good lines, move to in_progress (or failed)."""
        obj = row.obj
        path = self.files.path(obj.input_file_id)
        good, bad = await asyncio.to_thread(
            lambda: validate_lines(iter_lines(path), obj.endpoint))
        await asyncio.to_thread(self._write_invalid, obj.id, bad)
        self.counters.invalid_lines += len(bad)
        tenant = row.tenant or None
        deadline = float(obj.expires_at or obj.created_at + WINDOWS["24h"])
        specs = [JobSpec(
            id=job_id(obj.id, g.custom_id), kind="batch", method="POST", path=obj.endpoint,
            body=orjson.dumps(g.body), tenant=tenant, key_id=row.key_id,
            created_at=float(obj.created_at), deadline=deadline, batch_id=obj.id,
            custom_id=g.custom_id, prefix_key=self.service.prefix_key(obj.endpoint, g.body),
        ) for g in good]
        for i in range(0, len(specs), SUBMIT_CHUNK):
            self.counters.requests_submitted += await self.service.submit(
                specs[i:i + SUBMIT_CHUNK])
        return await self._after_validation(row, len(good) + len(bad), bad, bool(specs))

    def _write_invalid(self, batch_id: str, bad: Sequence[BadLine]) -> None:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self._invalid_path(batch_id).write_bytes(
            b"".join(bad_line_row(batch_id, b) + b"\n" for b in bad))

    async def _after_validation(self, row: BatchRow, total: int, bad: Sequence[BadLine],
                                runnable: bool) -> BatchObject:
        now = int(time.time())
        batch_id = row.obj.id
        errors = None if runnable else BatchErrors(data=[
            BatchError(code=b.code, message=b.message, line=b.line) for b in bad[:1000]
        ] or [BatchError(code="empty_file", message="the input file has no requests")])

        def update(c: sqlite3.Connection) -> BatchObject:
            r = c.execute("SELECT tenant, key_id, doc FROM batches WHERE id = ?",
                          (batch_id,)).fetchone()
            obj = _row(r).obj
            counts = RequestCounts(total=total, completed=0, failed=len(bad))
            if obj.status == "validating":
                if runnable:
                    obj = obj.model_copy(update={"status": "in_progress",
                                                 "in_progress_at": now,
                                                 "request_counts": counts})
                else:
                    obj = obj.model_copy(update={"status": "failed", "failed_at": now,
                                                 "errors": errors, "request_counts": counts})
                    self.counters.finished["failed"] += 1
                    self.webhooks.stage(c, row.tenant, "batch.failed", {"id": obj.id})
            elif obj.status == "cancelling" and obj.in_progress_at is None:
                obj = obj.model_copy(update={"in_progress_at": now, "request_counts": counts})
            self._save(c, obj)
            return obj
        obj = await self.db.run(update)
        if obj.status == "cancelling":
            await self.service.cancel_batch(batch_id)
            self.mark_dirty(batch_id)
        return obj

    # -- finalisation ------------------------------------------------------------------------
    def mark_dirty(self, batch_id: str) -> None:
        if len(self._dirty) < MAX_DIRTY:
            self._dirty.add(batch_id)
        self._wake.set()

    async def on_job(self, job: Job) -> None:
        """JobListener: a batch request reached a terminal state -> check its batch soon."""
        if job.spec.batch_id is not None and job.state in TERMINAL:
            self.mark_dirty(job.spec.batch_id)

    async def try_finalize(self, batch_id: str) -> BatchObject | None:
        """Finalise the batch if all its jobs are terminal and nobody else is doing it."""
        counts = await self.service.batch_counts(batch_id)
        if any(counts.get(s, 0) for s in (JobState.QUEUED, JobState.RUNNING)):
            return None
        now = time.time()
        row = await self._claim(batch_id, ("in_progress", "cancelling", "finalizing"), now,
                                finalizing=True)
        if row is None:
            return None
        obj = row.obj
        return await self._finalize(row.tenant, obj)

    async def _finalize(self, tenant: str, obj: BatchObject) -> BatchObject:
        jobs = await self.service.batch_jobs(obj.id)
        out: list[bytes] = []
        err: list[bytes] = []
        expired = False
        for job in jobs:
            ok, line = job_row(job)
            (out if ok else err).append(line)
            expired = expired or job.state is JobState.EXPIRED
        invalid = await asyncio.to_thread(self._read_invalid, obj.id)
        err.extend(invalid)
        update: dict[str, Any] = {}
        if out:
            update["output_file_id"] = (await self.files.write(
                output_file_id(obj.id, "output"), tenant, f"{obj.id}_output.jsonl", out)).id
        if err:
            update["error_file_id"] = (await self.files.write(
                output_file_id(obj.id, "error"), tenant, f"{obj.id}_error.jsonl", err)).id
        now = int(time.time())
        if obj.cancelling_at is not None:
            status = "cancelled"
        else:
            status = "expired" if expired else "completed"
        update.update({"status": status, f"{status}_at": now, "request_counts": RequestCounts(
            total=len(out) + len(err), completed=len(out), failed=len(err))})
        final = obj.model_copy(update=update)

        def commit(c: sqlite3.Connection) -> bool:
            r = c.execute("SELECT status FROM batches WHERE id = ?", (obj.id,)).fetchone()
            if r is None or r[0] != "finalizing":
                return False
            self._save(c, final)
            self.webhooks.stage(c, tenant, f"batch.{status}", {"id": obj.id})
            return True
        if await self.db.run(commit):
            self.counters.finished[status] += 1
            log.info("batch %s %s: %d output lines, %d error lines", obj.id, status, len(out),
                     len(err))
        return final

    def _read_invalid(self, batch_id: str) -> list[bytes]:
        path = self._invalid_path(batch_id)
        if not path.exists():
            return []
        return [line for line in path.read_bytes().split(b"\n") if line]

    # -- the loop ---------------------------------------------------------------------------
    async def sweep(self) -> None:
        """Resume lapsed validations; check every unfinished batch once."""
        now = time.time()
        rows = await self.db.run(lambda c: c.execute(
            "SELECT tenant, key_id, doc FROM batches WHERE status IN (?,?,?,?)",
            ACTIVE).fetchall())
        for r in rows:
            obj = _row(r).obj
            if obj.in_progress_at is None:  # validating (or cancelled while validating)
                row = await self._claim(obj.id, ("validating", "cancelling"), now)
                if row is not None:
                    await self._validate(row)
            else:
                await self.try_finalize(obj.id)

    async def _check(self, batch_ids: Iterable[str]) -> None:
        for batch_id in batch_ids:
            await self.try_finalize(batch_id)

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="kvgate-batches")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel(task)

    async def _loop(self) -> None:
        next_sweep = 0.0
        while True:
            try:
                if time.monotonic() >= next_sweep:
                    next_sweep = time.monotonic() + self.interval_s
                    await self.sweep()
                elif self._dirty:
                    await asyncio.sleep(COALESCE_S)
                    dirty, self._dirty = self._dirty, set()
                    await self._check(dirty)
                self._ok()
            except (HTTPError, sqlite3.Error, OSError) as exc:
                self._degraded(exc)
            if not self._dirty:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(),
                                           max(0.0, next_sweep - time.monotonic()))

    def _ok(self) -> None:
        if self.counters.degraded_since is not None:
            log.warning("batch bookkeeping recovered")
        self.counters.degraded_since = None

    def _degraded(self, exc: Exception) -> None:
        self.counters.sweep_errors += 1
        if self.counters.degraded_since is None:
            self.counters.degraded_since = time.time()
            log.warning("batch bookkeeping failed (%s); retrying every %.0fs", exc,
                        self.interval_s)

