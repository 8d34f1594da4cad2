"""Talking to one engine: open a request, classify failures, relay JSON or SSE.

Failures before the first byte raise :class:`UpstreamError` (``retryable`` says whether another
engine may be tried); engine 4xx answers raise :class:`UpstreamHTTPError` (the client's fault:
its status and the engine's cleaned message, rendered in the API's shape), except 408 and 429:
the engine's load (it timed the request out in its queue, or is at its limit), retried on
another engine and, like a client's fault, never counted against the engine's breaker.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import aiohttp
import orjson

from kvgate.middleware.framework.errors import UpstreamError, UpstreamHTTPError
from kvgate.middleware.framework.redact import scrub
from kvgate.middleware.framework.types import Send
from kvgate.middleware.serving.context import Attempt
from kvgate.middleware.serving.sse import EventRelay, EventTooLarge
from kvgate.middleware.transport.h1client import H1Client, H1Response

#: Engine 4xx answers that mean load, not a bad request, and the status the client gets when no
#: other engine takes the request: 408 (the engine timed it out waiting) as a gateway timeout,
#: 429 (at its limit) as 502, as before.
ENGINE_LOAD = {408: 504, 429: 502}
#: The engine hop's HTTP client (the lean one for ``http://`` engines) and its response.
Client = aiohttp.ClientSession | H1Client
Response = aiohttp.ClientResponse | H1Response


async def open_request(
    session: Client,
    url: str,
    body: bytes | None,
    headers: Mapping[str, str],
    timeout: aiohttp.ClientTimeout,  # noqa: ASYNC109 - aiohttp's own per-request timeout
    method: str = "POST",
) -> Response:
    """Send to the engine (POST by default); returns a 2xx response whose body is unread."""
    try:
        resp = await session.request(method, url, data=body, headers=headers, timeout=timeout)
    except TimeoutError:
        raise UpstreamError(f"engine did not answer within {timeout.total} s", status=504) from None
    except aiohttp.ClientError as exc:
        # the client sees it: no engine address (middleware/framework/redact.py)
        raise UpstreamError(
            f"cannot reach engine: {type(exc).__name__}: {scrub(str(exc))}",
            unreachable=isinstance(exc, aiohttp.ClientConnectionError),
        ) from None
    if resp.status < 400:
        return resp
    try:
        payload = await resp.read()
    except aiohttp.ClientError:
        payload = b""
    finally:
        resp.release()
    if resp.status >= 500:
        raise UpstreamError(f"engine answered {resp.status}", retryable=True)
    if resp.status in ENGINE_LOAD:  # busy, not broken: another engine may take it
        raise UpstreamError(f"engine answered {resp.status}", status=ENGINE_LOAD[resp.status],
                            retryable=True, engine_fault=False)
    raise UpstreamHTTPError(resp.status, payload)


async def read_answer(resp: Response, attempt: Attempt | None) -> bytes:
    """Read a non-streaming answer whole (the attempt records its status and first byte)."""
    try:
        body = await resp.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise UpstreamError(f"engine broke off its answer: {type(exc).__name__}") from None
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
        raise UpstreamError("engine answered with invalid JSON", retryable=False) from None
    return payload if isinstance(payload, dict) else None


async def first_chunk(resp: Response) -> bytes:
    """The stream's first bytes; failing here still allows a retry elsewhere."""
    try:
        chunk = await resp.content.readany()
    except (aiohttp.ClientError, TimeoutError) as exc:
        resp.release()
        raise UpstreamError(
            f"engine stream failed before its first byte: {scrub(str(exc))}") from None
    if not chunk:
        resp.release()
        raise UpstreamError("engine closed the stream before its first byte")
    return chunk


async def relay_stream(
    resp: Response,
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
    record) is done before the client can see its stream end. Cancellation (client
    disconnect) closes the upstream connection, which aborts the engine's request.
    """
    await send({"type": "http.response.start", "status": 200, "headers": attempt.headers})
    attempt.status = 200
    attempt.first_byte_at = time.monotonic()
    tap = relay.tap
    idle = asyncio.timeout(None)
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
                chunk = await resp.content.readany()
    except TimeoutError:  # this silence, or the request's whole deadline
        attempt.broken = f"engine stream stalled: no bytes for {idle_s} s" \
            if idle.expired() else "engine stream broke: TimeoutError"
    except (aiohttp.ClientError, asyncio.IncompleteReadError, EventTooLarge) as exc:
        attempt.broken = f"engine stream broke: {type(exc).__name__}"
    finally:
        resp.close()
        attempt.usage, attempt.events = relay.usage, relay.events
    complete = relay.done if getattr(tap, "sse_done", False) else (relay.done or tap.final)
    if relay.overflow and attempt.broken is None:
        attempt.broken = "engine stream broke: EventTooLarge"
    if attempt.broken is None and not complete:
        attempt.broken = "engine stream ended before its end"
    tail = relay.flush() if attempt.broken is None else stream_error(attempt.broken)
    await send({"type": "http.response.body", "body": tail, "more_body": False})
