"""Reloading configuration files while the gateway runs, keeping the last good version.

:class:`Reloadable` is what a plugin with a file offers (the catalog, the billing price book):
``watched()`` names its files, ``load_new()`` reads and validates them (in a worker thread;
raises ConfigError on a bad file) and ``commit(new)`` swaps the result in (on the event loop,
no I/O, so a request sees the old or the new version, never a mix). The ``api-keys`` plugin
drives it: it polls the files' (mtime_ns, size, inode) every ``watch_interval_s`` and on an
admin ``POST /v1/admin/reload`` (every replica, through Redis). A failed reload leaves the
plugin on its last good version, logs one WARNING per distinct error, and shows on ``/health``
and in ``/metrics`` (:class:`ReloadStatus`) until a reload succeeds. A watched file that is
empty is a failed reload too (a file caught while being rewritten in place), as is an empty
keys file (``keys_model.parse_keys``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

from kvgate.middleware.framework.errors import ConfigError

log = logging.getLogger("kvgate.plugins.reload")


@runtime_checkable
class Reloadable(Protocol):
    """A plugin whose files may be reloaded while it serves (see the module docstring)."""

    def watched(self) -> Sequence[Path]: ...

    def load_new(self) -> object: ...

    def commit(self, new: object) -> str: ...


def signature(paths: Sequence[Path]) -> tuple[tuple[int, int, int] | None, ...]:
    """(mtime_ns, size, inode) of each file; None for a missing one."""
    out: list[tuple[int, int, int] | None] = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            out.append(None)
        else:
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
    return tuple(out)


def _refuse_empty(paths: Sequence[Path]) -> None:
    """ConfigError for a watched file that exists but is empty: a file truncated and then
    rewritten in place reads empty for a moment, and an empty catalog or price book would
    otherwise be taken as one with nothing in it. The write that completes it changes the
    file's signature, so the next poll reloads it."""
    for path, sig in zip(paths, signature(paths), strict=True):
        if sig is not None and sig[1] == 0:
            raise ConfigError(f"{path}: the file is empty (being written?): replace watched "
                              "files whole (write a new file, then rename it over the old one)")


@dataclass(slots=True)
class ReloadStatus:
    """The reload state of one source: counters (to /metrics), the error of the last failed
    reload and since when it fails (to /health; cleared by a successful reload)."""

    name: str
    ok: int = 0
    failed: int = 0
    last_ok_at: float | None = None
    error: str | None = None
    failing_since: float | None = None
    _logged: str | None = field(default=None, repr=False)

    def succeeded(self, what: str) -> None:
        self.ok += 1
        self.last_ok_at = time.time()
        if self.error is not None:
            log.warning("%s: reloaded after failures: %s", self.name, what)
        else:
            log.info("%s: reloaded: %s", self.name, what)
        self.error = self.failing_since = self._logged = None

    def failed_with(self, error: str) -> None:
        self.failed += 1
        self.error = error
        if self.failing_since is None:
            self.failing_since = time.time()
        if error != self._logged:
            log.warning("%s: reload failed, keeping the last good version: %s", self.name, error)
            self._logged = error

    def health(self) -> dict[str, object]:
        out: dict[str, object] = {"reloads": self.ok, "reload_failures": self.failed,
                                  "last_reload_at": self.last_ok_at}
        if self.error is not None:
            out.update(ok=False, reload_error=self.error, failing_since=self.failing_since)
        return out


class FileReloader:
    """One Reloadable, its last seen file signature and its status."""

    def __init__(self, name: str, target: Reloadable) -> None:
        self.target = target
        self.paths = tuple(target.watched())
        self.seen = signature(self.paths)
        self.status = ReloadStatus(name)

    async def poll(self) -> None:
        """Reload when a watched file changed since the last look."""
        now = await asyncio.to_thread(signature, self.paths)
        if now != self.seen:
            self.seen = now
            await self.reload()

    async def reload(self) -> bool:
        try:
            await asyncio.to_thread(_refuse_empty, self.paths)
            new = await asyncio.to_thread(self.target.load_new)
            what = self.target.commit(new)
        except ConfigError as exc:
            self.status.failed_with(str(exc))
            return False
        self.status.succeeded(what)
        return True
