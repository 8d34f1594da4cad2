"""Reading an engine's answer: whole (JSON) or relayed event by event (SSE).

The request itself is opened by the engine call (middleware/transport/engine_call.py), which raises
the
failures before an answer and turns error statuses into their classes; what can go wrong
while the answer is read is a :class:`~kvgate.middleware.framework.errors.StreamBroken` (before the
first byte
relayed: retried elsewhere) or a broken stream (after it: the API's error event ends it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from kvgate.middleware.framework.errors import BadAnswer, StreamBroken, UpstreamError
from kvgate.middleware.framework.redact import scrub
from kvgate.middleware.framework.types import Send
from kvgate.middleware.serving.context import Attempt
from kvgate.middleware.serving.sse import EventRelay, EventTooLarge
from kvgate.middleware.transport.engine_call import EngineResponse


async def read_answer(resp: EngineResponse, attempt: Attempt | None) -> bytes:
    """Read a non-streaming answer whole (the attempt records its status and first byte)."""
    try:
        body = await resp.read()
    except (UpstreamError, TimeoutError) as exc:
        raise StreamBroken(f"engine broke off its answer: {type(exc).__name__}") from None
    finally:
        resp.release()
    if attempt is not None:
        attempt.first_byte_at = time.monotonic()
        attempt.status = resp.status
    return body


def parse_answer(body: bytes) -> dict[str, Any] | None:
    """An answer's JSON (None: valid JSON but not an object); invalid JSON is an error."""
    try:
        payload: Any = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise BadAnswer("engine answered with invalid JSON") from None
    return payload if isinstance(payload, dict) else None


async def first_chunk(resp: EngineResponse) -> bytes:
    """The stream's first bytes; failing here still allows a retry elsewhere."""
    try:
        chunk = await resp.receive()
    except (UpstreamError, TimeoutError) as exc:
        resp.release()
        raise StreamBroken(
            f"engine stream failed before its first byte: {scrub(str(exc))}") from None
    if not chunk:
        resp.release()
        raise StreamBroken("engine closed the stream before its first byte")
    return chunk


def end_exchange(resp: EngineResponse, read_to_end: bool) -> None:
    """A streamed answer is over: its connection back to the pool when its body was read to
    the end (``release`` keeps it only then), else closed (the engine sees the client go)."""
    if read_to_end:
        resp.release()
    else:
        resp.close()


async def relay_stream(
    resp: EngineResponse,
    first: bytes,
    send: Send,
    relay: EventRelay,
    attempt: Attempt,
    stream_error: Callable[[str], bytes],
    on_final: Callable[[], Awaitable[None]] | None = None,
    idle_s: float | None = None,
) -> None:
    """Send headers then every event as it arrives; a broken upstream ends with
    ``stream_error`` (the API's own error event). An engine silent for ``idle_s`` seconds
    after its first byte has broken its stream (a wedged engine, not a slow one).

    ``on_final`` is awaited once, as soon as the tap's usage is final and *before* the bytes
    that carry it (and the stream's end) are sent: what a usage hook does (a durable ledger
    record) is done before the client can see its stream end. A stream read to its end gives
    its connection back to the pool (one connection carries a session's turns, as for whole
    answers); cancellation (client disconnect) or a broken stream closes it, which aborts
    the engine's request.
    """
    await send({"type": "http.response.start", "status": 200, "headers": attempt.headers})
    attempt.status = 200
    attempt.first_byte_at = time.monotonic()
    tap = relay.tap
    idle = asyncio.timeout(None)
    ended = False
    try:
        chunk = first
        while chunk:
            out = relay.feed(chunk)
            if on_final is not None and tap.final:
                attempt.usage, callback, on_final = relay.usage, on_final, None
                await callback()
            if out:
                await send({"type": "http.response.body", "body": out, "more_body": True})
            async with asyncio.timeout(idle_s) as idle:
                chunk = await resp.receive()
        ended = True
    except TimeoutError:  # this silence, or the request's whole deadline
        attempt.broken = f"engine stream stalled: no bytes for {idle_s} s" \
            if idle.expired() else "engine stream broke: TimeoutError"
    except (UpstreamError, asyncio.IncompleteReadError, EventTooLarge) as exc:
        attempt.broken = f"engine stream broke: {type(exc).__name__}"
    finally:
        end_exchange(resp, ended)
        attempt.usage, attempt.events = relay.usage, relay.events
    complete = relay.done if getattr(tap, "sse_done", False) else (relay.done or tap.final)
    if relay.overflow and attempt.broken is None:
        attempt.broken = "engine stream broke: EventTooLarge"
    if attempt.broken is None and not complete:
        attempt.broken = "engine stream ended before its end"
    tail = relay.flush() if attempt.broken is None else stream_error(attempt.broken)
    await send({"type": "http.response.body", "body": tail, "more_body": False})
