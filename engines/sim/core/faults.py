"""Fault injection for gateway tests (``POST`` / ``GET`` / ``DELETE /sim/faults``).

``POST /sim/faults`` with a JSON :class:`FaultSpec` sets the fields it names (others keep their
current value); ``DELETE`` clears everything. Faults apply to inference requests
(``/v1/chat/completions``, ``/v1/completions``) only:

* ``fail_next`` N with ``status`` S (default 503): the next N requests answer S at once with an
  error body (OpenAI's shape; Anthropic's on ``/v1/messages``) whose message is ``message``
  (default ``simulated engine failure (fault injection)``), before reaching the engine; with
  ``match`` T, only requests whose raw body contains the text T fail (and count): an input
  that makes the engine fail, while other requests are served;
* ``drop_after_chunks`` N (with ``drop_streams`` K, default 1): the next K streaming requests
  send N SSE events, then the connection is cut without ``data: [DONE]`` (an engine dying
  mid-stream; the request is aborted in the engine);
* ``delay_first_byte_s`` D: every request waits D seconds before its response starts, until
  cleared;
* ``health`` false: ``GET /health`` answers 503 until set true or cleared.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class FaultSpec(BaseModel):
    """Body of ``POST /sim/faults``; every field optional."""

    model_config = ConfigDict(extra="forbid")

    fail_next: int | None = Field(default=None, ge=0)
    status: int | None = Field(default=None, ge=400, le=599)
    drop_after_chunks: int | None = Field(default=None, ge=0)
    drop_streams: int | None = Field(default=None, ge=0)
    delay_first_byte_s: float | None = Field(default=None, ge=0, le=3600)
    health: bool | None = None
    message: str | None = Field(default=None, min_length=1)
    match: str | None = Field(default=None, min_length=1)


#: The failure's message unless ``message`` says otherwise.
DEFAULT_MESSAGE = "simulated engine failure (fault injection)"


@dataclass(slots=True)
class FaultState:
    """Current faults of one simulated engine (plain counters: bounded by construction)."""

    fail_next: int = 0
    status: int = 503
    drop_after_chunks: int | None = None
    drop_streams: int = 0
    delay_first_byte_s: float = 0.0
    health: bool = True
    message: str = DEFAULT_MESSAGE
    match: str | None = None

    def apply(self, spec: FaultSpec) -> None:
        """Set what ``spec`` names. ``drop_after_chunks`` alone arms one stream."""
        if spec.fail_next is not None:
            self.fail_next = spec.fail_next
        if spec.status is not None:
            self.status = spec.status
        if spec.drop_after_chunks is not None:
            self.drop_after_chunks = spec.drop_after_chunks
            self.drop_streams = 1 if spec.drop_streams is None else spec.drop_streams
        elif spec.drop_streams is not None:
            self.drop_streams = spec.drop_streams
        if spec.delay_first_byte_s is not None:
            self.delay_first_byte_s = spec.delay_first_byte_s
        if spec.health is not None:
            self.health = spec.health
        if spec.message is not None:
            self.message = spec.message
        if spec.match is not None:
            self.match = spec.match

    def clear(self) -> None:
        self.fail_next = 0
        self.status = 503
        self.drop_after_chunks = None
        self.drop_streams = 0
        self.delay_first_byte_s = 0.0
        self.health = True
        self.message = DEFAULT_MESSAGE
        self.match = None

    def take_failure(self, body: bytes = b"") -> int | None:
        """The status to fail this request (raw ``body``) with, consuming one ``fail_next``;
        else None (none left, or ``match`` is not in ``body``)."""
        if self.fail_next <= 0 or (self.match is not None and self.match.encode() not in body):
            return None
        self.fail_next -= 1
        return self.status

    def take_drop(self) -> int | None:
        """For a stream: after how many SSE events to cut it, consuming one; else None."""
        if self.drop_after_chunks is None or self.drop_streams <= 0:
            return None
        self.drop_streams -= 1
        return self.drop_after_chunks

    def snapshot(self) -> dict[str, Any]:
        return {
            "fail_next": self.fail_next,
            "status": self.status,
            "drop_after_chunks": self.drop_after_chunks,
            "drop_streams": self.drop_streams,
            "delay_first_byte_s": self.delay_first_byte_s,
            "health": self.health,
            "message": self.message,
            "match": self.match,
        }
