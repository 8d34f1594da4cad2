"""The placement scorer's session pins (plugins/placement/scorer.py): per session, the engine it
used last and the prompt tokens it sent there, and after a restart the restored pins as hints
until each session's next dispatch (the index cannot see prefixes stored before the restart, so
the pinned engine is taken to hold what the session sent it). Bounded: ``max_sessions`` pins,
least recently used evicted first; the hints are a subset of the pins."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Set

from kvgate.middleware.framework.types import EndpointId
from kvgate.plugins.placement.state import PlacementStats


class SessionPins:
    """Pins by scoped session key, least recent first (module docstring)."""

    def __init__(self, max_sessions: int, stats: PlacementStats) -> None:
        self.max_sessions = max_sessions
        self.stats = stats
        #: session -> (engine it used last, prompt tokens it sent there), least recent first
        self.entries: OrderedDict[str, tuple[EndpointId, int]] = OrderedDict()
        self.hints: dict[str, tuple[EndpointId, int]] = {}

    def of(self, session: str | None) -> EndpointId | None:
        """The session's engine (its pin refreshed, counted), or None."""
        if session is None:
            return None
        entry = self.entries.get(session)
        if entry is None:
            return None
        self.entries.move_to_end(session)
        self.stats.pins_used += 1
        return entry[0]

    def pin(self, session: str, engine: EndpointId, tokens: int) -> None:
        """The session went to ``engine`` with a ``tokens``-token prompt; its hint is used up."""
        if self.hints.pop(session, None) is not None:
            self.stats.hints_used += 1
        self.entries[session] = (engine, tokens)
        self.entries.move_to_end(session)
        while len(self.entries) > self.max_sessions:
            self.entries.popitem(last=False)
            self.stats.pins_evicted += 1

    def snapshot(self) -> list[list[object]]:
        return [[s, e, t] for s, (e, t) in self.entries.items()]

    def restore(self, pins: object) -> int:
        """Take back :meth:`snapshot` (TypeError when malformed): the most recent
        ``max_sessions`` pins, each also a hint."""
        if not isinstance(pins, list):
            raise TypeError("pins must be a list")
        restored: OrderedDict[str, tuple[EndpointId, int]] = OrderedDict()
        for session, engine, tokens in pins[-self.max_sessions:]:
            restored[str(session)] = (str(engine), int(tokens))
        self.entries = restored
        self.hints = dict(restored)
        return len(restored)

    def forget_engines(self, gone: Set[EndpointId]) -> None:
        for session in [s for s, (e, _) in self.entries.items() if e in gone]:
            del self.entries[session]
            self.hints.pop(session, None)


__all__ = ["SessionPins"]
