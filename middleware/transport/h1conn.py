"""One keep-alive HTTP/1.1 connection to an engine (the lean client's wire half,
middleware/transport/h1client.py): an asyncio protocol on httptools' response parser, the response
it
yields (:class:`H1Response`, an ``EngineResponse``: middleware/transport/engine_call.py) and the
request
head it writes.

Errors are kvgate's own (middleware/framework/errors.py): :class:`H1ConnectionError` is an
``Unreachable``, :class:`H1PayloadError` a ``StreamBroken``, :class:`H1Timeout` an
``EngineTimeout`` (also a ``TimeoutError``, as ``asyncio``'s deadlines are).

Flow control: a streamed response stops reading from the socket while more than
:data:`READ_HIGH_WATER` bytes wait unread, and resumes once they are taken.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping
from typing import Protocol, cast

import httptools

from kvgate.middleware.framework.errors import EngineTimeout, StreamBroken, Unreachable

#: Unread bytes of a streamed response above which the socket is not read (64 KiB: several
#: SSE events of a fast engine; the relay takes them all at once).
READ_HIGH_WATER = 64 * 1024


class H1ConnectionError(Unreachable):
    """The engine could not be reached, or closed the connection before answering."""


class H1PayloadError(StreamBroken):
    """The engine's answer broke off or was not valid HTTP/1.1."""


class H1Timeout(EngineTimeout):
    """No free connection, no connection or no (whole) answer in time."""


class Pool(Protocol):
    """What a connection tells its pool (middleware/transport/h1client.py ``_HostPool``)."""

    def forget(self, conn: Conn) -> None: ...

    def put_back(self, conn: Conn) -> None: ...


class _Body:
    """A response's body as it arrives: chunks, the end, or an error."""

    __slots__ = ("_chunks", "_conn", "_done", "_error", "_size", "_waiter")

    def __init__(self, conn: Conn) -> None:
        self._conn = conn
        self._chunks: list[bytes] = []
        self._size = 0
        self._done = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None

    def feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        if self._size > READ_HIGH_WATER:
            self._conn.pause()
        self._wake()

    def finish(self, error: BaseException | None = None) -> None:
        if not self._done:
            self._done, self._error = True, error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        while not self._chunks and not self._done:
            self._waiter = self._conn.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def _take(self) -> bytes:
        chunks, self._chunks, self._size = self._chunks, [], 0
        self._conn.resume()
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def readany(self) -> bytes:
        """What arrived so far (waits for something); ``b""`` once the body ended."""
        await self._wait()
        if self._chunks:
            return self._take()
        if self._error is not None:
            raise self._error
        return b""

    async def read_all(self) -> bytes:
        while not self._done:
            self._conn.resume()  # reading it whole: no reason to hold the socket back
            self._waiter = self._conn.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self._error is not None:
            raise self._error
        return self._take() if self._chunks else b""

    @property
    def complete(self) -> bool:
        return self._done and self._error is None and not self._chunks


class H1Response:
    """An engine's answer: status and headers (names lower-case), body to read."""

    __slots__ = ("_conn", "content", "headers", "status")

    def __init__(self, conn: Conn, status: int, headers: dict[str, str]) -> None:
        self._conn = conn
        self.status = status
        self.headers: Mapping[str, str] = headers
        self.content = _Body(conn)

    def receive(self) -> Awaitable[bytes]:
        """What arrived so far (waits for something); ``b""`` once the body ended."""
        return self.content.readany()

    async def read(self) -> bytes:
        """The whole body (then the connection goes back to the pool)."""
        try:
            return await self.content.read_all()
        finally:
            self.release()

    def release(self) -> None:
        """Done with the response: keep the connection if the body was read to its end."""
        self._conn.done(reuse=self.content.complete)

    def close(self) -> None:
        """Done with the response, and close the connection (the engine sees it)."""
        self._conn.done(reuse=False)


