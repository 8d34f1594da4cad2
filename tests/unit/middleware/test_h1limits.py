"""The HTTP front end's limits (middleware/transport/h1limits.py, issue 29 item 3) under uvicorn's real
server, over real sockets: oversized request lines and heads, too many headers, heads and bodies
sent too slowly, connections that never ask, idle keep-alive connections, too many connections;
what each is answered, that the connection is closed, and the counts on ``/metrics``; and
``ServerConfig`` reaching both fronts."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import uvicorn
import uvloop
import yaml
from pydantic import ValidationError

from kvgate.middleware import cli
from kvgate.middleware.app import create_app
from kvgate.middleware.framework.composition.config import GatewayConfig, ServerConfig
from kvgate.middleware.framework.composition.quickstart import QuickStart, quick_start_config
from kvgate.middleware.transport.h1limits import H1Limits
from tests.servers import serve_asgi
from tests.unit.middleware.test_h1server import WAIT_S, App, post, read_response, served, until

#: A partial head: what a slow client has sent when its deadline passes.
HALF_HEAD = b"POST /echo HTTP/1.1\r\nhost: t\r\ncontent-le"
#: Slack on a deadline for a loaded two-core machine (deadlines in these tests are 0.3-0.5 s).
SLACK_S = 1.0


class LimitedApp(App):
    """The test app carrying its front-end limits (``h1_limits``, as kvgate's app does); the
    path ``/late-read`` reads its body only after ``late_s``."""

    def __init__(self, late_s: float = 0.0, **server: Any) -> None:
        super().__init__()
        self.h1_limits = H1Limits(ServerConfig(**server))
        self.late_s = late_s

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["path"] == "/late-read":
            await asyncio.sleep(self.late_s)
        await super().__call__(scope, receive, send)


def named(names: tuple[str, ...], rows: list[tuple[Any, ...]]) -> pytest.MarkDecorator:
    """A table of cases, each shown by its first column (its name)."""
    return pytest.mark.parametrize(names, [pytest.param(*row, id=row[0]) for row in rows])


def _headers(count: int, size: int = 1) -> bytes:
    return b"".join(b"x-h%d: %s\r\n" % (i, b"v" * size) for i in range(count))


def _rows() -> list[tuple[str, bytes, int, set[str]]]:
    rng = random.Random(29)
    big = bytes(rng.choice(b"abcdefghij") for _ in range(1 << 20))
    return [
        ("1 MiB header value", b"GET /echo HTTP/1.1\r\nhost: t\r\nx-big: " + big + b"\r\n\r\n",
         431, {"head_too_large"}),
        ("10,000 headers", b"GET /echo HTTP/1.1\r\nhost: t\r\n" + _headers(10_000) + b"\r\n",
         431, {"head_too_large", "too_many_headers"}),  # which one first: how it was read
        ("101 headers", b"GET /echo HTTP/1.1\r\n" + _headers(101) + b"\r\n", 431,
         {"too_many_headers"}),
        ("34 KiB of headers in one piece", b"GET /echo HTTP/1.1\r\n" + _headers(40, 850)
         + b"\r\n", 431, {"head_too_large"}),
        ("20 KiB request line", b"GET /" + b"a" * (20 << 10) + b" HTTP/1.1\r\nhost: t\r\n\r\n",
         414, {"url_too_long"}),
        # request smuggling shapes: refused by the parser as before
        ("content-length and chunked", b"POST /echo HTTP/1.1\r\nhost: t\r\ncontent-length: 3"
         b"\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n", 400, {"invalid"}),
        ("two content-lengths", b"POST /echo HTTP/1.1\r\nhost: t\r\ncontent-length: 1\r\n"
         b"content-length: 2\r\n\r\nab", 400, {"invalid"}),
        ("obs-fold", b"GET /echo HTTP/1.1\r\nhost: t\r\nx-a: 1\r\n folded\r\n\r\n", 400,
         {"invalid"}),
    ]


async def _answer_and_eof(port: int, raw: bytes) -> tuple[int, dict[str, str], bytes, bytes]:
    """One request's answer, then what follows it until the server closes (b"": nothing)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    try:
        status, headers, body = await asyncio.wait_for(read_response(reader), WAIT_S)
        rest = await asyncio.wait_for(reader.read(), WAIT_S)
    finally:
        writer.close()
    return status, headers, body, rest


@named(("name", "raw", "status", "reasons"), _rows())
async def test_oversized_heads_are_refused_and_closed(name: str, raw: bytes, status: int,
                                                     reasons: set[str]) -> None:
    app = LimitedApp()
    async with served(app) as (port, _):
        got, headers, body, rest = await _answer_and_eof(port, raw)
    refused = {r for r, n in app.h1_limits.refused.items() if n}
    assert (got, rest, headers.get("connection")) == (status, b"", "close"), name
    assert len(refused) == 1 and refused <= reasons, (name, app.h1_limits.refused)
    if status != 400:  # the 400 stays uvicorn's plain text (tests/.../test_h1server.py)
        error = json.loads(body)["error"]
        assert set(error) == {"message", "type", "param", "code"}, name
        assert headers["content-type"] == "application/json", name
    assert app.messages == {}, name  # nothing reached the app


@named(("name", "raw", "size"), [
    ("100 headers and an 8 KiB target", b"GET /echo?" + b"q" * 8182 + b" HTTP/1.1\r\n"
     + _headers(100) + b"\r\n", 0),
    ("1 MiB body after 100 headers, in large chunks", b"POST /echo HTTP/1.1\r\n" + _headers(98)
     + b"content-length: %d\r\n\r\n" % (1 << 20) + b"b" * (1 << 20), 1 << 20),
])
async def test_requests_at_the_limits_are_served(name: str, raw: bytes, size: int) -> None:
    app = LimitedApp()
    async with served(app) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(raw)
        status, headers, body = await asyncio.wait_for(read_response(reader), WAIT_S)
        writer.close()
    assert (status, len(body), "connection" in headers) == (200, size, False), name
    assert not any(app.h1_limits.refused.values()), name


async def test_half_heads_are_closed_at_their_deadline_while_others_are_served() -> None:
    """50 connections each send half a head and stop: each gets 408 and is closed at the
    head deadline (0.5 s), while a request on another connection is answered at once."""
    app = LimitedApp(head_timeout_s=0.5)
    loop = asyncio.get_running_loop()
    async with served(app) as (port, _):
        start = loop.time()
        slow = [await asyncio.open_connection("127.0.0.1", port) for _ in range(50)]
        for _, writer in slow:
            writer.write(HALF_HEAD)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        asked = loop.time()
        writer.write(post("/echo", b"ok"))
        status, _, body = await asyncio.wait_for(read_response(reader), WAIT_S)
        served_in = loop.time() - asked
        answers = await asyncio.gather(*(asyncio.wait_for(r.read(), WAIT_S) for r, _ in slow))
        closed_after = loop.time() - start
        for _, w in [*slow, (reader, writer)]:
            w.close()
    assert (status, body) == (200, b"ok") and served_in < 0.3
    assert all(a.startswith(b"HTTP/1.1 408 ") for a in answers)
    assert 0.5 <= closed_after < 0.5 + SLACK_S
    assert app.h1_limits.refused["head_timeout"] == 50


@named(("name", "first", "then", "answer", "count"), [
    ("new connection that sends nothing", b"", b"", b"", ("closed", "before_request")),
    ("idle keep-alive connection", post("/echo", b"a"), b"", b"", ("closed", "keep_alive")),
    ("second head sent too slowly", post("/echo", b"a"), HALF_HEAD, b"HTTP/1.1 408 ",
     ("refused", "head_timeout")),
])
async def test_idle_and_slow_connections_are_closed(name: str, first: bytes, then: bytes,
                                                    answer: bytes,
                                                    count: tuple[str, str]) -> None:
    """Deadlines 0.3 s (keep-alive 0.6 s: the second head's deadline runs from its first
    byte, not from the response before it)."""
    app = LimitedApp(head_timeout_s=0.3)
    loop = asyncio.get_running_loop()
    async with served(app, timeout_keep_alive=0.6) as (port, _):
        start = loop.time()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        if first:
            writer.write(first)
            await asyncio.wait_for(read_response(reader), WAIT_S)
            start = loop.time()
        writer.write(then)
        rest = await asyncio.wait_for(reader.read(), WAIT_S)
        elapsed = loop.time() - start
        writer.close()
    # the keep-alive timer starts as the response leaves, a little before the client reads it
    limit, early = (0.6, 0.1) if name == "idle keep-alive connection" else (0.3, 0.0)
    assert rest.startswith(answer) and (rest == b"") == (answer == b""), name
    assert limit - early <= elapsed < limit + SLACK_S, (name, elapsed)
    assert getattr(app.h1_limits, count[0])[count[1]] == 1, name


@named(("name", "piece", "pieces", "pause_s", "status"), [
    ("a trickle under the minimum rate", b"x", 200, 0.02, 408),  # 50 bytes/s
    ("pieces above the minimum rate, past the first window", b"y" * 200, 8, 0.08, 200),
])
async def test_body_deadline_and_minimum_rate(name: str, piece: bytes, pieces: int,
                                              pause_s: float, status: int) -> None:
    """``body_timeout_s`` 0.3 and 100 bytes/s: a body trickling at 50 bytes/s is due at
    0.3 + 0.5 t, i.e. refused after 0.6 s (sooner if the sender is slowed down, never before
    0.3 s); one sent at 2.5 KB/s for 0.64 s is served."""
    app = LimitedApp(body_timeout_s=0.3, body_min_bytes_per_s=100)
    loop = asyncio.get_running_loop()
    async with served(app) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /echo HTTP/1.1\r\nhost: t\r\ncontent-length: %d\r\n\r\n"
                     % (len(piece) * pieces))
        start = loop.time()
        sender = asyncio.create_task(_trickle(writer, piece, pieces, pause_s))
        got, _, body = await asyncio.wait_for(read_response(reader), WAIT_S)
        elapsed = loop.time() - start
        sender.cancel()
        writer.close()
    assert got == status, name
    if status == 408:
        assert json.loads(body)["error"]["code"] == "request_timeout"
        assert 0.3 <= elapsed < 0.6 + SLACK_S, elapsed
        assert app.messages["/echo"][-1] == {"type": "http.disconnect"}  # the app was told
        assert app.h1_limits.refused["body_timeout"] == 1
    else:
        assert body == piece * pieces and not any(app.h1_limits.refused.values())


