"""OpenAI's Files API for the Batch API: ``/v1/files`` upload, list, retrieve, content, delete.

Contents live as plain files under ``<data_dir>/files/<id>``; metadata in the management
database (asyncq/batch/mgmt_db.py). An upload is streamed: the multipart parser spools the part to a
temporary file (memory holds at most its 1 MiB spool buffer), which is copied in 1 MiB chunks to
the data dir while bytes and lines are counted -- never whole in memory. OpenAI's batch limits
apply: at most ``max_file_bytes`` (200 MB) and ``max_file_lines`` (50,000 requests). Written
outputs (``batch_output``) are written to a temporary name and renamed, so a file id always
names a complete file, and rewriting one (two replicas finalising the same batch) is harmless.

Tenant scoping: every row carries its tenant (``""`` when authentication is off); another
tenant's file is a 404, exactly as an unknown id.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import sqlite3
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal

from pydantic import BaseModel

from kvgate.asyncq.batch.mgmt_db import Db
from kvgate.middleware.framework.errors import BadRequest, NotFound, PayloadTooLarge

CHUNK = 1 << 20
#: Purposes a client may upload (the Batch API's input); outputs are ``batch_output``.
UPLOAD_PURPOSES = frozenset({"batch"})
PURPOSES = frozenset({"batch", "batch_output"})


class FileObject(BaseModel):
    """OpenAI's file object."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["uploaded", "processed", "error"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


@dataclass(frozen=True, slots=True)
class FileRecord:
    id: str
    tenant: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    lines: int

    def to_object(self) -> FileObject:
        return FileObject(id=self.id, bytes=self.bytes, created_at=self.created_at,
                          filename=self.filename, purpose=self.purpose)


_COLS = "id, tenant, bytes, created_at, filename, purpose, lines"


def _record(row: tuple[object, ...]) -> FileRecord:
    i, tenant, size, created, name, purpose, lines = row
    return FileRecord(str(i), str(tenant), int(str(size)), int(str(created)), str(name),
                      str(purpose), int(str(lines)))


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


def count_lines(path: Path) -> int:
    """Non-empty JSONL lines of a file (blank lines do not count), read in chunks."""
    return sum(1 for _ in iter_lines(path))


def iter_lines(path: Path) -> Iterator[bytes]:
    """The file's non-blank lines without their line ends, read lazily."""
    with path.open("rb") as f:
        for raw in f:
            line = raw.rstrip(b"\r\n")
            if line.strip():
                yield line


def _copy(src: IO[bytes], dest: Path, max_bytes: int, max_lines: int) -> tuple[int, int]:
    """Copy ``src`` to ``dest`` in chunks; (bytes, non-blank lines). Raises past the limits."""
    size = lines = 0
    tail_blank = True  # the current (unterminated) line has no content yet
    with dest.open("wb") as out:
        while chunk := src.read(CHUNK):
            size += len(chunk)
            if size > max_bytes:
                raise PayloadTooLarge(f"the file is larger than {max_bytes} bytes", param="file")
            for piece in chunk.split(b"\n")[:-1]:
                if not tail_blank or piece.strip():
                    lines += 1
                tail_blank = True
            last = chunk.rsplit(b"\n", 1)[-1]
            if last.strip():
                tail_blank = False
            if lines > max_lines:
                raise BadRequest(f"the file has more than {max_lines} lines", param="file",
                                 code="too_many_lines")
            out.write(chunk)
        out.flush()
        os.fsync(out.fileno())
    if not tail_blank:
        lines += 1
    if lines > max_lines:
        raise BadRequest(f"the file has more than {max_lines} lines", param="file",
                         code="too_many_lines")
    return size, lines


def _write_lines(dest: Path, lines: Iterable[bytes]) -> tuple[int, int]:
    tmp = dest.with_name(dest.name + f".tmp{secrets.token_hex(4)}")
    size = count = 0
    with tmp.open("wb") as out:
        for line in lines:
            out.write(line + b"\n")
            size += len(line) + 1
            count += 1
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, dest)
    return size, count