class Conn(asyncio.Protocol):
    """One keep-alive connection to an engine and its response parser."""

    def __init__(self, pool: Pool, loop: asyncio.AbstractEventLoop) -> None:
        self.pool = pool
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: H1Response | None = None
        self.headers_ready: asyncio.Future[H1Response] | None = None
        self._names: dict[str, str] = {}
        self.idle_since = 0.0
        self.closed = False
        self.keep_alive = True
        self._paused = False
        self._timer: asyncio.TimerHandle | None = None
        self._released = True
        #: Exchanges started on this connection; whether the current one is not the first
        #: (``reused``) and whether any byte of its answer arrived (``heard``).
        self.exchanges = 0
        self.reused = self.heard = False

    # -- asyncio.Protocol ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self.heard = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(H1PayloadError(f"invalid HTTP response from the engine: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.forget(self)
        response = self.response
        if response is not None and not response.content._done and self._until_close():
            response.content.finish()  # framed by the connection's end
            return
        self._fail(H1ConnectionError(
            f"engine closed the connection: {exc}" if exc else "engine closed the connection"))

    # -- httptools callbacks -------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        known = self._names.get(key)
        self._names[key] = text if known is None else f"{known}, {text}"

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:  # 100 Continue and friends: the real answer follows
            self._names = {}
            return
        self.keep_alive = self.parser.should_keep_alive()
        self.response = H1Response(self, status, self._names)
        self._names = {}
        ready = self.headers_ready
        if ready is not None and not ready.done():
            ready.set_result(self.response)

    def on_body(self, body: bytes) -> None:
        if self.response is not None:
            self.response.content.feed(body)

    def on_message_complete(self) -> None:
        if self.response is not None:
            self.response.content.finish()

    # -- the exchange -------------------------------------------------------------------------
    def _until_close(self) -> bool:
        headers = self.response.headers if self.response is not None else {}
        return "content-length" not in headers and "transfer-encoding" not in headers

    def start(self, head: bytes, body: bytes | None, deadline: float) -> asyncio.Future[H1Response]:
        """Send one request; the future resolves with the response's head."""
        assert self.transport is not None
        self.reused, self.heard = self.exchanges > 0, False
        self.exchanges += 1
        self._released = False
        self.response = None
        self.headers_ready = self.loop.create_future()
        self._timer = self.loop.call_at(deadline, self._expire)
        if body:
            self.transport.writelines((head, body))
        else:
            self.transport.write(head)
        return self.headers_ready

    def _expire(self) -> None:
        self._timer = None
        self._fail(H1Timeout("engine answer timed out"))
        self.abort()

    def _fail(self, error: BaseException) -> None:
        ready = self.headers_ready
        if ready is not None and not ready.done():
            ready.set_exception(error)
            ready.exception()  # retrieved: the awaiting side may be gone
        if self.response is not None:
            self.response.content.finish(error)
        if self.transport is not None and not self.closed:
            self.abort()

    def pause(self) -> None:
        if not self._paused and self.transport is not None and not self.closed:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def abort(self) -> None:
        """Close the connection (a graceful close, as aiohttp's: the engine sees the request
        end; a reset instead was seen to race a Mooncake decode's KV poll in the tests)."""
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def done(self, reuse: bool) -> None:
        """The exchange is over: back to the pool, or closed."""
        if self._released:
            return
        self._released = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.headers_ready = None
        if not (reuse and self.keep_alive and not self.closed):
            self.abort()
        self.response = None
        self.resume()
        self.pool.put_back(self)


async def exchange(conn: Conn, head: bytes, data: bytes | None,
                    deadline: float) -> H1Response:
    try:
        return await conn.start(head, data, deadline)
    except BaseException:
        conn.done(reuse=False)
        raise


def head(method: str, target: bytes, host: bytes, headers: Mapping[str, str],
          length: int) -> bytes:
    """Request line and headers (``Host`` and ``Content-Length`` added)."""
    lines = [b"%s %s HTTP/1.1\r\nhost: %s\r\ncontent-length: %d\r\n"
             % (method.encode(), target, host, length)]
    for name, value in headers.items():
        lowered = name.lower()
        if lowered in ("host", "content-length", "transfer-encoding", "connection"):
            continue
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise ValueError(f"invalid character in header {name!r}")
        lines.append(f"{name}: {value}\r\n".encode())  # UTF-8, as aiohttp writes them
    lines.append(b"\r\n")
    return b"".join(lines)


__all__ = ["READ_HIGH_WATER", "Conn", "H1ConnectionError", "H1PayloadError", "H1Response",
           "H1Timeout", "exchange", "head"]
