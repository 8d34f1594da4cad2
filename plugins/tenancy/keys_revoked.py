"""Revocations that survive Redis losing its data (docs/security.md, "Revocation").

With keys in Redis the keys file only seeds an *empty* Redis. After Redis loses its data
(``FLUSHALL``, a restart without persistence, a failover to an empty replica) the next replica
to start seeds it again from its file, which knows nothing of what the admin API did: a key
revoked through ``POST /v1/admin/keys/{id}/revoke`` (``kvgate keys revoke``) would be live
again. So every secret the keys refuse is also kept in a revocation list next to the keys file,
``<file>.revoked`` (the ``revocations_file`` param), as ``sha256 -> (key id, refused from)``:

* written by the replica that revokes (before the admin API answers: a list that cannot be
  written is a 503 naming it, and the revoke, which is idempotent, can be sent again) and by
  every replica that sees a revocation in Redis (``revoked_at``; a rotated-out secret, refused
  from the end of its grace period; with Redis, a secret a rotation replaced);
* read at startup (an unreadable or invalid list stops the start: without it a revoked key
  could come back) and again on every reload of the keys (a changed file is re-read);
* applied to every key set the plugin loads (the seed of an empty Redis included, so Redis
  holds the revocation again) and to the index it serves from: a listed secret is refused from
  its time on, whatever the store says; a replica whose list knows a revocation that Redis has
  lost writes it back to Redis (every replica then learns it).

Writers take an exclusive ``flock`` on ``<list>.lock`` (``--workers`` share the file), re-read,
merge (the earliest time of a secret wins), and replace the file atomically. Bounded by the
secrets ever refused (about 150 bytes each). Without a keys file there is nowhere to keep it:
the plugin warns at startup and ``/health`` says ``revocations: not durable``.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvgate.middleware.framework.errors import ConfigError, HTTPError
from kvgate.plugins.tenancy.keys_model import KeyEntry, KeyIndex, KeysFile
from kvgate.plugins.tenancy.keys_store import KeyStore, file_lock

log = logging.getLogger("kvgate.plugins.auth")
_SHA = r"^[0-9a-f]{64}$"


class Refusal(BaseModel):
    """One refused secret: its hash, its key id, and since when it is refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    sha256: str = Field(pattern=_SHA)
    id: str
    at: dt.datetime


class RevocationFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    revoked: tuple[Refusal, ...] = ()


Refused = dict[str, Refusal]


def refusals(parsed: KeysFile) -> Refused:
    """The secrets ``parsed`` itself refuses: revoked keys', rotated-out ones (from the end of
    their grace period)."""
    out: Refused = {}
    for e in parsed.keys:
        if e.revoked_at is not None:
            out[e.sha256] = Refusal(sha256=e.sha256, id=e.id, at=e.revoked_at)
        if e.previous_sha256 is not None and e.previous_valid_until is not None:
            out[e.previous_sha256] = Refusal(sha256=e.previous_sha256, id=e.id,
                                             at=e.previous_valid_until)
    return out


def replaced(old: KeysFile, new: KeysFile, now: dt.datetime) -> Refused:
    """Secrets of a key id in ``old`` that ``new`` no longer has for it (a rotation without
    grace): refused from ``now``. Keys gone from ``new`` are not (an edit is not a revoke)."""
    before = {e.id: e for e in old.keys}
    out: Refused = {}
    for e in new.keys:
        was = before.get(e.id)
        if was is None:
            continue
        for sha in {was.sha256, was.previous_sha256} - {e.sha256, e.previous_sha256, None}:
            assert sha is not None
            out[sha] = Refusal(sha256=sha, id=e.id, at=now)
    return out


def parse_list(text: str, source: str) -> Refused:
    try:
        doc = RevocationFile.model_validate(yaml.safe_load(text) or {})
    except (yaml.YAMLError, ValidationError) as exc:
        raise ConfigError(f"{source}: invalid revocation list: {exc}") from None
    return {r.sha256: r for r in doc.revoked}


