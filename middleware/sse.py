"""Server-sent-events tap: relays an engine's stream event by event, never buffering more than
one incomplete event, while picking up the usage chunk and, if the client did not ask for it,
removing it from the client's stream.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from middleware.types import Usage

_SEP = b"\n\n"
_DONE = b"data: [DONE]"
_USAGE_MARKERS = (b'"usage":{', b'"usage": {')


class SSETap:
    """Feed it upstream bytes; it returns the bytes to send to the client.

    ``extract`` turns one parsed chunk into a Usage (the engine adapter's ``extract_usage``).
    ``strip_usage`` drops the usage-only chunk (``choices: []``) the gateway asked for on the
    client's behalf. Memory: at most one incomplete event is held (``pending``).
    """

    __slots__ = ("_extract", "_pending", "_rewrite", "_strip", "done", "events", "usage")

    def __init__(
        self, extract: Callable[[Mapping[str, Any]], Usage | None], strip_usage: bool,
        rewrite: Callable[[dict[str, Any]], bool] | None = None,
    ) -> None:
        self._extract = extract
        self._strip = strip_usage
        #: Edits a usage-carrying chunk in place before it is read and relayed (prefill/decode
        #: usage rewrite); returns whether it changed anything.
        self._rewrite = rewrite
        self._pending = b""
        self.usage: Usage | None = None
        self.done = False
        self.events = 0

    def feed(self, chunk: bytes) -> bytes:
        data = self._pending + chunk if self._pending else chunk
        if data.endswith(_SEP) and not any(m in data for m in _USAGE_MARKERS):
            # Fast path: whole events, no usage to inspect.
            self._pending = b""
            self._count(data)
            return data
        cut = data.rfind(_SEP)
        if cut < 0:
            self._pending = data
            return b""
        complete, self._pending = data[: cut + 2], data[cut + 2 :]
        if not any(m in complete for m in _USAGE_MARKERS):
            self._count(complete)
            return complete
        return b"".join(self._event(e) for e in complete.split(_SEP)[:-1])

    def _count(self, data: bytes) -> None:
        self.events += data.count(b"data: ")
        if _DONE in data:
            self.done = True
            self.events -= 1

    def _event(self, event: bytes) -> bytes:
        self._count(event)
        out = event + _SEP
        if not any(m in event for m in _USAGE_MARKERS):
            return out
        payload = _data_json(event)
        if payload is None:
            return out
        changed = self._rewrite(payload) if self._rewrite is not None else False
        usage = self._extract(payload)
        if usage is not None:
            self.usage = usage
            if self._strip and payload.get("choices") == []:
                self.events -= 1
                return b""
            if self._strip:
                payload.pop("usage", None)
                return b"data: " + json.dumps(payload).encode() + _SEP
        if changed:
            return b"data: " + json.dumps(payload).encode() + _SEP
        return out

    def flush(self) -> bytes:
        """Whatever incomplete event remains when the upstream ends."""
        rest, self._pending = self._pending, b""
        return rest


def _data_json(event: bytes) -> dict[str, Any] | None:
    lines = [ln[5:].lstrip() for ln in event.split(b"\n") if ln.startswith(b"data:")]
    if not lines:
        return None
    try:
        value = json.loads(b"\n".join(lines))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return value if isinstance(value, dict) else None


def error_event(message: str, code: str = "upstream_error") -> bytes:
    """The SSE event that ends a stream the engine broke (OpenAI clients raise on it)."""
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return b"data: " + json.dumps(body).encode() + _SEP
