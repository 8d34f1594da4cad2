"""Request smuggling shapes against kvgate's HTTP/1.1 front end (middleware/transport/h1server.py) under
uvicorn's real server, over real sockets.

Each shape hides a second request (``GET /smuggled``) behind a first one whose framing a
lenient parser and a strict one would read differently: Content-Length with
Transfer-Encoding, two Content-Lengths, obs-fold, bare LF line ends, a chunk size past 64 bits,
a Transfer-Encoding that is not exactly ``chunked``. What must hold for every one: the
smuggled request never reaches the app, and the connection is closed after at most one
answer, a 400. A bad head is refused before the app is called; a bad chunked body after the
app got the (valid) head, which then receives ``http.disconnect`` and no body.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.unit.middleware.test_h1server import WAIT_S, App, served

#: The request hidden in the first one's body.
HIDDEN = b"GET /smuggled HTTP/1.1\r\nhost: t\r\n\r\n"
HEAD = b"POST /echo HTTP/1.1\r\nhost: t\r\n"


def case(name: str, raw: bytes, where: str = "head") -> object:
    return pytest.param(raw, where, id=name)


#: (raw bytes, where the parser refuses it: ``head`` or ``body``).
SHAPES = [
    case("CL then TE", HEAD + b"content-length: 4\r\ntransfer-encoding: chunked\r\n\r\n"
         b"0\r\n\r\n" + HIDDEN),
    case("TE then CL", HEAD + b"transfer-encoding: chunked\r\ncontent-length: 40\r\n\r\n"
         b"0\r\n\r\n" + HIDDEN),
    case("two different CLs", HEAD + b"content-length: 0\r\ncontent-length: 36\r\n\r\n"
         + HIDDEN),
    case("two equal CLs", HEAD + b"content-length: 36\r\ncontent-length: 36\r\n\r\n" + HIDDEN),
    case("CL list", HEAD + b"content-length: 0, 36\r\n\r\n" + HIDDEN),
    case("CL with sign", HEAD + b"content-length: +36\r\n\r\n" + HIDDEN),
    case("obs-fold", HEAD + b"x-a: 1\r\n content-length: 36\r\ncontent-length: 0\r\n\r\n"
         + HIDDEN),
    case("obs-fold in TE", HEAD + b"transfer-encoding:\r\n chunked\r\ncontent-length: 36\r\n\r\n"
         + HIDDEN),
    case("bare LF in the head", b"POST /echo HTTP/1.1\nhost: t\ncontent-length: 0\n\n" + HIDDEN),
    case("bare LF after a header", HEAD + b"x-a: 1\ncontent-length: 36\r\ncontent-length: 0"
         b"\r\n\r\n" + HIDDEN),
    case("bare LF in the chunks", HEAD + b"transfer-encoding: chunked\r\n\r\n3\nabc\n0\n\n"
         + HIDDEN, "body"),
    case("chunk size past 64 bits", HEAD + b"transfer-encoding: chunked\r\n\r\n"
         b"10000000000000024\r\n" + HIDDEN + b"\r\n0\r\n\r\n", "body"),
    case("chunk size with 0x", HEAD + b"transfer-encoding: chunked\r\n\r\n0x24\r\n" + HIDDEN
         + b"\r\n0\r\n\r\n", "body"),
    case("TE not chunked", HEAD + b"transfer-encoding: xchunked\r\ncontent-length: 0\r\n\r\n"
         + HIDDEN),
    case("TE chunked then identity", HEAD + b"transfer-encoding: chunked, identity\r\n\r\n"
         b"0\r\n\r\n" + HIDDEN),
    case("space before colon", HEAD + b"content-length : 36\r\n\r\n" + HIDDEN),
    case("CR alone in a value", HEAD + b"x-a: 1\rcontent-length: 36\r\n\r\n" + HIDDEN),
]


async def _exchange(port: int, raw: bytes) -> bytes:
    """Everything the server sends back until it closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    try:
        return await asyncio.wait_for(reader.read(), WAIT_S)
    finally:
        writer.close()


@pytest.mark.parametrize(("raw", "where"), SHAPES)
async def test_smuggled_requests_never_reach_the_app(raw: bytes, where: str) -> None:
    app = App()
    async with served(app, timeout_keep_alive=1) as (port, _):
        answer = await _exchange(port, raw)
    assert answer.startswith(b"HTTP/1.1 400 ") and answer.count(b"HTTP/1.1 ") == 1
    assert b"connection: close" in answer.lower()
    if where == "head":
        assert app.messages == {}
    else:
        assert app.messages == {"/echo": [{"type": "http.disconnect"}]}
