"""The ledger's durable spool: a directory of append-only JSONL segment files.

* :meth:`Spool.append` writes a group of lines with one ``write`` and one ``fsync``; when it
  returns the lines survive SIGKILL and power loss (a new segment's directory entry is fsync'd
  too). Only then does the ledger acknowledge the records.
* The reader (the ledger's database writer) walks segments in order from a :class:`Cursor`;
  in the segment being appended to it reads only the bytes already fsync'd.
* :meth:`Spool.release` deletes segments whose every line is committed to the database; when
  the reader has caught up it seals the active segment first, so an idle spool is empty. The
  active segment is also sealed at ``segment_bytes`` so that a long database outage leaves many
  bounded files, never one huge one.
* On open, leftover segments (a previous process's) are replayed from their start: records
  that were already committed are upserted again, which is harmless (idempotent by request
  id, and spool order keeps the last write the last). A torn last line (a write cut short by a
  crash, never acknowledged) is skipped.
* A ``LOCK`` file (``flock``) keeps two processes off one spool.

Thread-safe: ``append`` runs in the flusher's worker thread, ``read``/``release`` in the
database writer's.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("kvgate.ledger.spool")
_SEGMENT = re.compile(r"^(\d{16})\.jsonl$")
QUARANTINE = "quarantine.jsonl"


class SpoolError(OSError):
    """The spool cannot be used or written (the record was not accepted)."""


@dataclass(frozen=True, slots=True, order=True)
class Cursor:
    """A position in the spool: a segment and a byte offset in it."""

    seq: int
    offset: int


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class Spool:
    """See the module docstring. ``open()`` before use, ``close()`` after."""

    def __init__(self, directory: Path, segment_bytes: int = 8 << 20) -> None:
        self.directory = directory
        self.segment_bytes = segment_bytes
        self._lock = threading.Lock()
        self._segments: list[int] = []
        self._active_fd = -1
        self._durable = 0  # fsync'd bytes of the active segment
        self._lock_fd = -1

    # -- lifecycle -----------------------------------------------------------------------
    def open(self) -> Cursor:
        """Lock the directory, start a fresh active segment; return where replay starts."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._lock_fd = os.open(self.directory / "LOCK", os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            self._lock_fd = -1
            raise SpoolError(f"spool {self.directory} is in use by another process") from None
        except OSError as exc:
            raise SpoolError(f"spool {self.directory}: {exc.strerror}") from exc
        self._segments = sorted(int(m.group(1)) for p in self.directory.iterdir()
                                if (m := _SEGMENT.match(p.name)))
        self._new_segment((self._segments[-1] if self._segments else 0) + 1)
        return Cursor(self._segments[0], 0)

    def close(self) -> None:
        with self._lock:
            for fd in (self._active_fd, self._lock_fd):
                if fd >= 0:
                    os.close(fd)
            self._active_fd = self._lock_fd = -1

    def _path(self, seq: int) -> Path:
        return self.directory / f"{seq:016d}.jsonl"

    def _new_segment(self, seq: int) -> None:
        """Seal the active segment (if any) and start ``seq``; caller holds the lock or owns
        the spool exclusively."""
        fd = os.open(self._path(seq), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_EXCL, 0o600)
        _fsync_dir(self.directory)
        if self._active_fd >= 0:
            os.close(self._active_fd)
        self._active_fd, self._durable = fd, 0
        self._segments.append(seq)

    @property
    def active(self) -> int:
        return self._segments[-1]

    # -- writing -------------------------------------------------------------------------
    def append(self, lines: list[bytes]) -> None:
        """Write ``lines`` (each ending in a newline) durably: one write, one fsync."""
        data = b"".join(lines)
        with self._lock:
            if self._active_fd < 0:
                raise SpoolError("spool is closed")
            try:
                _write_all(self._active_fd, data)
                os.fsync(self._active_fd)
            except OSError as exc:
                raise SpoolError(f"spool {self.directory}: {exc.strerror}") from exc
            self._durable += len(data)
            if self._durable >= self.segment_bytes:
                self._new_segment(self.active + 1)

    def quarantine(self, line: bytes, reason: str) -> None:
        """Keep a line the database will never take, for an operator to look at."""
        log.error("ledger spool: quarantined a record (%s) in %s", reason,
                  self.directory / QUARANTINE)
        with self._lock, (self.directory / QUARANTINE).open("ab") as f:
            f.write(line if line.endswith(b"\n") else line + b"\n")
            f.flush()
            os.fsync(f.fileno())

    # -- reading -------------------------------------------------------------------------
    def read(self, cursor: Cursor, limit: int) -> tuple[list[bytes], Cursor]:
        """Up to ``limit`` complete lines from ``cursor`` on, and the cursor after them."""
        out: list[bytes] = []
        while len(out) < limit:
            with self._lock:
                later = [s for s in self._segments if s > cursor.seq]
                end = self._durable if cursor.seq == self.active else None
            lines, offset = self._read_segment(cursor, limit - len(out), end)
            out.extend(lines)
            cursor = Cursor(cursor.seq, offset)
            if len(out) >= limit or end is not None or not later:
                break
            cursor = Cursor(later[0], 0)  # this sealed segment is exhausted
        return out, cursor

    def _read_segment(self, cursor: Cursor, limit: int,
                      end: int | None) -> tuple[list[bytes], int]:
        out: list[bytes] = []
        offset = cursor.offset
        with self._path(cursor.seq).open("rb") as f:
            f.seek(offset)
            while len(out) < limit and (end is None or offset < end):
                line = f.readline() if end is None else f.readline(end - offset)
                if not line.endswith(b"\n"):
                    if line:
                        log.warning("ledger spool: skipped a torn last line in %s (a write "
                                    "cut short by a crash; never acknowledged)",
                                    self._path(cursor.seq).name)
                        offset += len(line)
                    break
                offset += len(line)
                out.append(line)
        return out, offset

    def release(self, cursor: Cursor) -> Cursor:
        """Everything before ``cursor`` is committed: delete finished segments (sealing the
        active one when the reader has caught up with it). Returns the cursor to read on from."""
        with self._lock:
            if cursor.seq == self.active and cursor.offset == self._durable and self._durable:
                self._new_segment(self.active + 1)
                cursor = Cursor(self.active, 0)
            done = [s for s in self._segments if s < cursor.seq]
            self._segments = [s for s in self._segments if s >= cursor.seq]
        for seq in done:
            self._path(seq).unlink(missing_ok=True)
        return cursor

    def caught_up(self, cursor: Cursor) -> bool:
        """Whether ``cursor`` is at the end of everything durable."""
        with self._lock:
            return cursor.seq == self.active and cursor.offset == self._durable

    def backlog_bytes(self, cursor: Cursor) -> int:
        """Bytes spooled but not yet committed (for metrics)."""
        with self._lock:
            segments = list(self._segments)
            durable = self._durable
        total = 0
        for seq in segments:
            try:
                size = durable if seq == segments[-1] else self._path(seq).stat().st_size
            except FileNotFoundError:  # released meanwhile
                continue
            total += size - (cursor.offset if seq == cursor.seq else 0)
        return max(total, 0)
