"""kvgate's HTTP/1.1 front end: an asyncio protocol on httptools' request parser that uvicorn's
server runs in place of its own (``uvicorn.run(..., http="<this module>:H1Protocol")``).

uvicorn keeps what it does once per process: binding or inheriting the socket, the worker
supervisor (middleware/workers.py), signals, the ASGI lifespan and the graceful shutdown (it
calls :meth:`H1Protocol.shutdown` on every connection, then waits for the connections and the
request tasks in ``server_state``). This module does what runs per request, with less work
than uvicorn's httptools protocol (``bench/overhead.py`` measures both: ``kvgate`` and
``kvgate-uvicorn``):

* The request body is buffered until :data:`BODY_HIGH_WATER` bytes and handed to the app in
  as few ``http.request`` messages as it arrived in before the app asked (one for a body that
  is complete when the app reads it), instead of pausing the socket at 64 KiB and waking the
  app once per 64 KiB.
* No proxy-headers middleware (kvgate reads neither ``client`` nor ``scheme`` from the scope),
  no access log (kvgate has its own, middleware/observe/access_log.py), no per-request
  ``asyncio.Event``: the app's ``receive`` waits on one future, created when it has to wait.
* The response head is built in one pass over the app's headers; a response with a
  content-length sends its head with the first body bytes, in one write (one syscall instead
  of two for a JSON answer).
* A client that leaves is told to the app by callback: the scope extension
  ``kvgate.disconnect`` is a :class:`DisconnectNotice`, a ``DisconnectSource``
  (transport/asgi.py), so the dispatcher needs no watcher task per request on ``receive``.

Behaviour kept from uvicorn's protocol: keep-alive (``timeout_keep_alive`` after a response;
HTTP/1.0 and ``Connection: close`` close), pipelined requests answered in order (reading
pauses while one waits), content-length and chunked request bodies (httptools decodes them),
``Expect: 100-continue``, responses with content-length or chunked when the app sets neither
(none for HEAD, 204 and 304), header names and values checked against response splitting,
write backpressure (``send`` waits while the transport's buffer is above its high-water
mark), ``http.disconnect`` once the client leaves or the response is complete, 400 on a
request httptools cannot parse, 500 when the app fails before answering (the connection is
closed when it fails after), ``limit_concurrency`` (503) and the graceful shutdown. Added:
limits on what a client can make a connection hold (414, 431, 408, 503: h1limits.py).
WebSocket upgrades are not served (the gateway has no WebSocket route): such a request is
answered as plain HTTP, as uvicorn does without a WebSocket library.
"""

from __future__ import annotations

import asyncio
import http
import logging
import re
import urllib.parse
from collections import deque
from collections.abc import Callable
from typing import Any, cast

import httptools

from kvgate.middleware.transport.asgi import DISCONNECT_EXTENSION
from kvgate.middleware.transport.error_response import PLAIN, send_error, with_status
from kvgate.middleware.transport.h1contract import (
    App,
    Message,
    ServerConfig,
    ServerState,
    addresses,
    service_unavailable,
)
from kvgate.middleware.transport.h1limits import HEAD, GuardedConnection, Refusal

log = logging.getLogger("kvgate.h1server")

#: Request body bytes buffered per connection before reading from the socket pauses until
#: the app takes them. 1 MiB holds an agent-sized body (200 KiB-1 MiB) whole, so it reaches
#: the app in one message; the bound keeps a slow app's connection from buffering more.
BODY_HIGH_WATER = 1 << 20
_HEADER_NAME = re.compile(b'[\x00-\x1f\x7f()<>@,;:\\[\\]={} \t\\\\"]')
_HEADER_VALUE = re.compile(b"[\x00-\x08\x0a-\x1f\x7f]")
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


def _check_headers(pairs: list[tuple[bytes, bytes]]) -> None:
    """Refuse a response header whose name is not a token or whose value holds a control
    character (response splitting), as uvicorn does: one search over all the names joined and
    one over all the values (a concatenation is clean exactly when each part is); the
    offending header is looked for only when one fails."""
    if not (_HEADER_NAME.search(b"".join([n for n, _ in pairs]))
            or _HEADER_VALUE.search(b"".join([v for _, v in pairs]))):
        return
    for name, value in pairs:
        if _HEADER_NAME.search(name) or _HEADER_VALUE.search(value):
            raise RuntimeError(f"invalid HTTP response header {name!r}")
