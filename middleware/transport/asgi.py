"""Minimal raw-ASGI helpers for the hot path (no framework objects per request).

The gateway speaks raw ASGI because Starlette's Request/Response objects, middleware stack and
background-task plumbing cost measurable CPU per request (see docs/benchmarks.md); the few
things we need (read a bounded body, send JSON, relay a stream, notice a disconnect) fit here.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterable
from typing import Protocol

from kvgate.middleware.framework.errors import BadRequest, ClientGone, PayloadTooLarge
from kvgate.middleware.framework.types import Headers, Message, Receive, Scope, Send

__all__ = ["DISCONNECT_EXTENSION", "JSON_CT", "SSE_HEADERS", "ClientGone", "DisconnectSource",
           "Headers", "Message", "Receive", "ReceiveWatch", "Scope", "Send", "disconnect_source",
           "disconnect_watcher", "header_map", "read_body", "send_bytes", "send_json",
           "wait_disconnect"]

JSON_CT = (b"content-type", b"application/json")
SSE_HEADERS: Headers = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


def header_map(scope: Scope) -> dict[str, str]:
    """Request headers, lower-cased names, latin-1 decoded; repeated headers keep the last."""
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}


async def read_body(receive: Receive, headers: dict[str, str], limit: int) -> bytes:
    """The whole request body, refusing more than ``limit`` bytes (413) before reading it."""
    declared = headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise BadRequest("invalid Content-Length header")
        if int(declared) > limit:
            raise PayloadTooLarge(f"request body of {declared} bytes exceeds {limit}")
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def send_bytes(
    send: Send, status: int, body: bytes, headers: Iterable[tuple[bytes, bytes]]
) -> None:
    out = [*headers, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": out})
    await send({"type": "http.response.body", "body": body})


async def send_json(
    send: Send, status: int, payload: object, headers: Iterable[tuple[bytes, bytes]] = ()
) -> None:
    await send_bytes(send, status, json.dumps(payload).encode(), [JSON_CT, *headers])


async def wait_disconnect(receive: Receive) -> None:
    """Returns when the client disconnects (the request body must already be consumed)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def disconnect_watcher(receive: Receive) -> asyncio.Task[None]:
    return asyncio.ensure_future(wait_disconnect(receive))


#: The scope extension under which kvgate's own HTTP server (middleware/transport/h1server.py)
#: gives a
#: request's :class:`DisconnectSource`: the dispatcher then learns of a client that left from
#: a callback instead of a watcher task per request (``race`` in middleware/serving/dispatch.py).
DISCONNECT_EXTENSION = "kvgate.disconnect"


class DisconnectSource(Protocol):
    """Tells when the client of one request disconnects before its response is complete."""

    @property
    def disconnected(self) -> bool: ...

    def watch(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once, from the event loop, if the client disconnects."""

    def unwatch(self, callback: Callable[[], None]) -> None:
        """Stop watching (no-op when ``callback`` was called or never watched)."""


class ReceiveWatch:
    """A :class:`DisconnectSource` over ``receive``, for servers that offer none: a watcher
    task awaits the ``http.disconnect`` (the request body must already be consumed);
    ``unwatch`` also stops the task."""

    __slots__ = ("_callbacks", "_task")
    disconnected = False  # learnt only through the callbacks

    def __init__(self, receive: Receive) -> None:
        self._callbacks: list[Callable[[], None]] = []
        self._task = disconnect_watcher(receive)
        self._task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is not None:
            return
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def watch(self, callback: Callable[[], None]) -> None:
        self._callbacks.append(callback)

    def unwatch(self, callback: Callable[[], None]) -> None:
        if callback in self._callbacks:
            self._callbacks.remove(callback)
        self._task.cancel()


def disconnect_source(scope: Scope) -> DisconnectSource | None:
    """The server's disconnect source for ``scope``, if it offers one (else None: the
    dispatcher watches ``receive`` instead)."""
    extensions = scope.get("extensions")
    if not extensions:
        return None
    source: DisconnectSource | None = extensions.get(DISCONNECT_EXTENSION)
    return source
