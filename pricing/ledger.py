"""The usage ledger: crash-safe, batched, idempotent, off the request path.

Accepting a record. :meth:`Ledger.submit` returns once the record is fsync'd to the local
spool (pricing/spool.py): "accepted" means it survives SIGKILL and power loss. Submissions are
group-committed: a flusher task takes everything pending (up to ``max_group``) and writes it
with one ``write`` + one ``fsync`` in a worker thread while the next group gathers, so the
event loop never waits on the disk and the fsync cost is shared (an fsync per record measured
6-10x slower under concurrent load, see docs/billing.md). Memory is bounded: at most
``max_pending`` records wait for their fsync; beyond that ``submit`` *blocks* (backpressure) --
a record is never dropped. If the spool itself cannot be written (disk full), ``submit`` raises
:class:`SpoolError`: the record was not accepted and the caller knows it.

Storing it. A writer task reads the spool in order and upserts batches into the database
(``batch_size`` records, or what arrived within ``batch_interval_s``), idempotent by request id
(last write wins, so a retried request's final record is the one kept). A segment of the spool
is deleted only after the database committed all of it. If the database is unavailable the
records stay in the spool and the batch is retried with exponential backoff (``retry_min_s``
doubling to ``retry_max_s``, jittered); memory does not grow meanwhile, the spool does (disk).
A record the database refuses for good is retried alone and then quarantined (never silently
dropped). On :meth:`start` a previous process's spool is replayed first.

Ownership: whoever starts the ledger (the app lifespan) calls ``start()`` / ``stop()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import random
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

from kvgate.pricing.backends.base import LedgerBackend, LedgerRejected, LedgerUnavailable
from kvgate.pricing.records import LedgerRecord
from kvgate.pricing.spool import Cursor, Spool, SpoolError
from kvgate.pricing.usage_api import UsageQuery, build_page, page_bounds

log = logging.getLogger("kvgate.ledger")
__all__ = ["Ledger", "LedgerClosed", "LedgerStats", "SpoolError"]


class LedgerClosed(RuntimeError):
    """``submit`` on a ledger that is not running."""


@dataclass(slots=True)
class LedgerStats:
    accepted: int = 0  # records durable in the spool (acknowledged)
    committed: int = 0  # records written to the database (replays included)
    db_errors: int = 0  # failed batch writes (each retried)
    quarantined: int = 0  # records the database refused for good


class Ledger:
    """See the module docstring."""

    def __init__(self, backend: LedgerBackend, spool_dir: Path, *, batch_size: int = 1000,
                 batch_interval_s: float = 0.05, max_group: int = 4096,
                 max_pending: int = 10_000, segment_bytes: int = 8 << 20,
                 retry_min_s: float = 0.1, retry_max_s: float = 10.0,
                 replay_timeout_s: float = 30.0, seed: int | None = None) -> None:
        if min(batch_size, max_group, max_pending) < 1:
            raise ValueError("batch_size, max_group and max_pending must be >= 1")
        self.backend = backend
        self.batch_size, self.batch_interval_s = batch_size, batch_interval_s
        self.max_group, self.max_pending = max_group, max_pending
        self.retry_min_s, self.retry_max_s = retry_min_s, retry_max_s
        self.replay_timeout_s = replay_timeout_s
        self.stats = LedgerStats()
        self._spool = Spool(spool_dir, segment_bytes)
        self._rng = random.Random(seed)
        self._cursor = Cursor(0, 0)
        self._pending: list[tuple[bytes, asyncio.Future[None]]] = []
        self._unwritten = 0
        self._running = self._stopping = False
        self._down_since: int | None = None  # db_errors count when the outage began
        self._kick, self._room, self._flushed = asyncio.Event(), asyncio.Event(), asyncio.Event()
        self._wake, self._full, self._progress = asyncio.Event(), asyncio.Event(), asyncio.Event()
        self._stop_event = asyncio.Event()
        self._stop_deadline = 0.0
        self._tasks: list[asyncio.Task[None]] = []

    # -- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        """Open the spool, replay what a previous process left (bounded by
        ``replay_timeout_s``; the rest continues in the background), start the tasks."""
        if self._running or self._stopping:
            raise RuntimeError("a ledger starts once: make a new one to start again")
        self._cursor = await asyncio.to_thread(self._spool.open)
        loop = asyncio.get_running_loop()
        await self._drain(loop.time() + self.replay_timeout_s)
        self._room.set()
        self._flushed.set()
        self._running = True
        self._tasks = [loop.create_task(self._flush_loop(), name="kvgate-ledger-flusher"),
                       loop.create_task(self._write_loop(), name="kvgate-ledger-writer")]
        for task in self._tasks:
            task.add_done_callback(_report_crash)

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Refuse new records, spool the pending ones, write what the database takes within
        ``timeout_s`` (the rest stays in the spool for the next start), close."""
        if not self._running:
            return
        self._running = False
        self._room.set()  # submitters blocked on a full queue see the ledger closed
        await self._flushed.wait()
        flusher, writer = self._tasks
        flusher.cancel()
        await asyncio.gather(flusher, return_exceptions=True)
        self._stop_deadline = asyncio.get_running_loop().time() + timeout_s
        self._stopping = True
        self._stop_event.set()
        self._wake.set()
        self._full.set()
        await asyncio.gather(writer, return_exceptions=True)  # a crash was already logged
        await asyncio.to_thread(self._spool.close)
        await asyncio.to_thread(self.backend.close)

    # -- accepting -----------------------------------------------------------------------
    async def submit(self, record: LedgerRecord) -> None:
        """Return once ``record`` is durable in the spool (see the module docstring)."""
        line = (record.to_json() + "\n").encode()
        while self._running and len(self._pending) >= self.max_pending:
            self._room.clear()
            await self._room.wait()
        if not self._running:
            raise LedgerClosed("the ledger is not running")
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((line, done))
        self._flushed.clear()
        self._kick.set()
        await asyncio.shield(done)

    async def _flush_loop(self) -> None:
        while True:
            await self._kick.wait()
            self._kick.clear()
            while self._pending:
                group = self._pending[:self.max_group]
                del self._pending[:self.max_group]
                self._room.set()
                await self._append(group)
            self._flushed.set()

    async def _append(self, group: list[tuple[bytes, asyncio.Future[None]]]) -> None:
        try:
            await asyncio.to_thread(self._spool.append, [line for line, _ in group])
        except SpoolError as exc:
            log.error("ledger: cannot write the spool (%s); %d records refused", exc, len(group))
            for _, done in group:
                if not done.done():
                    done.set_exception(exc)
            return
        for _, done in group:
            if not done.done():
                done.set_result(None)
        self.stats.accepted += len(group)
        self._unwritten += len(group)
        self._wake.set()
        if self._unwritten >= self.batch_size:
            self._full.set()

    # -- storing -------------------------------------------------------------------------
    async def _write_loop(self) -> None:
        delay = self.retry_min_s
        while not self._stopping:
            if await self._drain(None):
                delay = self.retry_min_s
                await self._wait_for_work()
                continue
            with contextlib.suppress(TimeoutError):  # back off, unless stopping
                await asyncio.wait_for(self._stop_event.wait(),
                                       delay * (0.5 + self._rng.random()))
            delay = min(delay * 2, self.retry_max_s)
        await self._drain(self._stop_deadline)

    async def _wait_for_work(self) -> None:
        await self._wake.wait()
        self._wake.clear()
        if self.batch_interval_s > 0 and self._unwritten < self.batch_size:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._full.wait(), self.batch_interval_s)
        self._full.clear()

    async def _drain(self, deadline: float | None) -> bool:
        """Write spooled batches until caught up (True), or the database fails or the
        deadline passes (False)."""
        loop = asyncio.get_running_loop()
        while deadline is None or loop.time() < deadline:
            if self._stopping and loop.time() >= self._stop_deadline:
                return False
            n = await self._drain_once()
            if n is None:
                return False
            if n < self.batch_size:
                return True
        return False

    async def _drain_once(self) -> int | None:
        """One batch: the number of lines read, or None when the database is unavailable."""
        try:
            lines, end = await asyncio.to_thread(self._spool.read, self._cursor,
                                                 self.batch_size)
        except OSError as exc:  # the spool directory was tampered with: keep retrying
            log.error("ledger: cannot read the spool: %s", exc)
            return None
        if lines:
            try:
                stored, refused = await asyncio.to_thread(self._store, lines)
            except LedgerUnavailable as exc:
                self._outage(exc)
                return None
            self._recovered()
            self.stats.committed += stored
            self.stats.quarantined += refused
        self._cursor = await asyncio.to_thread(self._spool.release, end)
        self._unwritten = max(0, self._unwritten - len(lines))
        self._progress.set()
        return len(lines)

    def _store(self, lines: list[bytes]) -> tuple[int, int]:
        """(worker thread) Upsert ``lines``; quarantine what can never be stored."""
        records: list[tuple[bytes, LedgerRecord]] = []
        refused = 0
        for line in lines:
            try:
                records.append((line, LedgerRecord.from_json(line)))
            except (ValueError, KeyError, TypeError) as exc:  # JSON, RecordError, fields
                self._spool.quarantine(line, f"unreadable: {type(exc).__name__}: {exc}")
                refused += 1
        try:
            self.backend.write([r for _, r in records])
            return len(records), refused
        except LedgerRejected:
            pass  # find the culprit(s): one record per transaction
        for line, record in records:
            try:
                self.backend.write([record])
            except LedgerRejected as exc:
                self._spool.quarantine(line, str(exc))
                refused += 1
        return len(records) - refused, refused

    def _outage(self, exc: LedgerUnavailable) -> None:
        self.stats.db_errors += 1
        if self._down_since is None:
            self._down_since = self.stats.db_errors
            log.warning("ledger: database unavailable (%s); records stay in the spool and "
                        "are retried", exc)

    def _recovered(self) -> None:
        if self._down_since is not None:
            failures = self.stats.db_errors - self._down_since + 1
            log.info("ledger: database available again after %d failed attempts", failures)
            self._down_since = None

    async def sync(self, timeout_s: float | None = None) -> bool:
        """Wait until every record accepted so far is in the database (True) or until
        ``timeout_s`` passes (False). For tests, exports and shutdown hooks."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while self._pending or not await asyncio.to_thread(self._spool.caught_up,
                                                           self._cursor):
            self._progress.clear()
            self._wake.set()
            self._full.set()
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._progress.wait(), left)
        return True

    async def backlog_bytes(self) -> int:
        """Spooled bytes not yet in the database (a gauge worth exporting)."""
        return await asyncio.to_thread(self._spool.backlog_bytes, self._cursor)

    # -- reading -------------------------------------------------------------------------
    async def query(self, since: dt.datetime, until: dt.datetime,
                    limit: int | None = None) -> list[LedgerRecord]:
        """Committed records with ``since <= ts < until`` (all in memory: give a ``limit``,
        or prefer :meth:`usage_page` / :meth:`spend_by_key` / ``backend.iter_records``)."""
        return await asyncio.to_thread(self.backend.query, since, until, limit)

    async def usage_page(self, q: UsageQuery) -> dict[str, Any]:
        """The OpenAI Usage-API page for ``q``, aggregated in the database."""
        low, high = page_bounds(q)
        rows = await asyncio.to_thread(self.backend.usage_rows, q, low, high)
        return build_page(rows, q)

    async def spend_by_key(self, since: dt.datetime | None = None) -> dict[str, Decimal]:
        """Committed ``cost_total`` per API key (for budgets), summed in the database."""
        return await asyncio.to_thread(self.backend.spend_by_key, since)

    async def spend_by_tenant(self, since: dt.datetime | None = None) -> dict[str, Decimal]:
        """Committed ``cost_total`` per tenant (for tenant budgets), summed in the database."""
        return await asyncio.to_thread(self.backend.spend_by_tenant, since)


def _report_crash(task: asyncio.Task[None]) -> None:
    """A ledger task must never end on its own: say so loudly if one does."""
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.critical("ledger: task %s died; records stay in the spool until restart",
                     task.get_name(), exc_info=exc)