_DISCONNECT: Message = {"type": "http.disconnect"}


def _status_line(code: int) -> bytes:
    try:
        phrase = http.HTTPStatus(code).phrase.encode()
    except ValueError:
        phrase = b""
    return b"HTTP/1.1 %d %s\r\n" % (code, phrase)


_STATUS = {code: _status_line(code) for code in range(100, 600)}


class DisconnectNotice:
    """A request's ``DisconnectSource`` (transport/asgi.py): callbacks for its client leaving."""

    __slots__ = ("disconnected", "watchers")

    def __init__(self) -> None:
        self.disconnected = False
        self.watchers: list[Callable[[], None]] = []

    def watch(self, callback: Callable[[], None]) -> None:
        self.watchers.append(callback)

    def unwatch(self, callback: Callable[[], None]) -> None:
        if callback in self.watchers:
            self.watchers.remove(callback)

    def fire(self) -> None:
        self.disconnected = True
        watchers, self.watchers = self.watchers, []
        for callback in watchers:
            callback()


class _Exchange:
    """One request and its response on a connection: the app's ``receive`` and ``send``."""

    __slots__ = ("chunked", "chunks", "complete", "conn", "disconnected", "expect_continue",
                 "head", "head_only", "keep_alive", "more_body", "notice", "remaining", "scope",
                 "started", "taken", "waiters")

    def __init__(self, conn: H1Protocol, scope: dict[str, Any], keep_alive: bool,
                 expect_continue: bool) -> None:
        self.conn = conn
        self.scope = scope
        self.keep_alive = keep_alive
        self.expect_continue = expect_continue
        self.head_only = scope["method"] == "HEAD"
        self.chunks: list[bytes] = []
        self.more_body = True  # the request body has not ended yet
        self.taken = False  # the whole request body has been handed to the app
        self.started = self.complete = self.disconnected = False
        self.chunked = False
        self.remaining = 0  # response bytes still owed under a content-length
        #: a content-length response's head, held to go out with its body in one write
        self.head = b""
        #: one future per ``receive`` call waiting (usually one; any number may wait)
        self.waiters: list[asyncio.Future[None]] = []
        #: the app's disconnect source; it holds no reference back to the exchange or the
        #: scope, so a finished request leaves no reference cycle for the GC to collect
        self.notice = DisconnectNotice()
        scope["extensions"] = {DISCONNECT_EXTENSION: self.notice}

    def gone(self) -> None:
        """The client disconnected before the response completed."""
        self.disconnected = True
        self.wake()
        self.notice.fire()

    def wake(self) -> None:
        waiters = self.waiters
        if waiters:
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)
            waiters.clear()

    def buffered(self) -> int:
        return sum(map(len, self.chunks))

    async def receive(self) -> Message:
        if self.expect_continue:
            self.expect_continue = False
            if not self.conn.transport.is_closing():
                self.conn.transport.write(_CONTINUE)
                self.conn.restart_body_window()
        while not (self.disconnected or self.complete):
            if self.chunks or not (self.more_body or self.taken):
                return self._take()
            self.conn.resume_reading()
            waiter = self.conn.loop.create_future()
            self.waiters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter in self.waiters:
                    self.waiters.remove(waiter)
                raise
        return _DISCONNECT

    def _take(self) -> Message:
        chunks = self.chunks
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        more = self.more_body
        self.chunks = []
        self.taken = not more
        self.conn.resume_reading()
        return {"type": "http.request", "body": body, "more_body": more}

    async def send(self, message: Message) -> None:
        conn = self.conn
        if conn.drained is not None and not self.disconnected:
            await conn.drained
        if self.disconnected:
            return
        kind = message["type"]
        if not self.started:
            if kind != "http.response.start":
                raise RuntimeError(f"expected ASGI message 'http.response.start', got {kind!r}")
            self._start(message["status"], message.get("headers", ()))
        elif not self.complete:
            if kind != "http.response.body":
                raise RuntimeError(f"expected ASGI message 'http.response.body', got {kind!r}")
            self._body(message.get("body", b""), message.get("more_body", False))
        else:
            raise RuntimeError(f"ASGI message {kind!r} sent after the response completed")

    def _start(self, status: int, headers: Any) -> None:
        out = [_STATUS[status]]
        length: int | None = None
        close = False
        pairs = [*self.conn.state.default_headers, *headers]
        _check_headers(pairs)
        for name, value in pairs:
            name = name.lower()
            if name == b"content-length" and length is None and not self.chunked:
                length = int(value)
            elif name == b"transfer-encoding" and value.lower() == b"chunked":
                self.chunked = True
            elif name == b"connection" and b"close" in [
                    t.strip().lower() for t in value.split(b",")]:
                close = True
            out += (name, b": ", value, b"\r\n")
        if close:
            self.keep_alive = False
        elif not self.keep_alive:
            out.append(b"connection: close\r\n")
        if not self.chunked and length is None and not self.head_only and status not in (204, 304):
            self.chunked = True
            out.append(b"transfer-encoding: chunked\r\n")
        self.remaining = 0 if self.chunked or length is None else length
        self.started = True  # after the checks: a refused head can still become a 500
        self.expect_continue = False
        out.append(b"\r\n")
        if self.remaining and not self.head_only:  # the body follows: one write for both
            self.head = b"".join(out)
        else:
            self.conn.transport.write(b"".join(out))

    def _body(self, body: bytes, more: bool) -> None:
        transport = self.conn.transport
        if self.head_only:
            self.remaining = 0
        elif self.chunked:
            parts = [b"%x\r\n" % len(body), body, b"\r\n"] if body else []
            if not more:
                parts.append(b"0\r\n\r\n")
            transport.writelines(parts)
        else:
            if len(body) > self.remaining:
                raise RuntimeError("response longer than its content-length")
            self.remaining -= len(body)
            if self.head:
                transport.writelines((self.head, body))
                self.head = b""
            else:
                transport.write(body)
        if not more:
            if self.remaining:
                raise RuntimeError("response shorter than its content-length")
            self.complete = True
            self.wake()
            self.conn.response_done(self)

    async def run(self, app: App) -> None:
        """The app on this exchange; what uvicorn does when it fails or answers incompletely."""
        try:
            await app(self.scope, self.receive, self.send)
        except BaseException:
            log.exception("exception in the ASGI application")
            if not self.started and not self.disconnected:
                await self._send_500()
            else:
                self.conn.transport.close()
            raise
        if not self.started and not self.disconnected:
            log.error("the ASGI application returned without starting a response")
            await self._send_500()
        elif not self.complete and not self.disconnected:
            log.error("the ASGI application returned without completing its response")
            self.conn.transport.close()

    async def _send_500(self) -> None:
        await send_error(self.send, with_status(500, "Internal Server Error"), PLAIN,
                         [(b"connection", b"close")])


