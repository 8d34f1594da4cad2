"""A lean HTTP/1.1 client for the engine hop: asyncio protocols, httptools' response parser
and a keep-alive pool per engine.

Why: in a py-spy profile of ``kvgate serve`` under closed-loop load (bench/overhead.py, 1 KiB
chat bodies) aiohttp's request path (header preparation, payload registry, timer and
connection-key objects, the stream reader) took about a third of the gateway's CPU per
request. An engine hop needs little of it: one POST of bytes the gateway already holds, to a
plain ``http://`` engine, and a response read whole or relayed chunk by chunk.

What it does:

* ``request(method, url, data=, headers=, timeout=)`` mirrors the aiohttp call it replaces and
  returns an :class:`H1Response` once the status line and headers are in; ``read()`` gives the
  body (de-chunked), ``content.readany()`` what arrived so far (``b""`` at the end).
* Errors are :class:`aiohttp.ClientError` subclasses (and ``TimeoutError``), so the engine-hop
  code (middleware/serving/upstream.py) classifies both clients' failures alike.
* Timeouts: ``timeout.connect`` bounds waiting for a pool slot plus the TCP connect;
  ``timeout.total`` the whole exchange, connect to last byte (aiohttp's meaning).
* Pool: at most ``limit_per_host`` connections in use per ``host:port`` (more requests wait
  for a slot, first come first served); a connection goes back to the pool only when its
  response was read to the end and both sides allow keep-alive. Idle connections: at most
  ``limit_per_host`` per host, each dropped after ``keepalive_s`` idle (checked when the pool
  is used) or as soon as the engine closes it. A response released before its end, or any
  error or cancellation (the client went away), closes the connection: the engine sees the
  disconnect and aborts the request.
* Flow control: a streamed response stops reading from the socket while more than
  ``READ_HIGH_WATER`` bytes wait unread, and resumes once they are taken.

Only ``http://`` URLs: :func:`supports` says which; other engines keep the aiohttp session.
No request body streaming, no redirects, no proxies, no decompression (the gateway sends no
``Accept-Encoding``, so engines answer uncompressed).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast
from urllib.parse import urlsplit

import aiohttp
import httptools
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger("kvgate.h1client")

#: Unread bytes of a streamed response above which the socket is not read (64 KiB: several
#: SSE events of a fast engine; the relay takes them all at once).
READ_HIGH_WATER = 64 * 1024
#: Idle keep-alive connections older than this are not reused (closed). Below the 5 s that
#: uvicorn (vLLM's and SGLang's HTTP server) keeps an idle connection: a connection the engine
#: is closing just as a request is written to it would fail that request as "unreachable"
#: (aiohttp, which the gateway used with 30 s, has the same race). A connection the engine
#: closed is dropped as soon as its close arrives anyway.
KEEPALIVE_S = 4.0


class H1ConnectionError(aiohttp.ClientConnectionError):
    """The engine could not be reached, or closed the connection before answering."""


class H1PayloadError(aiohttp.ClientPayloadError):
    """The engine's answer broke off or was not valid HTTP/1.1."""


def supports(url: str) -> bool:
    """Whether the lean client can reach ``url`` (plain ``http://``)."""
    return url.startswith("http://")


class _Body:
    """A response's body as it arrives: chunks, the end, or an error."""

    __slots__ = ("_chunks", "_conn", "_done", "_error", "_size", "_waiter")

    def __init__(self, conn: _Conn) -> None:
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

    def __init__(self, conn: _Conn, status: int, headers: dict[str, str]) -> None:
        self._conn = conn
        self.status = status
        self.headers: Mapping[str, str] = headers
        self.content = _Body(conn)

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


class _Conn(asyncio.Protocol):
    """One keep-alive connection to an engine and its response parser."""

    def __init__(self, pool: _HostPool, loop: asyncio.AbstractEventLoop) -> None:
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
        self._fail(TimeoutError("engine answer timed out"))
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


