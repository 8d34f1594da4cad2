"""The ledger against real SQLite: batching, idempotency, a database outage, replay, quarantine,
backpressure, and a SIGKILL of a writing process (nothing accepted is lost)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import os
import selectors
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvgate.pricing.backends.base import LedgerRejected
from kvgate.pricing.backends.select import open_backend
from kvgate.pricing.ledger import Ledger, LedgerClosed
from kvgate.pricing.records import LedgerRecord
from kvgate.pricing.spool import Spool, SpoolError
from tests.unit.pricing.helpers import record

ROOT = Path(__file__).resolve().parents[3]
ALL = (dt.datetime(2000, 1, 1, tzinfo=dt.UTC), dt.datetime(2100, 1, 1, tzinfo=dt.UTC))
FAST = {"batch_interval_s": 0.01, "retry_min_s": 0.02, "retry_max_s": 0.1, "seed": 7}


def _ledger(tmp: Path, **options: Any) -> Ledger:
    backend = open_backend(f"sqlite://{tmp / 'ledger.sqlite'}", busy_timeout_s=0.05)
    return Ledger(backend, tmp / "spool", **{**FAST, **options})


def _rows(tmp: Path) -> list[LedgerRecord]:
    backend = open_backend(f"sqlite://{tmp / 'ledger.sqlite'}")
    try:
        return backend.query(*ALL)
    finally:
        backend.close()


def _spooled(tmp: Path) -> int:
    return sum(p.read_bytes().count(b"\n") for p in (tmp / "spool").glob("0*.jsonl"))


@contextlib.contextmanager
def _db_down(path: Path) -> Iterator[None]:
    """Hold SQLite's write lock from another connection: the ledger's writes time out."""
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        yield
    finally:
        holder.execute("ROLLBACK")
        holder.close()


async def test_records_reach_the_database_and_the_spool_empties(tmp_path: Path) -> None:
    ledger = _ledger(tmp_path)
    await ledger.start()
    await asyncio.gather(*(ledger.submit(record(f"r{i}")) for i in range(250)))
    assert ledger.stats.accepted == 250
    assert await ledger.sync(10)
    assert ledger.stats.committed == 250
    assert await ledger.backlog_bytes() == 0
    await ledger.stop()
    assert len(_rows(tmp_path)) == 250
    assert _spooled(tmp_path) == 0


async def test_duplicates_collapse_and_the_last_write_wins(tmp_path: Path) -> None:
    ledger = _ledger(tmp_path)
    await ledger.start()
    for attempt in range(3):  # a request retried: its final record is submitted last
        await ledger.submit(record("dup", completion=10 * (attempt + 1),
                                   outcome="done" if attempt == 2 else "upstream_error"))
        await ledger.submit(record(f"other-{attempt}"))
    await ledger.sync(10)
    await ledger.submit(record("other-0", completion=1))  # a later duplicate after commit
    await ledger.stop()
    rows = {r.request_id: r for r in _rows(tmp_path)}
    assert len(rows) == 4
    assert (rows["dup"].completion_tokens, rows["dup"].outcome) == (30, "done")
    assert rows["other-0"].completion_tokens == 1


async def test_database_down_then_up_loses_nothing(tmp_path: Path) -> None:
    ledger = _ledger(tmp_path)
    await ledger.start()
    await ledger.submit(record("before"))
    assert await ledger.sync(10)
    with _db_down(tmp_path / "ledger.sqlite"):
        await asyncio.gather(*(ledger.submit(record(f"r{i}")) for i in range(100)))
        assert not await ledger.sync(0.5)  # accepted, but the database refuses them
        assert ledger.stats.db_errors >= 1
        assert ledger.stats.accepted == 101
        assert await ledger.backlog_bytes() > 0
    assert await ledger.sync(10)
    await ledger.stop()
    assert len(_rows(tmp_path)) == 101


async def test_stop_during_an_outage_keeps_the_spool_for_the_next_start(tmp_path: Path) -> None:
    with _db_down(tmp_path / "ledger.sqlite"):
        ledger = _ledger(tmp_path)
        await ledger.start()
        await asyncio.gather(*(ledger.submit(record(f"r{i}")) for i in range(40)))
        await ledger.stop(timeout_s=0.2)
        assert _spooled(tmp_path) == 40
        with pytest.raises(LedgerClosed):
            await ledger.submit(record("late"))
    again = _ledger(tmp_path)
    await again.start()  # replays the spool before taking new records
    assert again.stats.committed == 40
    await again.stop()
    assert len(_rows(tmp_path)) == 40
    assert _spooled(tmp_path) == 0


async def test_replay_after_a_crash_between_commit_and_release(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Committed but not yet released records are upserted again: no duplicates, and spool
    order keeps the final version of a retried request."""
    real_release = Spool.release
    monkeypatch.setattr(Spool, "release", lambda self, cursor: cursor)  # "crash" before it
    ledger = _ledger(tmp_path)
    await ledger.start()
    await ledger.submit(record("x", completion=1, outcome="upstream_error"))
    await ledger.submit(record("x", completion=2))
    await ledger.submit(record("y"))
    for _ in range(200):  # committed, never released
        if len(_rows(tmp_path)) == 2:
            break
        await asyncio.sleep(0.01)
    assert {r.request_id for r in _rows(tmp_path)} == {"x", "y"}
    ledger._spool.close()  # abandoned, like a killed process
    monkeypatch.setattr(Spool, "release", real_release)
    again = _ledger(tmp_path)
    await again.start()
    assert again.stats.committed == 3
    await again.stop()
    rows = {r.request_id: r for r in _rows(tmp_path)}
    assert len(rows) == 2
    assert (rows["x"].completion_tokens, rows["x"].outcome) == (2, "done")


