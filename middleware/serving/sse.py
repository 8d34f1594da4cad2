"""Server-sent-events relay: an engine's stream passed on event by event, never buffering more
than one incomplete event, while the API's :class:`~kvgate.middleware.framework.api.UsageTap` reads
the events that carry usage (and may edit or drop them).

Only events whose bytes contain one of the tap's ``markers`` are parsed (orjson); the others,
and whole chunks without a marker, are relayed as received.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from kvgate.middleware.framework.api import SseEvent, UsageTap
from kvgate.middleware.framework.types import Usage

_SEP = b"\n\n"
_DONE = b"[DONE]"
_DATA = b"data: "
_DONE_EVENT = b"data: [DONE]\n\n"
#: The largest incomplete event the relay holds [bytes]; past it the stream counts as broken.
#: 16 MiB: the biggest legitimate event is a Responses ``response.completed``, which echoes the
#: response object (output, instructions, tools: bounded by the request's 8 MiB
#: ``server.max_body_bytes`` plus the output), so twice that default; a vLLM chunk is KiBs.
MAX_EVENT_BYTES = 16 * 1024 * 1024


class EventTooLarge(ValueError):
    """An engine's SSE event grew past :data:`MAX_EVENT_BYTES` without ending."""

#: Edits a usage-carrying event's data for the client (P/D: the prefill side's cache hit) and
#: returns the usage the client and the hooks see.
Adjust = Callable[[dict[str, Any], Usage], Usage]


class EventRelay:
    """Feed it upstream bytes; it returns the bytes to send to the client.

    ``usage`` is the tap's usage after ``adjust``; ``done`` whether ``data: [DONE]`` arrived;
    ``events`` the data events relayed. Memory: at most one incomplete event (``pending``), of
    at most :data:`MAX_EVENT_BYTES` (past it ``overflow``, and the next ``feed`` raises
    :class:`EventTooLarge`: the stream is broken).
    """

    __slots__ = ("_adjust", "_markers", "_pending", "_seen", "done", "events", "overflow", "tap",
                 "usage")

    def __init__(self, tap: UsageTap, adjust: Adjust | None = None) -> None:
        self.tap = tap
        self._markers: tuple[bytes, ...] | None = getattr(tap, "markers", None)
        self._adjust = adjust
        self._pending = b""
        #: An incomplete event outgrew MAX_EVENT_BYTES (dropped): the stream is broken.
        self.overflow = False
        self._seen: Usage | None = None
        self.usage: Usage | None = None
        self.done = False
        self.events = 0

    def _marked(self, data: bytes) -> bool:
        markers = self._markers
        return markers is None or any(m in data for m in markers)

    def feed(self, chunk: bytes) -> bytes:
        if self.done:
            return b""  # nothing after the end marker reaches the client
        if self.overflow:
            raise EventTooLarge(f"engine event over {MAX_EVENT_BYTES} bytes without its end")
        data = self._pending + chunk if self._pending else chunk
        if _DONE in data:  # cheap guard; the exact end is looked for only then
            end = _done_end(data)
            if end >= 0:
                data, self._pending = data[:end], b""
        if data.endswith(_SEP) and not self._marked(data):
            self._pending = b""  # fast path: whole events, nothing to inspect
            self._count(data)
            return data
        cut = data.rfind(_SEP)
        if cut < 0:
            self._pending = self._bounded(data)
            return b""
        complete, self._pending = data[: cut + 2], self._bounded(data[cut + 2 :])
        if not self._marked(complete):
            self._count(complete)
            return complete
        return b"".join(self._event(e) for e in complete.split(_SEP)[:-1])

    def _bounded(self, pending: bytes) -> bytes:
        """``pending``, unless it outgrew the bound: then dropped, and the next ``feed`` raises
        :class:`EventTooLarge` (the whole events before it are still relayed)."""
        if len(pending) <= MAX_EVENT_BYTES:
            return pending
        self.overflow = True
        return b""

    def _count(self, data: bytes) -> None:
        self.events += data.count(_DATA)
        if _DONE in data and _done_end(data) >= 0:
            self.done = True
            self.events -= 1

    def _event(self, event: bytes) -> bytes:
        out = event + _SEP
        self._count(out)
        if not self._marked(event):
            return out
        head, payload = _split(event)
        if payload is None:
            return out
        keep = self.tap.on_event(SseEvent(_name(head), payload))
        self._track(payload)
        if not keep:
            self.events -= 1
            return b""
        return b"".join(line + b"\n" for line in head) + _DATA + orjson.dumps(payload) + _SEP

    def _track(self, payload: dict[str, Any]) -> None:
        usage = self.tap.usage
        if usage is None or usage is self._seen:
            return
        self._seen = usage
        self.usage = usage if self._adjust is None else self._adjust(payload, usage)

    def flush(self) -> bytes:
        """Whatever incomplete event remains when the upstream ends, terminated (the client's
        stream always ends on an event boundary); nothing once the end marker was relayed."""
        rest, self._pending = self._pending, b""
        return rest + _SEP if rest.strip() else b""


def _done_end(data: bytes) -> int:
    """Where the ``data: [DONE]`` event ends in ``data`` (the index past its blank line), or -1.
    Only a whole line counts: ``data: {"x": "data: [DONE]"}`` is not the end marker."""
    at = data.find(_DONE_EVENT)
    while at >= 0:
        if at == 0 or data[at - 1] == 0x0A:  # at a line start
            return at + len(_DONE_EVENT)
        at = data.find(_DONE_EVENT, at + 1)
    return -1


def _split(event: bytes) -> tuple[list[bytes], dict[str, Any] | None]:
    """An event's non-data lines and its data parsed as a JSON object (None: not one)."""
    head: list[bytes] = []
    data: list[bytes] = []
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            data.append(line[5:].lstrip())
        else:
            head.append(line)
    if not data or data == [_DONE]:
        return head, None
    try:
        value = orjson.loads(b"\n".join(data))
    except orjson.JSONDecodeError:
        return head, None
    return head, value if isinstance(value, dict) else None


def _name(head: list[bytes]) -> str | None:
    for line in head:
        if line.startswith(b"event:"):
            return line[6:].strip().decode("utf-8", "replace")
    return None


def error_event(message: str, code: str = "upstream_error") -> bytes:
    """The OpenAI SSE event that ends a stream the engine broke (OpenAI clients raise on it)."""
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return _DATA + orjson.dumps(body) + _SEP