class _HostPool:
    """Connections to one ``host:port``: at most ``limit`` in use, idle ones kept."""

    def __init__(self, host: str, port: int, limit: int, keepalive_s: float) -> None:
        self.host, self.port, self.limit, self.keepalive_s = host, port, limit, keepalive_s
        self.idle: collections.deque[_Conn] = collections.deque()
        self.busy = 0
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        #: Connections opened, and requests sent again after a kept-alive one closed under them
        self.opened = 0
        self.resent = 0

    def take_idle(self) -> _Conn | None:
        """A free slot's idle connection, if both are at hand (no waiting, no connecting)."""
        if self.busy >= self.limit or not self.idle:
            return None
        conn = self._fresh_idle()
        if conn is not None:
            self.busy += 1
        return conn

    def _fresh_idle(self) -> _Conn | None:
        now = time.monotonic()
        while self.idle:
            conn = self.idle.pop()  # most recent first: the likeliest still open
            if not conn.closed and now - conn.idle_since < self.keepalive_s:
                return conn
            conn.abort()
        return None

    async def acquire(self, loop: asyncio.AbstractEventLoop, connect_s: float | None,
                      fresh: bool = False) -> _Conn:
        """A connection in a free slot (waiting for one): an idle one unless ``fresh``."""
        if self.busy >= self.limit:
            await self._wait_slot(loop, connect_s)
        self.busy += 1
        conn = None if fresh else self._fresh_idle()
        if conn is not None:
            return conn
        try:
            return await self._connect(loop, connect_s)
        except BaseException:
            self._free_slot()
            raise

    async def _wait_slot(self, loop: asyncio.AbstractEventLoop, connect_s: float | None) -> None:
        while self.busy >= self.limit:
            waiter: asyncio.Future[None] = loop.create_future()
            self.waiters.append(waiter)
            try:
                await asyncio.wait_for(waiter, connect_s)
            except BaseException as exc:
                if waiter in self.waiters:
                    self.waiters.remove(waiter)
                elif waiter.done() and not waiter.cancelled():
                    self._wake_one()  # woken as it gave up: pass the free slot on
                if isinstance(exc, TimeoutError):
                    raise TimeoutError("no free connection to the engine in time") from None
                raise

    async def _connect(self, loop: asyncio.AbstractEventLoop, connect_s: float | None) -> _Conn:
        try:
            async with asyncio.timeout(connect_s):
                _, conn = await loop.create_connection(
                    lambda: _Conn(self, loop), self.host, self.port)
            self.opened += 1
        except TimeoutError:
            raise TimeoutError("engine connect timed out") from None
        except OSError as exc:
            raise H1ConnectionError(
                f"cannot connect to {self.host}:{self.port}: {exc.strerror or exc}") from None
        return conn

    def put_back(self, conn: _Conn) -> None:
        if not conn.closed:
            conn.idle_since = time.monotonic()
            self.idle.append(conn)
            while len(self.idle) > self.limit:
                self.idle.popleft().abort()
        self._free_slot()

    def forget(self, conn: _Conn) -> None:
        if conn in self.idle:
            self.idle.remove(conn)

    def _free_slot(self) -> None:
        self.busy -= 1
        self._wake_one()

    def _wake_one(self) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def close(self) -> None:
        while self.idle:
            self.idle.pop().abort()


