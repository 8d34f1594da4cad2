"""Talking to one engine: open a request, classify failures, relay JSON or SSE.

Failures before the first byte raise :class:`UpstreamError` (``retryable`` says whether another
engine may be tried); engine 4xx answers raise :class:`UpstreamHTTPError` carrying the engine's
own body, which the client gets unchanged.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from middleware.asgi import Send
from middleware.engine import EngineAdapter
from middleware.errors import UpstreamError, UpstreamHTTPError
from middleware.sse import SSETap, error_event
from middleware.types import Usage

_HOP_HEADERS = (b"content-type", b"application/json")


@dataclass(slots=True)
class Progress:
    """What happened on the wire so far; read by the gateway to build the Outcome."""

    status: int = 0
    first_byte_at: float | None = None
    usage: Usage | None = None
    events: int = 0
    broken: str | None = None  # why the stream ended early, if it did
    usage_reported: bool = False
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)


async def open_request(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    headers: Mapping[str, str],
    timeout: aiohttp.ClientTimeout,  # noqa: ASYNC109 - aiohttp's own per-request timeout
) -> aiohttp.ClientResponse:
    """POST to the engine; returns a 2xx response whose body is still unread."""
    try:
        resp = await session.post(url, data=body, headers=headers, timeout=timeout)
    except TimeoutError:
        raise UpstreamError(f"engine did not answer within {timeout.total} s", status=504) from None
    except aiohttp.ClientError as exc:
        raise UpstreamError(
            f"cannot reach engine: {type(exc).__name__}: {exc}",
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
    if resp.status >= 500 or resp.status == 429:
        raise UpstreamError(f"engine answered {resp.status}", retryable=True)
    content_type = resp.headers.get("content-type", "application/json")
    raise UpstreamHTTPError(resp.status, payload, content_type)


async def read_json_response(
    resp: aiohttp.ClientResponse, adapter: EngineAdapter, progress: Progress
) -> bytes:
    """Read a non-streaming answer whole and extract its usage."""
    try:
        body = await resp.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise UpstreamError(f"engine broke off its answer: {type(exc).__name__}") from None
    finally:
        resp.release()
    progress.first_byte_at = time.monotonic()
    progress.status = resp.status
    try:
        payload: Any = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UpstreamError("engine answered with invalid JSON", retryable=False) from None
    if isinstance(payload, dict):
        progress.usage = adapter.extract_usage(payload)
    return body


async def first_chunk(resp: aiohttp.ClientResponse) -> bytes:
    """The stream's first bytes; failing here still allows a retry elsewhere."""
    try:
        chunk = await resp.content.readany()
    except (aiohttp.ClientError, TimeoutError) as exc:
        resp.release()
        raise UpstreamError(f"engine stream failed before its first byte: {exc}") from None
    if not chunk:
        resp.release()
        raise UpstreamError("engine closed the stream before its first byte")
    return chunk


async def relay_stream(
    resp: aiohttp.ClientResponse,
    first: bytes,
    send: Send,
    tap: SSETap,
    progress: Progress,
    on_usage: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Send headers then every event as it arrives; a broken upstream ends with an error event.

    ``on_usage`` is awaited once, as soon as the engine's usage is known (``progress.usage``
    set) and *before* the bytes that carry it (and ``[DONE]``) are sent: what a usage hook does
    (a durable ledger record) is done before the client can see its stream end.
    Cancellation (client disconnect) closes the upstream connection, which aborts the
    engine's request.
    """
    await send({"type": "http.response.start", "status": 200, "headers": progress.headers})
    progress.status = 200
    progress.first_byte_at = time.monotonic()
    try:
        chunk = first
        while chunk:
            out = tap.feed(chunk)
            if on_usage is not None and tap.usage is not None:
                progress.usage, callback, on_usage = tap.usage, on_usage, None
                await callback()
            if out:
                await send({"type": "http.response.body", "body": out, "more_body": True})
            chunk = await resp.content.readany()
    except (aiohttp.ClientError, TimeoutError, asyncio.IncompleteReadError) as exc:
        progress.broken = f"engine stream broke: {type(exc).__name__}"
    finally:
        resp.close()
        progress.usage, progress.events = tap.usage, tap.events
    if progress.broken is None and not tap.done:
        progress.broken = "engine stream ended without [DONE]"
    tail = tap.flush() if progress.broken is None else b""
    if progress.broken is not None:
        tail += error_event(progress.broken)
    await send({"type": "http.response.body", "body": tail, "more_body": False})
