"""ASGI plumbing for engine-backed answers: client-disconnect watching and the SSE response.

While an answer is being produced, a watcher task awaits the ASGI ``http.disconnect`` message;
when the client goes away it aborts the engine request at once (vLLM does the same), so the
request leaves the batch and frees its KV blocks even if no token was due yet.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from typing import TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


class SimulatedDrop(ConnectionAbortedError):
    """Raised inside a streaming response to cut the connection (fault injection)."""


async def watch_disconnect(receive: Receive, on_disconnect: Callable[[], None]) -> None:
    """Call ``on_disconnect`` when the client disconnects (after the request body was read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            on_disconnect()
            return


async def until_done_or_disconnect(
    receive: Receive, work: Awaitable[T], on_disconnect: Callable[[], None]
) -> T:
    """Await ``work`` while watching for a disconnect (which should make ``work`` end)."""
    watcher = asyncio.create_task(watch_disconnect(receive, on_disconnect))
    try:
        return await work
    finally:
        watcher.cancel()  # not awaited: awaiting here could swallow our own cancellation


class EventStreamResponse(Response):
    """``text/event-stream`` from an async generator of ready SSE events.

    Parameters:
        events: complete SSE events (bytes); closed when the response ends, however it ends.
        on_disconnect: called when the client disconnects mid-stream.
        drop_after: if set, the connection is cut (:class:`SimulatedDrop` raised, so the server
            closes it without finishing the chunked body) right after this many events.
        headers: extra response headers.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncGenerator[bytes, None],
        on_disconnect: Callable[[], None],
        drop_after: int | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.status_code = 200
        self.background = None
        self._events = events
        self._on_disconnect = on_disconnect
        self._drop_after = drop_after
        self.init_headers({"cache-control": "no-cache", **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watcher = asyncio.create_task(watch_disconnect(receive, self._on_disconnect))
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            self._check_drop(0)
            sent = 0
            async for event in self._events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
                sent += 1
                self._check_drop(sent)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watcher.cancel()
            await self._events.aclose()

    def _check_drop(self, sent: int) -> None:
        if self._drop_after is not None and sent >= self._drop_after:
            self._on_disconnect()
            raise SimulatedDrop(f"simulated engine failure after {sent} SSE events")