class H1Client:
    """Keep-alive HTTP/1.1 client for ``http://`` engines (see the module docstring)."""

    def __init__(self, limit_per_host: int, keepalive_s: float = KEEPALIVE_S) -> None:
        if limit_per_host < 1:
            raise ValueError("limit_per_host must be at least 1")
        self.limit_per_host = limit_per_host
        self.keepalive_s = keepalive_s
        self._pools: dict[str, _HostPool] = {}
        self._targets: dict[str, tuple[str, bytes, bytes]] = {}

    async def request(
        self, method: str, url: str, *, data: bytes | None, headers: Mapping[str, str],
        timeout: aiohttp.ClientTimeout,  # noqa: ASYNC109 - the same object aiohttp takes
    ) -> H1Response:
        """Send one request; returns once the engine's status line and headers are in."""
        loop = asyncio.get_running_loop()
        total = timeout.total
        deadline = loop.time() + (total if total is not None else 1e9)
        hostport, host_header, target = self._target(url)
        pool = self._pools.get(hostport)
        if pool is None:
            pool = self._pools[hostport] = self._new_pool(hostport)
        conn = pool.take_idle()
        if conn is None:  # a new connection, or a wait for a free slot: bounded in time
            async with asyncio.timeout_at(deadline):
                conn = await pool.acquire(loop, timeout.connect)
        head = _head(method, target, host_header, headers, len(data) if data else 0)
        try:
            return await _exchange(conn, head, data, deadline)
        except H1ConnectionError:
            if not conn.reused or conn.heard:
                raise
        # the engine closed a kept-alive connection as this request went out on it, before
        # answering a byte (its idle timeout raced ours): once more on a new connection
        log.debug("engine %s closed an idle connection under a request: sent again", hostport)
        pool.resent += 1
        async with asyncio.timeout_at(deadline):
            conn = await pool.acquire(loop, timeout.connect, fresh=True)
        return await _exchange(conn, head, data, deadline)

    def _target(self, url: str) -> tuple[str, bytes, bytes]:
        """``(host:port, Host header, request target)`` of ``url`` (memoised: engines' URLs
        repeat; at most 1,024 kept, then the table starts afresh)."""
        known = self._targets.get(url)
        if known is not None:
            return known
        parts = urlsplit(url)
        if parts.scheme != "http" or parts.hostname is None:
            raise H1ConnectionError(f"the lean client only speaks http://, not {parts.scheme}")
        port = parts.port or 80
        netloc = parts.netloc.rpartition("@")[2]
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        key = _pool_key(parts.hostname, port)
        if len(self._targets) >= 1024:
            self._targets.clear()
        known = self._targets[url] = (key, netloc.encode("idna"), path.encode())
        return known

    def _new_pool(self, hostport: str) -> _HostPool:
        host, _, port = hostport.rpartition(":")
        return _HostPool(host.strip("[]"), int(port), self.limit_per_host, self.keepalive_s)

    def stats(self) -> dict[str, Any]:
        """Connections per engine address: in use and idle."""
        return {key: {"busy": p.busy, "idle": len(p.idle)} for key, p in self._pools.items()}

    def pool_figures(self) -> dict[str, tuple[int, int, int, int, int]]:
        """Per ``host:port``: (busy, idle, waiting for a slot, opened, resent)."""
        return {key: (p.busy, len(p.idle), len(p.waiters), p.opened, p.resent)
                for key, p in self._pools.items()}


    async def close(self) -> None:
        """Close every idle connection (those in use close when their exchange ends)."""
        for pool in self._pools.values():
            pool.close()


class H1Collector(Collector):
    """The engine client's pools on ``/metrics``, labelled with the engine's name (an address
    no configured engine has is labelled with the address)."""

    def __init__(self, client: Callable[[], H1Client | None], names: Mapping[str, str]) -> None:
        self._client = client
        self._names = names

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        client = self._client()
        figures = client.pool_figures() if client is not None else {}
        conns = GaugeMetricFamily("kvgate_engine_connections",
                                  "Engine-hop keep-alive connections", labels=["engine", "state"])
        waiting = GaugeMetricFamily("kvgate_engine_connection_waiters",
                                    "Requests waiting for a free connection slot",
                                    labels=["engine"])
        opened = CounterMetricFamily("kvgate_engine_connections_opened",
                                     "Engine-hop connections opened", labels=["engine"])
        resent = CounterMetricFamily(
            "kvgate_engine_requests_resent",
            "Requests sent again because the engine closed a kept-alive connection under them",
            labels=["engine"])
        for key, (busy, idle, wait, made, again) in sorted(figures.items()):
            engine = self._names.get(key, key)
            conns.add_metric([engine, "busy"], busy)
            conns.add_metric([engine, "idle"], idle)
            waiting.add_metric([engine], wait)
            opened.add_metric([engine], made)
            resent.add_metric([engine], again)
        yield from (conns, waiting, opened, resent)


def host_port(url: str) -> str:
    """The pool key (``host:port``) of an ``http://`` URL."""
    parts = urlsplit(url)
    return _pool_key(parts.hostname or "", parts.port or 80)


def _pool_key(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def _exchange(conn: _Conn, head: bytes, data: bytes | None,
                    deadline: float) -> H1Response:
    try:
        return await conn.start(head, data, deadline)
    except BaseException:
        conn.done(reuse=False)
        raise


def _head(method: str, target: bytes, host: bytes, headers: Mapping[str, str],
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