class FileStore:
    """Files of every tenant: contents under ``root``, metadata in ``db``."""

    def __init__(self, db: Db, root: Path) -> None:
        self.db = db
        self.root = root

    def path(self, file_id: str) -> Path:
        return self.root / file_id

    async def upload(self, tenant: str, filename: str, purpose: str, src: IO[bytes],
                     max_bytes: int, max_lines: int) -> FileRecord:
        """Store an uploaded file (``src`` read in chunks) and its metadata."""
        if purpose not in UPLOAD_PURPOSES:
            raise BadRequest(f"purpose must be one of {sorted(UPLOAD_PURPOSES)}, not "
                             f"{purpose!r}", param="purpose")
        file_id = new_file_id()
        dest = self.path(file_id)
        await asyncio.to_thread(self.root.mkdir, parents=True, exist_ok=True)
        try:
            size, lines = await asyncio.to_thread(_copy, src, dest, max_bytes, max_lines)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                await asyncio.to_thread(dest.unlink)
            raise
        rec = FileRecord(file_id, tenant, size, int(time.time()), filename or "upload.jsonl",
                         purpose, lines)
        await self.db.run(lambda c: c.execute(
            f"INSERT INTO files ({_COLS}) VALUES (?,?,?,?,?,?,?)",
            (rec.id, rec.tenant, rec.bytes, rec.created_at, rec.filename, rec.purpose,
             rec.lines)))
        return rec

    async def write(self, file_id: str, tenant: str, filename: str,
                    lines: Iterable[bytes]) -> FileRecord:
        """Write (or rewrite: idempotent by id) an output file of JSONL ``lines``."""
        await asyncio.to_thread(self.root.mkdir, parents=True, exist_ok=True)
        size, count = await asyncio.to_thread(_write_lines, self.path(file_id), lines)
        rec = FileRecord(file_id, tenant, size, int(time.time()), filename, "batch_output",
                         count)

        def upsert(c: sqlite3.Connection) -> None:
            c.execute(f"INSERT OR IGNORE INTO files ({_COLS}) VALUES (?,?,?,?,?,?,?)",
                      (rec.id, rec.tenant, rec.bytes, rec.created_at, rec.filename,
                       rec.purpose, rec.lines))
            c.execute("UPDATE files SET bytes = ?, lines = ? WHERE id = ?",
                      (rec.bytes, rec.lines, rec.id))
        await self.db.run(upsert)
        return rec

    async def get(self, tenant: str, file_id: str) -> FileRecord:
        """The tenant's file; NotFound for an unknown id or another tenant's file."""
        row = await self.db.run(lambda c: c.execute(
            f"SELECT {_COLS} FROM files WHERE id = ? AND tenant = ?",
            (file_id, tenant)).fetchone())
        if row is None:
            raise NotFound(f"no such file: {file_id!r}", param="file_id")
        return _record(row)

    async def page(self, tenant: str, purpose: str | None, limit: int, after: str | None,
                   order: Literal["asc", "desc"]) -> FileList:
        """One page of the tenant's files, ordered by creation time (then id)."""
        cmp, direction = (">", "ASC") if order == "asc" else ("<", "DESC")

        def query(c: sqlite3.Connection) -> list[tuple[object, ...]]:
            where, args = ["tenant = ?"], [tenant]
            if purpose is not None:
                where.append("purpose = ?")
                args.append(purpose)
            if after is not None:
                ref = c.execute("SELECT created_at FROM files WHERE id = ? AND tenant = ?",
                                (after, tenant)).fetchone()
                if ref is not None:
                    where.append(f"(created_at, id) {cmp} (?, ?)")
                    args += [ref[0], after]
            sql = (f"SELECT {_COLS} FROM files WHERE {' AND '.join(where)} "
                   f"ORDER BY created_at {direction}, id {direction} LIMIT ?")
            return list(c.execute(sql, (*args, limit + 1)).fetchall())
        rows = await self.db.run(query)
        data = [_record(r).to_object() for r in rows[:limit]]
        return FileList(data=data, first_id=data[0].id if data else None,
                        last_id=data[-1].id if data else None, has_more=len(rows) > limit)

    async def delete(self, tenant: str, file_id: str) -> FileDeleted:
        await self.get(tenant, file_id)
        await self.db.run(lambda c: c.execute(
            "DELETE FROM files WHERE id = ? AND tenant = ?", (file_id, tenant)))
        with contextlib.suppress(FileNotFoundError):
            await asyncio.to_thread(self.path(file_id).unlink)
        return FileDeleted(id=file_id, deleted=True)