async def _trickle(writer: asyncio.StreamWriter, piece: bytes, pieces: int,
                   pause_s: float) -> None:
    for _ in range(pieces):
        writer.write(piece)
        await asyncio.sleep(pause_s)


@named(("name", "raw", "second"), [
    ("waiting for a late 100 Continue", b"POST /late-read HTTP/1.1\r\nhost: t\r\n"
     b"content-length: 3\r\nexpect: 100-continue\r\n\r\n", b"abc"),
    ("a body the server stopped reading (above its buffer) while the app was busy",
     post("/late-read", b"z" * (3 << 20)), b""),
])
async def test_time_the_server_keeps_a_body_waiting_does_not_count(name: str, raw: bytes,
                                                                  second: bytes) -> None:
    """The app reads the body only after 0.8 s, past ``body_timeout_s`` (0.3 s, no minimum
    rate: nothing the client sent extends it)."""
    app = LimitedApp(late_s=0.8, body_timeout_s=0.3, body_min_bytes_per_s=0)
    async with served(app) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(raw)
        if second:
            interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S)
            assert interim.startswith(b"HTTP/1.1 100 ")
            writer.write(second)
        status, _, body = await asyncio.wait_for(read_response(reader), WAIT_S)
        writer.close()
    assert (status, len(body)) == (200, len(second) or 3 << 20), name
    assert not any(app.h1_limits.refused.values()), name