def _stat(path: Path) -> tuple[int, int, int] | None:
    """The file's (mtime_ns, size, inode); None: there is none (ConfigError: unreadable)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the revocation list: {exc.strerror}") from None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def read_list(path: Path) -> tuple[tuple[int, int, int] | None, Refused]:
    """(file signature, refusals); a missing file is empty. ConfigError: unreadable, invalid."""
    before = _stat(path)
    if before is None:
        return None, {}
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the revocation list: {exc.strerror}") from None
    return before, parse_list(text, str(path))


def merge(into: Refused, more: Mapping[str, Refusal]) -> Refused:
    """``into`` with ``more`` added (the earliest time of a secret wins); only the changes."""
    added: Refused = {}
    for sha, r in more.items():
        have = into.get(sha)
        if have is None or r.at < have.at:
            into[sha] = added[sha] = r
    return added


def write_list(path: Path, more: Mapping[str, Refusal]) -> Refused:
    """Merge ``more`` into the list file under its lock, replacing it atomically; the whole
    list as written. OSError / ConfigError: not written."""
    with file_lock(path):
        now = read_list(path)[1]
        merge(now, more)
        doc = RevocationFile(revoked=tuple(sorted(now.values(), key=lambda r: (r.at, r.sha256))))
        text = ("# Secrets refused for good by the api-keys plugin (docs/security.md, "
                "Revocation). Merged by every replica; never remove a line to bring a key "
                "back: create a new key.\n")
        text += yaml.safe_dump(doc.model_dump(mode="json"), sort_keys=False)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                out.write(text)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return now


@dataclass(slots=True)
class Revocations:
    """The revocation list of one api-keys plugin (module docstring); ``path`` None: none."""

    path: Path | None
    refused: Refused
    token: object = None
    #: The last failed read of the file (the last good list is kept), and write.
    error: str | None = None
    write_error: str | None = None
    #: The keys as the store last had them (rotations are learned against it); None: unseen.
    last: KeysFile | None = None

    @classmethod
    def load(cls, path: Path | None) -> Revocations:
        """The list at startup (ConfigError: unreadable or invalid, the start stops)."""
        if path is None:
            return cls(None, {})
        token, refused = read_list(path)
        return cls(path, refused, token)

    def apply(self, parsed: KeysFile, now: dt.datetime) -> KeysFile:
        """``parsed`` with every listed secret refused from its time: a key whose secret is
        listed is revoked; a rotated-out secret's grace ends at its time at the latest."""
        keys = tuple(self._entry(e, now) for e in parsed.keys)
        if all(a is b for a, b in zip(keys, parsed.keys, strict=True)):
            return parsed
        return parsed.model_copy(update={"keys": keys})

    def _entry(self, e: KeyEntry, now: dt.datetime) -> KeyEntry:
        r = self.refused.get(e.sha256)
        if r is not None and r.at <= now and e.revoked_at is None:
            return e.model_copy(update={"revoked_at": r.at, "previous_sha256": None,
                                        "previous_valid_until": None})
        p = None if e.previous_sha256 is None else self.refused.get(e.previous_sha256)
        if p is None or e.previous_valid_until is None or p.at >= e.previous_valid_until:
            return e
        if p.at <= now:
            return e.model_copy(update={"previous_sha256": None, "previous_valid_until": None})
        return e.model_copy(update={"previous_valid_until": p.at})

    def cap(self, index: KeyIndex) -> KeyIndex:
        """``index`` with a secret listed for a later time valid until then at the latest (a
        keys file older than a rotation whose grace period still runs)."""
        by_hash: dict[str, tuple[Any, float | None]] = dict(index.by_hash)
        for sha, (key, until) in index.by_hash.items():
            r = self.refused.get(sha)
            if r is not None:
                at = r.at.timestamp()
                by_hash[sha] = (key, at if until is None else min(until, at))
        return replace(index, by_hash=by_hash)

    def refresh(self) -> None:
        """Re-read the file if it changed (another process wrote it); a bad one keeps the
        last good list and is reported on /health."""
        if self.path is None:
            return
        try:
            if _stat(self.path) == self.token:
                return
            self.token, self.refused = read_list(self.path)
            self.error = None
        except ConfigError as exc:
            self.error = str(exc)
            log.warning("api-keys: %s (keeping the last good revocation list)", exc)

    async def learn(self, new: KeysFile, rotations: bool, now: dt.datetime) -> int:
        """Keep what ``new`` refuses (and, ``rotations``, the secrets it replaced since the
        store's last keys) in the list; the number added. OSError / ConfigError: not kept."""
        more = refusals(new)
        if rotations and self.last is not None:
            merge(more, replaced(self.last, new, now))
        self.last = new
        added = merge(dict(self.refused), more)
        if not added or self.path is None:
            return 0
        self.refused = await asyncio.to_thread(write_list, self.path, added)
        self.token = _stat(self.path)
        log.info("api-keys: %d secrets added to the revocation list %s", len(added), self.path)
        return len(added)

    async def keep(self, new: KeysFile, rotations: bool) -> str | None:
        """:meth:`learn`, its failure logged (ERROR), shown on /health and returned.
        ``rotations``: ``new`` and the last keys are two views of one store (Redis, or the
        admin API's writes), so a secret gone from a key id was rotated out; a hand edit of
        the keys file is not taken for one (a typo fixed must not lock a key out)."""
        try:
            await self.learn(new, rotations, dt.datetime.now(dt.UTC))
        except (OSError, ConfigError) as exc:
            self.write_error = (f"the revocation list cannot be written ({exc}): a Redis "
                                "data loss would bring back what it misses")
            log.error("api-keys: %s", self.write_error)
            return self.write_error
        self.write_error = None
        return None

    async def heal(self, store: KeyStore, parsed: KeysFile,
                   errors: tuple[type[BaseException], ...]) -> None:
        """Write the revocations the store lost (``parsed`` has live keys the list refuses)
        back to it: every replica then refuses them, its own list or not."""
        if self.apply(parsed, dt.datetime.now(dt.UTC)) is parsed:
            return
        failures: tuple[type[BaseException], ...] = (*errors, HTTPError)
        try:
            await store.update(lambda p: self.apply(p, dt.datetime.now(dt.UTC)))
        except failures as exc:
            log.warning("api-keys: cannot write lost revocations back to the %s store (%s); "
                        "the next reload tries again", store.kind, type(exc).__name__)
            return
        log.warning("api-keys: the %s store had lost revocations; written back from %s",
                    store.kind, self.path)

    def health(self) -> dict[str, object]:
        if self.path is None:
            return {"revocations": "not durable (no keys file): see docs/security.md"}
        out: dict[str, object] = {"revocations": len(self.refused)}
        for name, error in (("revocations_error", self.error),
                            ("revocations_write_error", self.write_error)):
            if error is not None:
                out[name] = error
        return out


def default_path(file: str | None, explicit: str | None) -> Path | None:
    """``revocations_file``, else ``<keys file>.revoked``, else None."""
    if explicit is not None:
        return Path(explicit)
    return None if file is None else Path(f"{file}.revoked")


__all__ = ["Refusal", "Revocations", "default_path", "parse_list", "refusals", "replaced",
           "write_list"]