async def test_unreadable_spool_lines_are_quarantined(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool")
    spool.open()
    spool.append([(record("good").to_json() + "\n").encode(), b'{"request_id": "half"}\n',
                  b"garbage\n", (record("good2").to_json() + "\n").encode()])
    spool.close()
    ledger = _ledger(tmp_path)
    await ledger.start()
    await ledger.stop()
    assert ledger.stats.quarantined == 2
    assert {r.request_id for r in _rows(tmp_path)} == {"good", "good2"}
    assert (tmp_path / "spool" / "quarantine.jsonl").read_bytes().count(b"\n") == 2


class _PickyBackend:
    """Stores in memory; refuses any record whose request id starts with ``poison``."""

    def __init__(self) -> None:
        self.rows: dict[str, LedgerRecord] = {}

    def write(self, records: Sequence[LedgerRecord]) -> None:
        if any(r.request_id.startswith("poison") for r in records):
            raise LedgerRejected("value out of range")
        self.rows.update((r.request_id, r) for r in records)

    def close(self) -> None:
        pass


async def test_a_record_the_database_refuses_is_isolated(tmp_path: Path) -> None:
    backend = _PickyBackend()
    ledger = Ledger(backend, tmp_path / "spool", **FAST)  # type: ignore[arg-type]
    await ledger.start()
    await asyncio.gather(*(ledger.submit(record(f"r{i}")) for i in range(20)),
                         ledger.submit(record("poison-1")))
    assert await ledger.sync(10)
    await ledger.stop()
    assert len(backend.rows) == 20
    assert ledger.stats.quarantined == 1
    assert b"poison-1" in (tmp_path / "spool" / "quarantine.jsonl").read_bytes()


async def test_a_full_queue_blocks_submitters_and_drops_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ledger = _ledger(tmp_path, max_pending=5, max_group=2)
    await ledger.start()
    real_append = ledger._spool.append
    peak = 0

    def slow_append(lines: list[bytes]) -> None:
        nonlocal peak
        peak = max(peak, len(ledger._pending))
        time.sleep(0.002)
        real_append(lines)

    monkeypatch.setattr(ledger._spool, "append", slow_append)
    await asyncio.gather(*(ledger.submit(record(f"r{i}")) for i in range(200)))
    await ledger.stop()
    assert peak <= 5
    assert len(_rows(tmp_path)) == 200


async def test_a_spool_write_failure_is_reported_to_the_submitter(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ledger = _ledger(tmp_path)
    await ledger.start()

    def disk_full(lines: list[bytes]) -> None:
        raise SpoolError(28, "No space left on device")

    monkeypatch.setattr(ledger._spool, "append", disk_full)
    with pytest.raises(SpoolError):
        await ledger.submit(record("r"))
    assert ledger.stats.accepted == 0
    await ledger.stop()


async def test_submit_needs_a_running_ledger(tmp_path: Path) -> None:
    ledger = _ledger(tmp_path)
    with pytest.raises(LedgerClosed):
        await ledger.submit(record("r"))


def _read_acks(proc: subprocess.Popen[bytes], want: int, timeout_s: float) -> set[str]:
    """Request ids the child printed (each printed after its submit returned)."""
    assert proc.stdout is not None
    acked: set[str] = set()
    buffer = b""
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while len(acked) < want and time.monotonic() < deadline:
            if not sel.select(timeout=0.5):
                continue
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                break
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            acked.update(line.decode() for line in lines if line.startswith(b"kill-"))
    return acked


async def _recover(tmp: Path) -> Ledger:
    ledger = _ledger(tmp)
    await ledger.start()
    assert await ledger.sync(30)
    await ledger.stop()
    return ledger


@pytest.mark.parametrize("db_down", [False, True], ids=["db-up", "db-down"])
def test_sigkill_mid_run_loses_no_accepted_record(tmp_path: Path, db_down: bool) -> None:
    count, kill_after = 20_000, 3_000
    url = f"sqlite://{tmp_path / 'ledger.sqlite'}"
    with contextlib.ExitStack() as stack:
        if db_down:
            stack.enter_context(_db_down(tmp_path / "ledger.sqlite"))
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.unit.pricing.ledger_child", str(tmp_path / "spool"),
             url, str(count)], cwd=ROOT, stdout=subprocess.PIPE)
        try:
            acked = _read_acks(proc, kill_after, timeout_s=60)
        finally:
            proc.kill()  # SIGKILL
            proc.wait()
        assert len(acked) >= kill_after, "the child did not get going"
    ledger = asyncio.run(_recover(tmp_path))
    rows = _rows(tmp_path)
    ids = [r.request_id for r in rows]
    assert len(ids) == len(set(ids)), "duplicates collapse"
    assert acked <= set(ids), f"lost {len(acked - set(ids))} accepted records"
    assert set(ids) <= {f"kill-{i}" for i in range(count)}
    assert len(ids) >= len(acked)
    if db_down:
        assert ledger.stats.committed >= len(acked)  # all of it came from the spool
    for r in rows:  # and intact: tokens, exact money, times
        assert r == record(r.request_id, completion=r.completion_tokens)