async def test_connections_beyond_the_limit_get_503_until_one_closes() -> None:
    app = LimitedApp(max_connections=2)
    async with served(app) as (port, _):
        kept = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        for reader, writer in kept:  # both admitted and served, kept alive
            writer.write(post("/echo", b"in"))
            assert (await asyncio.wait_for(read_response(reader), WAIT_S))[0] == 200
        status, headers, body, rest = await _answer_and_eof(port, post("/echo", b"over"))
        assert (status, headers["retry-after"], rest) == (503, "1", b"")
        assert json.loads(body)["error"]["code"] == "too_many_connections"
        kept[0][1].close()
        await until(lambda: app.h1_limits.open == 1)
        again = await _answer_and_eof(port, post("/echo", b"again") + post(
            "/echo", b"", "connection: close\r\n"))
        kept[1][1].close()
    assert again[:3:2] == (200, b"again")
    assert app.h1_limits.refused["too_many_connections"] == 1
    assert "/echo" in app.messages and len(app.messages["/echo"]) == 4  # the 503's never came


async def test_a_refused_client_still_sending_reads_its_answer() -> None:
    """A client that goes on sending a head past the limit (4 MiB, in pieces) gets its 431:
    the server half-closes and drops what follows instead of resetting the connection."""
    app = LimitedApp()
    async with served(app) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /echo HTTP/1.1\r\nhost: t\r\nx-big: ")
        for _ in range(64):
            writer.write(b"a" * (64 << 10))
            await writer.drain()
        status, _, _ = await asyncio.wait_for(read_response(reader), WAIT_S)
        writer.close()
    assert status == 431


