"""A lean HTTP/1.1 client for the engine hop: asyncio protocols, httptools' response parser
and a keep-alive pool per engine.

Why: in a py-spy profile of ``kvgate serve`` under closed-loop load (bench/overhead.py, 1 KiB
chat bodies) aiohttp's request path (header preparation, payload registry, timer and
connection-key objects, the stream reader) took about a third of the gateway's CPU per
request. An engine hop needs little of it: one POST of bytes the gateway already holds, to a
plain ``http://`` engine, and a response read whole or relayed chunk by chunk.

What it does:

* An ``EngineTransport`` (middleware/transport/engine_call.py): :meth:`H1Client.send` (or
  ``request(method, url, data=, headers=, timeout=)``) returns an :class:`H1Response` once the
  status line and headers are in; ``read()`` gives the body (de-chunked), ``receive()`` what
  arrived so far (``b""`` at the end). The connection itself is middleware/transport/h1conn.py.
* Errors are kvgate's own (middleware/framework/errors.py): ``Unreachable``, ``StreamBroken``,
  ``EngineTimeout`` (the last also a ``TimeoutError``), as the aiohttp transport's are.
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

Only ``http://`` URLs: :func:`supports` says which; other engines take the aiohttp transport.
No request body streaming, no redirects, no proxies, no decompression (the gateway sends no
``Accept-Encoding``, so engines answer uncompressed).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol
from urllib.parse import urlsplit

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvgate.middleware.transport.h1conn import (
    READ_HIGH_WATER,
    Conn,
    H1ConnectionError,
    H1PayloadError,
    H1Response,
    H1Timeout,
    exchange,
    head,
)

log = logging.getLogger("kvgate.h1client")
#: Idle keep-alive connections older than this are not reused (closed). Below the 5 s that
#: uvicorn (vLLM's and SGLang's HTTP server) keeps an idle connection: a connection the engine
#: is closing just as a request is written to it would fail that request as "unreachable"
#: (aiohttp, which the gateway used with 30 s, has the same race). A connection the engine
#: closed is dropped as soon as its close arrives anyway.
KEEPALIVE_S = 4.0


class Timeouts(Protocol):
    """``total``: the whole exchange, connect to last byte; ``connect``: a free slot plus the
    TCP connect (seconds, None: unbounded; aiohttp's ``ClientTimeout`` is one)."""

    @property
    def total(self) -> float | None: ...

    @property
    def connect(self) -> float | None: ...


def supports(url: str) -> bool:
    """Whether the lean client can reach ``url`` (plain ``http://``)."""
    return url.startswith("http://")


class _HostPool:
    """Connections to one ``host:port``: at most ``limit`` in use, idle ones kept."""

    def __init__(self, host: str, port: int, limit: int, keepalive_s: float) -> None:
        self.host, self.port, self.limit, self.keepalive_s = host, port, limit, keepalive_s
        self.idle: collections.deque[Conn] = collections.deque()
        self.busy = 0
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        #: Connections opened, and requests sent again after a kept-alive one closed under them
        self.opened = 0
        self.resent = 0

    def take_idle(self) -> Conn | None:
        """A free slot's idle connection, if both are at hand (no waiting, no connecting)."""
        if self.busy >= self.limit or not self.idle:
            return None
        conn = self._fresh_idle()
        if conn is not None:
            self.busy += 1
        return conn

    def _fresh_idle(self) -> Conn | None:
        now = time.monotonic()
        while self.idle:
            conn = self.idle.pop()  # most recent first: the likeliest still open
            if not conn.closed and now - conn.idle_since < self.keepalive_s:
                return conn
            conn.abort()
        return None

    async def acquire(self, loop: asyncio.AbstractEventLoop, connect_s: float | None,
                      fresh: bool = False) -> Conn:
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
                    raise H1Timeout("no free connection to the engine in time") from None
                raise

    async def _connect(self, loop: asyncio.AbstractEventLoop, connect_s: float | None) -> Conn:
        try:
            async with asyncio.timeout(connect_s):
                _, conn = await loop.create_connection(
                    lambda: Conn(self, loop), self.host, self.port)
            self.opened += 1
        except TimeoutError:
            raise H1Timeout("engine connect timed out") from None
        except OSError as exc:
            raise H1ConnectionError(
                f"cannot connect to {self.host}:{self.port}: {exc.strerror or exc}") from None
        return conn

    def put_back(self, conn: Conn) -> None:
        if not conn.closed:
            conn.idle_since = time.monotonic()
            self.idle.append(conn)
            while len(self.idle) > self.limit:
                self.idle.popleft().abort()
        self._free_slot()

    def forget(self, conn: Conn) -> None:
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

    def handles(self, url: str) -> bool:
        """Whether this transport can reach ``url`` (plain ``http://``)."""
        return url.startswith("http://")

    async def send(
        self, method: str, url: str, *, data: bytes | None, headers: Mapping[str, str],
        timeout: Timeouts,  # noqa: ASYNC109 - the exchange's own deadlines
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
            conn = await _acquire(pool, loop, timeout.connect, deadline)
        request = head(method, target, host_header, headers, len(data) if data else 0)
        try:
            return await exchange(conn, request, data, deadline)
        except H1ConnectionError:
            if not conn.reused or conn.heard:
                raise
        # the engine closed a kept-alive connection as this request went out on it, before
        # answering a byte (its idle timeout raced ours): once more on a new connection
        log.debug("engine %s closed an idle connection under a request: sent again", hostport)
        pool.resent += 1
        conn = await _acquire(pool, loop, timeout.connect, deadline, fresh=True)
        return await exchange(conn, request, data, deadline)

    #: The same call by the name aiohttp gives it.
    request = send

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


async def _acquire(pool: _HostPool, loop: asyncio.AbstractEventLoop, connect_s: float | None,
                   deadline: float, fresh: bool = False) -> Conn:
    """A connection from ``pool``, by ``deadline`` (the exchange's) at the latest."""
    try:
        async with asyncio.timeout_at(deadline):
            return await pool.acquire(loop, connect_s, fresh)
    except H1Timeout:
        raise
    except TimeoutError:
        raise H1Timeout("engine answer timed out") from None


def host_port(url: str) -> str:
    """The pool key (``host:port``) of an ``http://`` URL."""
    parts = urlsplit(url)
    return _pool_key(parts.hostname or "", parts.port or 80)


def _pool_key(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


__all__ = ["KEEPALIVE_S", "READ_HIGH_WATER", "H1Client", "H1Collector", "H1ConnectionError",
           "H1PayloadError", "H1Response", "H1Timeout", "Timeouts", "host_port", "supports"]
