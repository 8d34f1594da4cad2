"""The engine call (middleware/transport/engine_call.py) over both transports, the lean HTTP/1.1 client
and aiohttp, against a raw asyncio HTTP server: what it sends, and the error class of every
way an engine can fail (middleware/framework/errors.py), alike for both."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping

import aiohttp
import pytest

from kvgate.middleware.framework.errors import (
    EngineBusy,
    EngineFailed,
    EngineTimeout,
    StreamBroken,
    Unreachable,
    UpstreamError,
    UpstreamHTTPError,
)
from kvgate.middleware.framework.types import Endpoint
from kvgate.middleware.observe.tracing import Tracing
from kvgate.middleware.serving.upstream import read_answer
from kvgate.middleware.transport.engine_call import AiohttpTransport, EngineCall, Timeouts
from kvgate.middleware.transport.h1client import H1Client
from tests.unit.middleware.test_h1client import (
    Handler,
    _broken,
    _fixed,
    _silent,
    serving,
)

TIMEOUTS = Timeouts(total=0.5, connect=0.5)


class Book:
    """The pool's side of the call: an engine's headers, and who was reported unreachable."""

    def __init__(self) -> None:
        self.failed: list[tuple[str, str]] = []

    def headers(self, endpoint_id: str) -> Mapping[str, str]:
        return {"authorization": f"Bearer key-of-{endpoint_id}"}

    def report_failure(self, endpoint_id: str, reason: str) -> None:
        self.failed.append((endpoint_id, reason))


def _status(status: int, body: bytes) -> Handler:
    async def answer(_req: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 %d X\r\ncontent-length: %d\r\n\r\n%s" % (status, len(body), body))
        await writer.drain()
    return answer


async def _garbage(_req: bytes, writer: asyncio.StreamWriter) -> None:
    writer.write(b"NOT HTTP AT ALL\r\n\r\n")
    await writer.drain()
    writer.close()


@contextlib.asynccontextmanager
async def calling(transport: str) -> AsyncIterator[tuple[EngineCall, Book]]:
    book = Book()
    call = EngineCall(book, Tracing.off(), TIMEOUTS)
    async with aiohttp.ClientSession(auto_decompress=False) as session:
        lean = H1Client(4) if transport == "lean" else None
        call.bind(AiohttpTransport(session), lean)
        try:
            yield call, book
        finally:
            if lean is not None:
                await lean.close()


TRANSPORTS = pytest.mark.parametrize("transport", ["lean", "aiohttp"])


@TRANSPORTS
async def test_a_call_sends_the_headers_and_returns_the_answer(transport: str) -> None:
    async with calling(transport) as (call, _), serving(_fixed(b'{"ok":1}')) as server:
        ep = Endpoint(id="e0", url=server.url, kind="vllm")
        resp = await call.open(ep, "/v1/chat/completions", b"{}", "rid-1", {})
        assert (resp.status, await read_answer(resp, None)) == (200, b'{"ok":1}')
    head = server.requests[0].lower()
    assert head.startswith(b"post /v1/chat/completions http/1.1\r\n")
    for line in (b"x-request-id: rid-1", b"authorization: bearer key-of-e0",
                 b"content-type: application/json"):
        assert line in head, (transport, head)


@TRANSPORTS
@pytest.mark.parametrize(("handler", "error", "status", "unreachable"), [
    (_status(500, b"boom"), EngineFailed, 502, False),
    (_status(503, b""), EngineFailed, 502, False),
    (_status(429, b"busy"), EngineBusy, 502, False),
    (_status(408, b"late"), EngineBusy, 504, False),
    (_status(400, b'{"error": {"message": "bad", "param": "x"}}'), UpstreamHTTPError, 400,
     False),
    (_status(404, b"nope"), UpstreamHTTPError, 404, False),
    (_silent, EngineTimeout, 504, False),
    (_garbage, StreamBroken, 502, False),
    (None, Unreachable, 502, True),
], ids=["500", "503", "429", "408", "400", "404", "silent", "not HTTP", "unreachable"])
async def test_every_failure_is_its_class(transport: str, handler: Handler | None,
                                          error: type[UpstreamError], status: int,
                                          unreachable: bool) -> None:
    if handler is None:
        async with serving(_silent) as server:
            url = server.url  # closed on exit: nothing listens there any more
    async with calling(transport) as (call, book), serving(handler or _silent) as server:
        ep = Endpoint(id="e0", url=url if handler is None else server.url, kind="vllm")
        with pytest.raises(error) as raised:
            await call.open(ep, "/x", b"", "r", {})
    err = raised.value
    assert type(err) is error and err.status == status, (transport, err)
    assert "127.0.0.1" not in err.message  # the client sees it: no engine address
    assert [e for e, _ in book.failed] == (["e0"] if unreachable else [])


@TRANSPORTS
async def test_an_answer_broken_off_is_a_broken_stream(transport: str) -> None:
    async with calling(transport) as (call, _), serving(_broken) as server:
        resp = await call.open(Endpoint(id="e0", url=server.url, kind="vllm"), "/", b"", "r", {})
        with pytest.raises(StreamBroken):
            await read_answer(resp, None)


def test_the_classes_carry_the_policy() -> None:
    """Retried elsewhere / counted against the engine's breaker, by class (no flags)."""
    table = [(Unreachable("x"), True, True), (EngineTimeout("x"), True, True),
             (StreamBroken("x"), True, True), (EngineFailed("x", 500), True, True),
             (EngineBusy(429), True, False), (UpstreamHTTPError(400, b""), False, False)]
    for err, retryable, engine_fault in table:
        assert (err.retryable, err.engine_fault) == (retryable, engine_fault), err
    assert isinstance(EngineTimeout("x"), TimeoutError)