def _gateway_config(server: dict[str, Any]) -> GatewayConfig:
    """The quick start's config of one (unreachable) engine, with these server settings."""
    return quick_start_config(QuickStart(engines=("http://127.0.0.1:9",), server=server))


async def test_kvgate_app_applies_its_config_and_counts_on_metrics() -> None:
    """``ServerConfig`` -> the app's ``h1_limits`` -> the front end; refusals on /metrics."""
    app = create_app(_gateway_config({"head_timeout_s": 0.3, "max_url_bytes": 256}))
    async with serve_asgi(app, lifespan="off", http=cli.HTTP_FRONTS["kvgate"]) as url:
        port = int(url.rsplit(":", 1)[1])
        slow = await _answer_and_eof(port, HALF_HEAD)
        long = await _answer_and_eof(port, b"GET /" + b"u" * 300 + b" HTTP/1.1\r\n\r\n")
        _, _, page, _ = await _answer_and_eof(port, b"GET /metrics HTTP/1.1\r\nhost: t\r\n"
                                                    b"connection: close\r\n\r\n")
    assert (slow[0], long[0]) == (408, 414)
    text = page.decode()
    for line in ('kvgate_http_refused_total{reason="head_timeout"} 1.0',
                 'kvgate_http_refused_total{reason="url_too_long"} 1.0',
                 'kvgate_http_refused_total{reason="too_many_connections"} 0.0',
                 'kvgate_http_idle_closed_total{when="keep_alive"} 0.0',
                 "kvgate_http_connections 1.0"):
        assert line in text, line


@pytest.mark.parametrize(("http", "limit"), [("kvgate", None), ("uvicorn", 11)])
def test_kvgate_serve_gives_uvicorn_the_same_limits(monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path: Path, http: str,
                                                    limit: int | None) -> None:
    config = _gateway_config({"keep_alive_timeout_s": 7, "max_connections": 10})
    path = tmp_path / "gw.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude={"source"})))
    seen: dict[str, Any] = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(kw))
    monkeypatch.setattr(cli, "tune_gc", lambda: None)
    assert cli.main(["serve", "--config", str(path), "--http", http]) == 0
    assert (seen["timeout_keep_alive"], seen["limit_concurrency"]) == (7, limit)


@pytest.mark.parametrize("server", [
    {"max_headers": 0}, {"max_head_bytes": 100}, {"head_timeout_s": 0}, {"body_timeout_s": -1},
    {"body_min_bytes_per_s": -1}, {"keep_alive_timeout_s": 0.5}, {"max_connections": 0},
    {"max_url_bytes": "lots"}, {"max_request_line": 10},
])
def test_limits_are_validated_strictly(server: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        ServerConfig(**server)


@pytest.mark.parametrize("scenario", [
    test_half_heads_are_closed_at_their_deadline_while_others_are_served,
    test_connections_beyond_the_limit_get_503_until_one_closes,
    test_a_refused_client_still_sending_reads_its_answer,
])
def test_on_uvloop(scenario: Callable[[], Awaitable[None]]) -> None:
    """``kvgate serve`` runs on uvloop (its transports' ``write_eof`` and timers)."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(scenario())  # type: ignore[arg-type]
