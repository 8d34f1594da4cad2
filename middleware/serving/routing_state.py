"""Routing state kept across a gateway restart (``server.routing_state_dir``).

Why. Placement keeps per-process state that decides where a session's next turn goes: the
engine each session used last and how fast each engine's cache is being rewritten. A restarted
gateway without it places a returning session like a new one; on a fleet whose KV holds only
a few sessions per engine that moves sessions off the engine holding their prefix and evicts
other sessions' prefixes there (the e2e fleet measured 68 % cached on the second turn after a
restart). With ``--redis`` the session table is shared and survives a restart; this file is the
single-process equivalent.

What a plugin restores is its own business: the placement scorer takes back its session pins
and insertion ledger, and treats a restored pin's engine as holding what the session last sent
it until that session's next request (the KV index cannot see prefixes stored before the
restart; without this the ledger's pressure would move the session away).

How. Plugins implementing :class:`~kvgate.middleware.framework.plugin.Persistent` hand a JSON-able
snapshot (:meth:`snapshot`) that is written atomically (temporary file + rename) every ``save_s``
seconds and at shutdown, and handed back (:meth:`restore`) at startup, before the first request.
A killed gateway loses at most ``save_s`` seconds of decisions.

One file per fleet: its name is a digest of the engines' names and URLs and of the plugins'
names and types, so a gateway started in front of other engines or with another routing
profile (another test, another fleet) never restores state that is not its own. The directory
keeps at most :data:`MAX_FILES` files (the oldest by modification time are deleted). An
unreadable or mismatched file is skipped with a WARNING, counted in ``/metrics`` and shown on
``/health``; the gateway starts with fresh state.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvgate.middleware.framework.plugin import Persistent
from kvgate.middleware.framework.tasks import cancel_and_wait

log = logging.getLogger("kvgate.routing_state")

#: File format version; a file of another version is skipped (fresh state), never misread.
FORMAT = 1
#: Files kept in the directory (one per fleet and worker; each is at most a few MB).
MAX_FILES = 64


def fleet_digest(engines: Sequence[tuple[str, str]], plugins: Sequence[str]) -> str:
    """16 hex digits naming the fleet and its routing profile: a digest of the sorted
    (name, URL) pairs of the engines and of the plugins' ``name:type`` (not their params, so a
    tuned weight keeps the state; another profile starts fresh)."""
    text = "\n".join([*(f"{n} {u}" for n, u in sorted(engines)), *sorted(plugins)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(slots=True)
class StateStats:
    """What the state file did: ``status`` is ``fresh`` (no file), ``restored`` or
    ``unreadable``; entries restored per plugin; saves and failures."""

    status: str = "fresh"
    restored: dict[str, int] = field(default_factory=dict)
    saves: int = 0
    save_failures: int = 0
    load_failures: int = 0
    last_save: float | None = None


class RoutingStateFile:
    """The snapshot file of one fleet's ``Persistent`` plugins (module docstring)."""

    def __init__(self, directory: Path, engines: Sequence[tuple[str, str]],
                 plugins: Mapping[str, object], save_s: float) -> None:
        self.digest = fleet_digest(
            engines, [f"{n}:{getattr(p, 'type_name', type(p).__name__)}"
                      for n, p in plugins.items()])
        self.path = directory / f"{self.digest}.json"
        self.plugins = {n: p for n, p in plugins.items() if isinstance(p, Persistent)}
        self.save_s = save_s
        self.stats = StateStats()
        self._task: asyncio.Task[None] | None = None

    # -- load ------------------------------------------------------------------------------
    def restore(self) -> None:
        """Hand each plugin its part of the file (if any). Never raises: a bad file is
        skipped with a WARNING."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return
        except OSError as exc:
            self._unreadable(f"cannot read it ({exc.strerror})")
            return
        try:
            doc = json.loads(raw)
        except ValueError:
            self._unreadable("it is not JSON")
            return
        if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get(
                "fleet") != self.digest or not isinstance(doc.get("plugins"), dict):
            self._unreadable(f"it is not a format-{FORMAT} file of this fleet")
            return
        self._apply(doc["plugins"])

    def _apply(self, parts: Mapping[str, object]) -> None:
        for name, plugin in self.plugins.items():
            part = parts.get(name)
            if not isinstance(part, dict):
                continue
            try:
                self.stats.restored[name] = plugin.restore(part)
            except (ValueError, TypeError, KeyError) as exc:
                self.stats.load_failures += 1
                log.warning("routing state %s: plugin %r could not restore its part (%s); it "
                            "starts fresh", self.path, name, exc)
        self.stats.status = "restored"
        log.info("routing state restored from %s: %s", self.path, self.stats.restored)

    def _unreadable(self, why: str) -> None:
        self.stats.status = "unreadable"
        self.stats.load_failures += 1
        log.warning("routing state %s skipped: %s; routing starts with fresh state", self.path,
                    why)

    # -- save ------------------------------------------------------------------------------
    def document(self) -> dict[str, object]:
        """Every plugin's snapshot, taken on the event loop (plugins mutate their state there;
        the snapshot copies it, so writing can go to a thread)."""
        return {"format": FORMAT, "fleet": self.digest, "saved_at": time.time(),
                "plugins": {name: p.snapshot() for name, p in self.plugins.items()}}

    def save(self) -> None:
        """Snapshot and write (blocking; tests and shutdown of a loop-less caller)."""
        self.write(self.document())

    def write(self, doc: Mapping[str, object]) -> None:
        """Write ``doc`` atomically. Never raises: a failure is counted and logged (the
        previous file stays)."""
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(doc, separators=(",", ":")))
            os.replace(tmp, self.path)
        except OSError as exc:
            self.stats.save_failures += 1
            log.warning("routing state %s not saved: %s", self.path, exc.strerror)
            with contextlib.suppress(OSError):
                tmp.unlink()
            return
        self.stats.saves += 1
        self.stats.last_save = time.time()
        self._prune()

    def _prune(self) -> None:
        """Keep the :data:`MAX_FILES` most recently written files of the directory."""
        try:
            files = sorted(self.path.parent.glob("*.json"), key=lambda p: p.stat().st_mtime)
        except OSError:
            return
        for old in files[:-MAX_FILES]:
            with contextlib.suppress(OSError):
                old.unlink()

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Restore, then save every ``save_s`` seconds until :meth:`stop`."""
        self.restore()
        if self.plugins and self._task is None:
            self._task = asyncio.create_task(self._loop(), name="routing-state")

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.save_s)
            await asyncio.to_thread(self.write, self.document())

    async def stop(self) -> None:
        """Stop the periodic save and write a last snapshot."""
        if self._task is not None:
            await cancel_and_wait(self._task)
            if not self._task.cancelled():
                self._task.result()  # a failed save loop still raises, as before
            self._task = None
        if self.plugins:
            await asyncio.to_thread(self.write, self.document())

    def health(self) -> dict[str, object]:
        return {"status": self.stats.status, "restored": dict(self.stats.restored),
                "saves": self.stats.saves, "save_failures": self.stats.save_failures,
                "load_failures": self.stats.load_failures}

    def collector(self) -> Collector:
        return _StateCollector(self.stats)


class _StateCollector(Collector):
    def __init__(self, stats: StateStats) -> None:
        self._s = stats

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        s = self._s
        yield CounterMetricFamily("kvgate_routing_state_saves", "Routing state snapshots written",
                                  value=s.saves)
        failures = CounterMetricFamily("kvgate_routing_state_failures",
                                       "Routing state files not written or not restored",
                                       labels=["op"])
        failures.add_metric(["save"], s.save_failures)
        failures.add_metric(["load"], s.load_failures)
        yield failures
        restored = GaugeMetricFamily("kvgate_routing_state_restored_entries",
                                     "Entries restored at startup, per plugin",
                                     labels=["plugin"])
        for name, count in sorted(s.restored.items()):
            restored.add_metric([name], count)
        yield restored
