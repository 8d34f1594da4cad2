"""The lean engine-hop client (middleware/transport/h1client.py) against a raw asyncio HTTP server."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvgate.middleware.framework.errors import UpstreamError
from kvgate.middleware.transport.h1client import (
    READ_HIGH_WATER,
    H1Client,
    H1Collector,
    H1ConnectionError,
    host_port,
    supports,
)

TIMEOUT = aiohttp.ClientTimeout(total=5.0, connect=2.0)
Handler = Callable[[bytes, asyncio.StreamWriter], Awaitable[None]]


class Server:
    """Reads each request (head + content-length body) and lets ``handler`` answer it."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.url = ""

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                await self.handler(head + body, writer)
                if writer.is_closing():
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def serving(handler: Handler) -> AsyncIterator[Server]:
    server = Server(handler)
    listener = await asyncio.start_server(server.serve, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    server.url = f"http://127.0.0.1:{port}"
    try:
        yield server
    finally:
        listener.close()


def _fixed(body: bytes, extra: bytes = b"") -> Handler:
    async def answer(_req: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                     b"%s\r\n%s" % (len(body), extra, body))
        await writer.drain()
    return answer


async def _chunked(_req: bytes, writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n"
                 b"content-type: text/event-stream\r\n\r\n")
    for part in (b"data: 1\n\n", b"data: [DONE]\n\n"):
        writer.write(b"%x\r\n%s\r\n" % (len(part), part))
        await writer.drain()
    writer.write(b"0\r\n\r\n")


async def _until_close(_req: bytes, writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it")
    await writer.drain()
    writer.close()


async def _broken(_req: bytes, writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly part")
    await writer.drain()
    writer.close()


async def _silent(_req: bytes, _writer: asyncio.StreamWriter) -> None:
    await asyncio.sleep(10)


@pytest.mark.parametrize(("handler", "body", "content_type", "reuses"), [
    (_fixed(b'{"ok":true}'), b'{"ok":true}', "application/json", True),
    (_chunked, b"data: 1\n\ndata: [DONE]\n\n", "text/event-stream", True),
    (_until_close, b"all of it", None, False),
])
async def test_framings_and_keep_alive(handler: Handler, body: bytes, content_type: str | None,
                                       reuses: bool) -> None:
    client = H1Client(limit_per_host=4)
    async with serving(handler) as server:
        for _ in range(3):
            resp = await client.request("POST", server.url + "/v1/x?a=1", data=b"{}",
                                        headers={"content-type": "application/json"},
                                        timeout=TIMEOUT)
            assert resp.status == 200
            assert resp.headers.get("content-type") == content_type
            assert await resp.read() == body
        assert server.connections == (1 if reuses else 3)
        assert server.requests[0].startswith(b"POST /v1/x?a=1 HTTP/1.1\r\n")
        assert b"content-length: 2\r\n" in server.requests[0]
    await client.close()


async def test_stream_read_piecewise_with_flow_control() -> None:
    rng = random.Random(7)
    payload = bytes(rng.getrandbits(8) for _ in range(4 * READ_HIGH_WATER))
    client = H1Client(limit_per_host=1)
    async with serving(_fixed(payload)) as server:
        resp = await client.request("POST", server.url + "/", data=None, headers={},
                                    timeout=TIMEOUT)
        await asyncio.sleep(0.05)  # the server wrote it all; the client stops reading at ~64 KiB
        got = b""
        while chunk := await resp.content.readany():
            got += chunk
        resp.release()
        assert got == payload
        again = await client.request("POST", server.url + "/", data=None, headers={},
                                     timeout=TIMEOUT)
        assert await again.read() == payload
        assert server.connections == 1


@pytest.mark.parametrize(("handler", "error"), [
    (_broken, UpstreamError),  # kvgate's own errors (middleware/framework/errors.py), as every transport's
    (_silent, TimeoutError),
])
async def test_failures(handler: Handler, error: type[BaseException]) -> None:
    client = H1Client(limit_per_host=2)
    timeout = aiohttp.ClientTimeout(total=0.3, connect=0.3)
    async with serving(handler) as server:
        async def exchange() -> bytes:
            resp = await client.request("POST", server.url + "/", data=b"x", headers={},
                                        timeout=timeout)
            return await resp.read()
        with pytest.raises(error):
            await exchange()
        assert client.stats()[server.url.removeprefix("http://")] == {"busy": 0, "idle": 0}


async def test_an_idle_connection_closed_under_a_request_is_retried_once() -> None:
    """The engine closes a kept-alive connection as the next request arrives on it (its idle
    timeout racing ours): that request goes out again on a new connection."""
    seen: dict[int, int] = {}

    async def first_only(_req: bytes, writer: asyncio.StreamWriter) -> None:
        n = seen[id(writer)] = seen.get(id(writer), 0) + 1
        if n > 1:
            writer.close()
            return
        await _fixed(b"ok")(_req, writer)

    client = H1Client(limit_per_host=2)
    async with serving(first_only) as server:
        for _ in range(3):
            resp = await client.request("POST", server.url + "/", data=b"x", headers={},
                                        timeout=TIMEOUT)
            assert await resp.read() == b"ok"
        assert server.connections == 3
        assert len(server.requests) == 5  # 3 answered, 2 closed under the request
        key = host_port(server.url)
        assert client.pool_figures()[key] == (0, 1, 0, 3, 2)  # busy, idle, waiting, opened, resent
        text = _exposition(H1Collector(lambda: client, {key: "engine-a"}))
        assert 'kvgate_engine_connections{engine="engine-a",state="idle"} 1.0' in text
        assert 'kvgate_engine_connections_opened_total{engine="engine-a"} 3.0' in text
        assert 'kvgate_engine_requests_resent_total{engine="engine-a"} 2.0' in text
        assert 'kvgate_engine_connection_waiters{engine="engine-a"} 0.0' in text


def _exposition(collector: H1Collector) -> str:
    registry = CollectorRegistry()
    registry.register(collector)
    return generate_latest(registry).decode()


async def test_unreachable_engine_is_a_connection_error() -> None:
    async with serving(_silent) as server:
        url = server.url  # closed on exit: nothing listens there any more
    with pytest.raises(H1ConnectionError):
        await H1Client(1).request("POST", url + "/", data=None, headers={}, timeout=TIMEOUT)


async def test_pool_limit_queues_requests_on_one_connection() -> None:
    client = H1Client(limit_per_host=1)
    async with serving(_fixed(b"ok")) as server:
        async def one() -> bytes:
            resp = await client.request("POST", server.url + "/", data=b"", headers={},
                                        timeout=TIMEOUT)
            return await resp.read()
        assert await asyncio.gather(*(one() for _ in range(5))) == [b"ok"] * 5
        assert server.connections == 1


async def test_cancel_mid_answer_closes_the_connection() -> None:
    client = H1Client(limit_per_host=1)
    async with serving(_silent) as server:
        task = asyncio.create_task(client.request("POST", server.url + "/", data=b"",
                                                  headers={}, timeout=TIMEOUT))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.05)
        assert client.stats()[server.url.removeprefix("http://")] == {"busy": 0, "idle": 0}


@pytest.mark.parametrize(("url", "ok"), [
    ("http://e:8000", True), ("https://e", False), ("unix:///tmp/s", False),
])
def test_supports(url: str, ok: bool) -> None:
    assert supports(url) is ok
