"""kvgate's HTTP/1.1 front end (middleware/transport/h1server.py) under uvicorn's real server, over real
sockets: keep-alive, pipelining, bodies, 100-continue, closing rules, errors, backpressure,
disconnects, graceful shutdown; and ``kvgate serve`` choosing it by default."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import random
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import uvicorn
import uvloop

from kvgate.middleware import cli
from kvgate.middleware.transport.asgi import DISCONNECT_EXTENSION
from kvgate.middleware.transport.h1server import BODY_HIGH_WATER, H1Protocol, _Exchange

#: Safety net for waits on events (a hung test fails instead of blocking the suite).
WAIT_S = 10.0
Message = dict[str, Any]
#: Response headers the server refuses (a 500 instead), by the path whose app sends them.
BAD_HEADERS = {"/bad-header": (b"x-evil", b"a\r\nset-cookie: b"),
               "/bad-name": (b"x evil", b"a"), "/nul-value": (b"x-evil", b"a\x00b")}


class App:
    """Routes by path; records what it received."""

    def __init__(self) -> None:
        self.messages: dict[str, list[Message]] = {}
        self.release = asyncio.Event()
        self.disconnected = asyncio.Event()
        self.stream_sent = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        path = scope["path"]
        body = await self._read(path, receive)
        if path == "/boom":
            raise RuntimeError("boom")
        if path in BAD_HEADERS:  # after a clean header: the check covers every one
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"x-clean", b"ok"), BAD_HEADERS[path]]})
            return
        if path == "/wait-disconnect":  # two watchers, one of them cancelled: both kinds end
            cancelled = asyncio.ensure_future(receive())
            watchers = [asyncio.ensure_future(receive()) for _ in range(2)]
            await asyncio.sleep(0)
            cancelled.cancel()
            assert [(await w)["type"] for w in watchers] == ["http.disconnect"] * 2
            self.disconnected.set()
            return
        if path == "/watch":  # the DisconnectSource of the scope (middleware/transport/asgi.py)
            source = scope["extensions"][DISCONNECT_EXTENSION]
            source.watch(self.disconnected.set)
            await self.disconnected.wait()
            assert source.disconnected
            return
        if path == "/late-body":  # content-length head first, the body later in two parts
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-length", str(len(body)).encode())]})
            await self.release.wait()
            half = len(body) // 2
            await send({"type": "http.response.body", "body": body[:half], "more_body": True})
            await send({"type": "http.response.body", "body": body[half:]})
            return
        if path == "/slow":
            await self.release.wait()
        if path == "/stream":
            await self._stream(send, int(scope["query_string"] or b"4"))
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def _read(self, path: str, receive: Any) -> bytes:
        got = self.messages.setdefault(path, [])
        chunks = []
        while True:
            message = await receive()
            got.append(message)
            if message["type"] == "http.disconnect":
                break
            chunks.append(message["body"])
            if not message["more_body"]:
                break
        return b"".join(chunks)

    async def _stream(self, send: Any, chunks: int) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        piece = bytes(range(256)) * 1024  # 256 KiB
        for _ in range(chunks):
            await send({"type": "http.response.body", "body": piece, "more_body": True})
            self.stream_sent += 1
        await send({"type": "http.response.body", "body": b""})


async def until(condition: Callable[[], bool]) -> None:
    """Polls ``condition`` until it holds (fails after :data:`WAIT_S`)."""
    for _ in range(int(WAIT_S / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition never held")


@contextlib.asynccontextmanager
async def served(app: App, **options: Any) -> AsyncIterator[tuple[int, uvicorn.Server]]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, http=H1Protocol, lifespan="off", log_level="warning",
                            proxy_headers=False, **options)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    await until(lambda: server.started)
    try:
        yield sock.getsockname()[1], server
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, WAIT_S)


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and (content-length or chunked) body of one response."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
    if "content-length" in headers:
        return status, headers, await reader.readexactly(int(headers["content-length"]))
    body = b""
    if headers.get("transfer-encoding") == "chunked":
        while size := int((await reader.readuntil(b"\r\n")).strip(), 16):
            body += await reader.readexactly(size)
            await reader.readexactly(2)
        await reader.readexactly(2)
    return status, headers, body


def post(path: str, body: bytes, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nhost: t\r\ncontent-length: {len(body)}\r\n{extra}\r\n"
            .encode() + body)


async def exchange(port: int, raw: bytes, responses: int = 1) -> list[tuple[int, dict[str, str],
                                                                           bytes]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    try:
        return [await asyncio.wait_for(read_response(reader), WAIT_S) for _ in range(responses)]
    finally:
        writer.close()


async def test_keep_alive_and_pipelined_requests_answer_in_order() -> None:
    rng = random.Random(1)
    bodies = [rng.randbytes(n) for n in (0, 10, 5000, 300_000)]
    async with served(App()) as (port, _):
        got = await exchange(port, b"".join(post("/echo", b) for b in bodies), len(bodies))
    assert [(status, body) for status, _, body in got] == [(200, b) for b in bodies]
    assert all("connection" not in headers for _, headers, _ in got)


@pytest.mark.parametrize(("name", "raw", "expected"), [
    ("content-length", post("/echo", b"x" * 1000), b"x" * 1000),
    ("chunked", b"POST /echo HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n"
                b"3\r\nabc\r\n5\r\ndefgh\r\n0\r\n\r\n", b"abcdefgh"),
    ("above the high-water mark", post("/echo", b"y" * (3 * BODY_HIGH_WATER)),
     b"y" * (3 * BODY_HIGH_WATER)),
    ("percent-encoded path", b"GET /ec%68o HTTP/1.1\r\nhost: t\r\n\r\n", b""),
])
async def test_request_bodies_reach_the_app_whole(name: str, raw: bytes, expected: bytes) -> None:
    app = App()
    async with served(app) as (port, _):
        [(status, _, body)] = await exchange(port, raw)
    assert (status, body) == (200, expected), name
    assert app.messages["/echo"][-1]["more_body"] is False


async def test_expect_100_continue() -> None:
    async with served(App()) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /echo HTTP/1.1\r\nhost: t\r\ncontent-length: 3\r\n"
                     b"expect: 100-continue\r\n\r\n")
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S)
        writer.write(b"abc")
        status, _, body = await asyncio.wait_for(read_response(reader), WAIT_S)
        writer.close()
    assert interim.startswith(b"HTTP/1.1 100 Continue")
    assert (status, body) == (200, b"abc")


@pytest.mark.parametrize(("name", "raw", "status", "body"), [
    ("HTTP/1.0", b"POST /echo HTTP/1.0\r\ncontent-length: 2\r\n\r\nhi", 200, b"hi"),
    ("connection close", post("/echo", b"hi", "connection: close\r\n"), 200, b"hi"),
    ("unparsable request", b"NOT HTTP\r\n\r\n", 400, b"Invalid HTTP request received."),
    ("app fails before answering", post("/boom", b""), 500, b"Internal Server Error"),
    ("response splitting refused", post("/bad-header", b""), 500, b"Internal Server Error"),
    ("header name not a token", post("/bad-name", b""), 500, b"Internal Server Error"),
    ("control character in a value", post("/nul-value", b""), 500, b"Internal Server Error"),
])
async def test_answers_that_close_the_connection(name: str, raw: bytes, status: int,
                                                 body: bytes) -> None:
    async with served(App()) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(raw)
        got = await asyncio.wait_for(read_response(reader), WAIT_S)
        rest = await asyncio.wait_for(reader.read(), WAIT_S)  # EOF: the server closed
        writer.close()
    assert (got[0], got[2], rest) == (status, body, b""), name
    assert got[1].get("connection") == "close"


async def test_head_response_has_no_body_and_keeps_the_connection() -> None:
    async with served(App()) as (port, _):
        got = await exchange(port, b"HEAD /echo HTTP/1.1\r\nhost: t\r\n\r\n" + post("/echo", b"z"),
                             2)
    assert [(s, h.get("content-length"), b) for s, h, b in got] == [(200, "0", b""),
                                                                    (200, "1", b"z")]


async def test_idle_keep_alive_connection_is_closed() -> None:
    async with served(App(), timeout_keep_alive=0) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post("/echo", b"a"))
        await asyncio.wait_for(read_response(reader), WAIT_S)
        assert await asyncio.wait_for(reader.read(), WAIT_S) == b""
        writer.close()


async def test_client_leaving_is_an_http_disconnect() -> None:
    app = App()
    async with served(app) as (port, _):
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post("/wait-disconnect", b"body"))
        await until(lambda: "/wait-disconnect" in app.messages)
        writer.close()
        await asyncio.wait_for(app.disconnected.wait(), WAIT_S)
    assert app.messages["/wait-disconnect"][0]["body"] == b"body"


async def test_client_leaving_calls_the_disconnect_source() -> None:
    app = App()
    async with served(app) as (port, _):
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post("/watch", b"body"))
        await until(lambda: "/watch" in app.messages)
        writer.close()
        await asyncio.wait_for(app.disconnected.wait(), WAIT_S)


async def test_a_finished_exchange_leaves_no_reference_cycle() -> None:
    """Freed by reference counting alone (the GC off): an exchange kept alive by a cycle
    (say, through its scope's disconnect source, or by the closed connection's protocol) would
    hold its request until a collection."""
    app = App()
    async with served(app) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        gc.collect()
        gc.disable()
        try:
            for _ in range(3):  # on one keep-alive connection: the last one is still parsed
                writer.write(post("/echo", b"x" * 1000))
                status, _, _ = await asyncio.wait_for(read_response(reader), WAIT_S)
                assert status == 200
            await until(lambda: sum(isinstance(o, _Exchange) for o in gc.get_objects()) == 1)
            writer.close()  # and the last one once the connection is gone
            await until(lambda: not any(isinstance(o, _Exchange) for o in gc.get_objects()))
        finally:
            gc.enable()
            writer.close()


async def test_a_held_head_goes_out_with_its_late_body() -> None:
    """A content-length head waits for its body (one write for both); the body may come
    later and in parts, and the connection is kept alive for the next request."""
    app = App()
    async with served(app) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post("/late-body", b"abcdef") + post("/echo", b"next"))
        await until(lambda: "/late-body" in app.messages)
        app.release.set()
        first = await asyncio.wait_for(read_response(reader), WAIT_S)
        second = await asyncio.wait_for(read_response(reader), WAIT_S)
        writer.close()
    assert (first[0], first[1]["content-length"], first[2]) == (200, "6", b"abcdef")
    assert (second[0], second[2]) == (200, b"next")


async def test_streamed_response_waits_for_a_slow_reader() -> None:
    """64 chunks of 256 KiB to a client that does not read: ``send`` blocks on the paused
    transport (the app stops part way), then everything arrives once the client reads."""
    app = App()
    async with served(app) as (port, server):
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 16)
        writer.write(b"GET /stream?64 HTTP/1.1\r\nhost: t\r\n\r\n")
        await until(lambda: any(isinstance(c, H1Protocol) and c.drained is not None
                                for c in server.server_state.connections))
        assert app.stream_sent < 64
        status, headers, body = await asyncio.wait_for(read_response(reader), WAIT_S)
        writer.close()
    assert (status, headers["transfer-encoding"], len(body)) == (200, "chunked", 64 << 18)
    assert body == bytes(range(256)) * 1024 * 64


async def test_graceful_shutdown_finishes_the_request_in_flight() -> None:
    app = App()
    async with served(app) as (port, server):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post("/slow", b"done"))
        await until(lambda: "/slow" in app.messages)
        server.should_exit = True
        await until(lambda: any(  # the server has asked the connection to close
            isinstance(c, H1Protocol) and c.current is not None and not c.current.keep_alive
            for c in server.server_state.connections))
        app.release.set()
        status, headers, body = await asyncio.wait_for(read_response(reader), WAIT_S)
        writer.close()
    assert (status, body, headers.get("connection")) == (200, b"done", "close")


async def test_concurrency_limit_answers_503() -> None:
    async with served(App(), limit_concurrency=1) as (port, _):
        [(status, _, body)] = await exchange(port, post("/echo", b"x"))
    assert (status, body) == (503, b"Service Unavailable")


@pytest.mark.parametrize(("argv", "http", "proxy_headers"), [
    ([], "kvgate.middleware.transport.h1server:H1Protocol", False),
    (["--http", "uvicorn"], "httptools", True),
])
def test_kvgate_serve_runs_the_chosen_front(monkeypatch: pytest.MonkeyPatch, argv: list[str],
                                            http: str, proxy_headers: bool,
                                            caplog: pytest.LogCaptureFixture) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(kw))
    monkeypatch.setattr(cli, "tune_gc", lambda: None)
    with caplog.at_level(logging.WARNING, logger="kvgate.cli"):
        assert cli.main(["serve", "--engine", "http://127.0.0.1:9", *argv]) == 0
    assert (seen["http"], seen["proxy_headers"]) == (http, proxy_headers)
    # uvicorn's protocol holds fewer limits: said at startup, never silently
    assert ("lacks the URL, head and header-count limits" in caplog.text) is proxy_headers


@pytest.mark.parametrize("scenario", [
    test_keep_alive_and_pipelined_requests_answer_in_order,
    test_streamed_response_waits_for_a_slow_reader,
    test_client_leaving_is_an_http_disconnect,
    test_client_leaving_calls_the_disconnect_source,
    test_a_held_head_goes_out_with_its_late_body,
    test_graceful_shutdown_finishes_the_request_in_flight,
])
def test_on_uvloop(scenario: Callable[[], Awaitable[None]]) -> None:
    """``kvgate serve`` runs on uvloop, whose transports are not asyncio's classes."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(scenario())  # type: ignore[arg-type]