class H1Protocol(GuardedConnection):
    """One client connection (the class uvicorn's server instantiates per connection)."""

    def __init__(self, config: ServerConfig, server_state: ServerState,
                 app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        if not config.loaded:
            config.load()
        self.app: App = config.loaded_app
        self.config = config
        self.loop = _loop or asyncio.get_event_loop()
        self.state = server_state
        self.app_state = app_state
        self.parser = httptools.HttpRequestParser(self)
        self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
        self.transport: asyncio.Transport = None  # type: ignore[assignment]  # set on connect
        self.addr: tuple[Any, Any, str] = (None, None, "http")  # server, client, scheme
        self.current: _Exchange | None = None  # the exchange the app is answering
        self.parsing: _Exchange | None = None  # the exchange whose request is being read
        self.queue: deque[_Exchange] = deque()  # pipelined requests waiting their turn
        self.read_paused = False
        self.drained: asyncio.Future[None] | None = None  # set while writing is paused
        self._guard_init(self.app)
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._expect = False

    # -- transport events ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.state.connections.add(self)
        self.transport = cast(asyncio.Transport, transport)  # uvloop's: no asyncio subclass
        self.addr = addresses(self.transport)
        self._admit()

    def connection_lost(self, exc: Exception | None) -> None:
        self.state.connections.discard(self)
        for ex in (self.current, *self.queue):
            if ex is not None and not ex.complete:
                ex.gone()
        # the protocol lives on in cycles (its parser, its transport) until a GC collection:
        # it should not keep its requests (their scopes, their bodies) alive with it; one
        # still being answered lives as long as its task
        self.current = self.parsing = None
        self.queue.clear()
        self.resume_writing()
        self._release()
        if exc is None:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            return  # the rest of what a refused client sends (h1limits: lingering close)
        self.chunk_at = self.fed
        self.fed += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            pass  # answered as plain HTTP (module docstring)
        except httptools.HttpParserError as exc:
            self._parse_failed(exc)
            return
        if self.reading != self.timer_for:
            self._follow()
        if self.reading == HEAD:
            self._check_head_chunk()

    def pause_writing(self) -> None:
        if self.drained is None:
            self.drained = self.loop.create_future()

    def resume_writing(self) -> None:
        drained, self.drained = self.drained, None
        if drained is not None and not drained.done():
            drained.set_result(None)

    def pause_reading(self) -> None:
        if not self.read_paused:
            self.read_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.read_paused and not self.queue:
            self.read_paused = False
            self.transport.resume_reading()
            self.restart_body_window()  # the server held the body up, not the client

    # -- httptools callbacks --------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._expect = False
        self.parsing = None
        self._head_began()

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > self.limits.max_url_bytes:
            raise Refusal("url_too_long")

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self._expect = True
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._head_done(self._url, self._headers)
        version = self.parser.get_http_version()
        keep_alive = version != "1.0" and self.parser.should_keep_alive()
        ex = _Exchange(self, self._scope(version), keep_alive, self._expect)
        self.parsing = ex
        if self.current is None:
            self._start(ex)
        else:
            self.queue.append(ex)
            self.pause_reading()

    def on_body(self, body: bytes) -> None:
        self.body_seen += len(body)
        ex = self.parsing
        if ex is None or ex.complete or ex.taken:
            return
        ex.chunks.append(body)
        if ex.buffered() > BODY_HIGH_WATER:
            self.pause_reading()
        ex.wake()

    def on_message_complete(self) -> None:
        self.reading = 0
        ex = self.parsing
        if ex is not None:
            ex.more_body = False
            ex.wake()

    # -- requests -------------------------------------------------------------------------------
    def _scope(self, version: str) -> dict[str, Any]:
        url = httptools.parse_url(self._url)
        raw_path: bytes = url.path
        path = raw_path.decode("ascii")
        if "%" in path:
            path = urllib.parse.unquote(path)
        root = self.config.root_path
        server, client, scheme = self.addr
        return {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": version, "server": server, "client": client, "scheme": scheme,
            "method": self.parser.get_method().decode("ascii"), "root_path": root,
            "path": root + path, "raw_path": root.encode("ascii") + raw_path,
            "query_string": url.query or b"", "headers": self._headers,
            "state": self.app_state.copy(),
        }

    def _start(self, ex: _Exchange) -> None:
        self.current = ex
        limit = self.config.limit_concurrency
        app = self.app
        if limit is not None and (len(self.state.connections) >= limit
                                  or len(self.state.tasks) >= limit):
            log.warning("exceeded concurrency limit")
            app = service_unavailable
        task = self.loop.create_task(ex.run(app))
        task.add_done_callback(self._task_done)
        self.state.tasks.add(task)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self.state.tasks.discard(task)
        if not task.cancelled():
            task.exception()  # logged by _Exchange.run; retrieved so asyncio does not again

    def response_done(self, ex: _Exchange) -> None:
        """``ex``'s response was sent: close, or go on with the next request."""
        self.state.total_requests += 1
        if not ex.keep_alive:
            self.transport.close()
        if self.transport.is_closing():
            return
        self.current = None
        if self.queue:
            self._start(self.queue.popleft())
        else:
            self.resume_reading()
            self._wait_next(self.config.timeout_keep_alive)

    def _drop_exchanges(self) -> bool:
        ex, current = self.parsing, self.current
        for pending in (current, *self.queue):
            if pending is not None and not pending.complete:
                pending.gone()
        self.queue.clear()
        return (current is None or current is ex) and (ex is None or not ex.started)

    def _awaiting_continue(self) -> bool:
        return self.parsing is not None and self.parsing.expect_continue

    def shutdown(self) -> None:
        """Graceful shutdown (uvicorn's server): close when idle, else after this response."""
        if self.current is None or self.current.complete:
            self.transport.close()
        else:
            self.current.keep_alive = False


__all__ = ["BODY_HIGH_WATER", "H1Protocol"]
