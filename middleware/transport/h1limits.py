"""What a client can make kvgate's HTTP/1.1 front end (middleware/transport/h1server.py) hold,
bounded:
the limits of ``ServerConfig`` (docs/security.md, "HTTP front-end limits"), the answers a
connection is refused with, the counts of refusals for ``/metrics``, and
:class:`GuardedConnection`, the half of ``H1Protocol`` that enforces them.

A connection has one timer, armed for one thing at a time (``timer_for``):

* ``FRESH``: a new connection's first request head, due ``head_timeout_s`` after the
  connection opened (nothing received by then: closed; part of a head: 408);
* ``HEAD``: a later request's head, due ``head_timeout_s`` after its first byte (408);
* ``BODY``: a request body, due ``body_timeout_s`` after its head (or after the
  ``100 Continue``), one second later per ``body_min_bytes_per_s`` bytes received; checked
  when the timer fires, so receiving costs no timer work (408). Time while the server itself
  pauses reading (its buffer is full, a pipelined request waits) does not count;
* ``IDLE``: a keep-alive connection between requests, closed after ``timeout_keep_alive``;
* ``LINGER``: a refused connection, closed at the latest :data:`LINGER_S` after its answer.

A refusal answers in OpenAI's error shape with ``connection: close``, then half-closes and
reads what the client still sends for up to :data:`LINGER_S` (nginx's lingering close): a
socket closed with unread bytes sends a TCP reset, which can destroy the answer in the
client's buffers before it is read. When another request's response is under way on the
connection (pipelining), there is no answer: the connection is only closed.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvgate.middleware.framework.composition.config import ServerConfig
from kvgate.middleware.transport.error_response import OPENAI, PLAIN, wire_response, with_status

log = logging.getLogger("kvgate.h1server")

#: Seconds a refused connection is kept half-closed, reading and dropping what the client
#: still sends, so that the answer is not lost to a reset (nginx: lingering_timeout 5 s).
LINGER_S = 2.0
#: ``Retry-After`` of the 503 beyond ``max_connections`` [s]: connections turn over in seconds.
RETRY_AFTER_S = 1
#: What a connection's timer is armed for (module docstring); 0: nothing.
FRESH, HEAD, BODY, IDLE, LINGER = 1, 2, 3, 4, 5

#: Refusals by reason (the ``reason`` label): status, error type and code.
REFUSALS: dict[str, tuple[int, str, str]] = {
    "url_too_long": (414, "invalid_request_error", "url_too_long"),
    "head_too_large": (431, "invalid_request_error", "request_head_too_large"),
    "too_many_headers": (431, "invalid_request_error", "too_many_headers"),
    "head_timeout": (408, "invalid_request_error", "request_timeout"),
    "body_timeout": (408, "invalid_request_error", "request_timeout"),
    "too_many_connections": (503, "server_error", "too_many_connections"),
    "invalid": (400, "invalid_request_error", "invalid_http"),  # unparsable: see _answer
}
#: Connections closed for idling, by when: before their first request, or kept alive after one.
IDLE_CLOSES = ("before_request", "keep_alive")


class H1Limits:
    """One front end's limits (``ServerConfig``), the answers it refuses with and the counts
    of what it refused. The app carries it as ``h1_limits`` (:func:`limits_of`)."""

    __slots__ = ("answers", "body_min_bytes_per_s", "body_timeout_s", "closed",
                 "head_timeout_s", "max_connections", "max_head_bytes", "max_headers",
                 "max_url_bytes", "open", "refused")

    def __init__(self, server: ServerConfig) -> None:
        self.max_url_bytes = server.max_url_bytes
        self.max_head_bytes = server.max_head_bytes
        self.max_headers = server.max_headers
        self.head_timeout_s = server.head_timeout_s
        self.body_timeout_s = server.body_timeout_s
        self.body_min_bytes_per_s = server.body_min_bytes_per_s
        self.max_connections = server.max_connections
        self.refused = dict.fromkeys(REFUSALS, 0)
        self.closed = dict.fromkeys(IDLE_CLOSES, 0)
        self.open = 0  # connections admitted and not yet closed
        self.answers = {reason: _answer(reason, self._message(reason)) for reason in REFUSALS}

    def _message(self, reason: str) -> str:
        return {
            "url_too_long": f"request target longer than {self.max_url_bytes} bytes",
            "head_too_large": f"request head larger than {self.max_head_bytes} bytes",
            "too_many_headers": f"more than {self.max_headers} request headers",
            "head_timeout": f"request head not received within {self.head_timeout_s:g} s",
            "body_timeout": (f"request body slower than {self.body_min_bytes_per_s} bytes/s "
                             f"after its first {self.body_timeout_s:g} s"
                             if self.body_min_bytes_per_s else
                             f"request body not received within {self.body_timeout_s:g} s"),
            "too_many_connections": f"{self.max_connections} connections open, the most this "
                                    f"server takes: retry after {RETRY_AFTER_S} s",
            "invalid": "Invalid HTTP request received.",
        }[reason]


def _answer(reason: str, message: str) -> bytes:
    """The whole response of a refusal, rendered where every error is
    (middleware/transport/error_response.py): OpenAI's error shape; the 400 for an unparsable
    request
    plain text, as uvicorn answers it and kvgate always did."""
    status, kind, code = REFUSALS[reason]
    retry = {"retry-after": str(RETRY_AFTER_S)} if status == 503 else None
    err = with_status(status, message, kind=kind, code=code, headers=retry)
    return wire_response(err, PLAIN if reason == "invalid" else OPENAI)


@functools.cache
def _default_limits() -> H1Limits:
    return H1Limits(ServerConfig())


def limits_of(app: object) -> H1Limits:
    """The limits ``app`` carries (``h1_limits``, looked for through wrapping middleware's
    ``app``); else one shared instance of ``ServerConfig``'s defaults."""
    for _ in range(4):
        found = getattr(app, "h1_limits", None)
        if isinstance(found, H1Limits):
            return found
        app = getattr(app, "app", None)
        if app is None:
            break
    return _default_limits()


class Refusal(Exception):
    """Raised in a parser callback: the request is refused for ``reason``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class GuardedConnection(asyncio.Protocol):
    """The limits' half of a connection (``H1Protocol`` subclasses it): its timer, its
    admission, its refusals. ``H1Protocol`` calls :meth:`_guard_init`, sets ``reading``
    (``HEAD``, ``BODY`` or 0) from its parser callbacks and calls :meth:`_follow` when
    ``reading`` and ``timer_for`` differ after a feed."""

    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    read_paused: bool

    def _guard_init(self, app: object) -> None:
        self.limits = limits_of(app)
        self.timer: asyncio.TimerHandle | None = None
        self.timer_for = 0
        self.reading = 0  # the current request's part being received: HEAD, BODY or 0
        self.fed = 0  # bytes received on the connection
        self.chunk_at = 0  # where the chunk being parsed begins, in ``fed``
        self.head_from = 0  # where the chunk with the head's first byte begins
        self.head_after = 0  # where that chunk ends
        self.body_since = 0.0  # loop time the body's window opened
        self.body_seen = 0  # body bytes received since then
        self.admitted = False
        self.lingering = False

    # -- to be provided by the protocol -----------------------------------------------------
    def _drop_exchanges(self) -> bool:
        """Before a refusal: the app is told its requests' client left. True when no response
        is under way, so the refusal may be answered."""
        raise NotImplementedError

    def _awaiting_continue(self) -> bool:
        """The request being received waits for its ``100 Continue`` (the client for us)."""
        raise NotImplementedError

    # -- connection -------------------------------------------------------------------------
    def _admit(self) -> None:
        """A new connection: admitted if under ``max_connections`` (else its first request
        gets 503); its first head is due ``head_timeout_s`` from now."""
        limits = self.limits
        if limits.open < limits.max_connections:
            limits.open += 1
            self.admitted = True
        self._arm(FRESH, limits.head_timeout_s)

    def _admit_late(self) -> None:
        """At the first head's end on a connection not admitted: one may have closed since."""
        limits = self.limits
        if limits.open >= limits.max_connections:
            raise Refusal("too_many_connections")
        limits.open += 1
        self.admitted = True

    def _release(self) -> None:
        if self.admitted:
            self.admitted = False
            self.limits.open -= 1
        self._disarm()

    # -- the timer --------------------------------------------------------------------------
    def _arm(self, kind: int, delay: float) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = self.loop.call_later(delay, self._expired)
        self.timer_for = kind

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.timer_for = 0

    def _follow(self) -> None:
        """After a feed, the timer for what is being received (``reading``)."""
        if self.reading == HEAD:
            self._arm(HEAD, self.limits.head_timeout_s)
        elif self.reading == BODY:
            self.restart_body_window()
            self._arm(BODY, self.limits.body_timeout_s)
        elif self.timer_for in (HEAD, BODY):  # the request is complete
            self._disarm()

    def _head_began(self) -> None:
        """A request's first byte (parser callback): a new connection's deadline now applies
        to this head; an idle connection's is done."""
        if self.timer_for == FRESH:
            self.timer_for = HEAD
        elif self.timer is not None:
            self._disarm()
        self.head_from = self.chunk_at
        self.head_after = self.fed
        self.reading = HEAD

    def _wait_next(self, keep_alive_s: float) -> None:
        """A response is done and no request waits: idle, unless the next one is arriving."""
        if not self.reading:
            self._arm(IDLE, keep_alive_s)

    def restart_body_window(self) -> None:
        """The body's time starts (again) now: its head is in, its ``100 Continue`` is sent,
        or reading resumes after the server paused it."""
        self.body_since = self.loop.time()
        self.body_seen = 0

    def _expired(self) -> None:
        kind, self.timer, self.timer_for = self.timer_for, None, 0
        if kind == BODY:
            self._body_expired()
        elif kind == HEAD:
            self.refuse("head_timeout")
        elif kind in (FRESH, IDLE):
            self.limits.closed["before_request" if kind == FRESH else "keep_alive"] += 1
            self.transport.close()
        else:
            self.transport.close()

    def _body_expired(self) -> None:
        limits = self.limits
        now = self.loop.time()
        if self.read_paused or self._awaiting_continue():  # the server keeps the client waiting
            self.restart_body_window()
            self._arm(BODY, limits.body_timeout_s)
            return
        due = self.body_since + limits.body_timeout_s
        if limits.body_min_bytes_per_s:
            due += self.body_seen / limits.body_min_bytes_per_s
        if now < due:
            self._arm(BODY, due - now)
        else:
            self.refuse("body_timeout")

    # -- heads ------------------------------------------------------------------------------
    def _check_head_chunk(self) -> None:
        """After a feed that left a head incomplete: the chunks received whole inside it (a
        lower bound of its size, so httptools buffers no more than a chunk past the limit)."""
        if self.fed - self.head_after > self.limits.max_head_bytes:
            self.refuse("head_too_large")

    def _head_done(self, url: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        """At a head's end (parser callback): admission if still pending, the header count,
        and the head's size, counted only when the chunks it came in could exceed the limit."""
        if not self.admitted:
            self._admit_late()
        self.reading = BODY
        limits = self.limits
        if len(headers) > limits.max_headers:
            raise Refusal("too_many_headers")
        if self.fed - self.head_from > limits.max_head_bytes and len(url) + sum(
                len(n) + len(v) + 3 for n, v in headers) > limits.max_head_bytes:
            raise Refusal("head_too_large")

    # -- refusing ---------------------------------------------------------------------------
    def _parse_failed(self, exc: Exception) -> None:
        """httptools stopped: on a :class:`Refusal` from a callback, or on a malformed request
        (400, logged as uvicorn does)."""
        refusal = exc.__context__
        if isinstance(refusal, Refusal):
            self.refuse(refusal.reason)
        else:
            log.warning("invalid HTTP request received")
            self.refuse("invalid")

    def refuse(self, reason: str) -> None:
        """Count, answer (unless a response is under way), half-close and linger."""
        self.limits.refused[reason] += 1
        answer = self._drop_exchanges()
        transport = self.transport
        if transport.is_closing():
            return
        if answer:
            transport.write(self.limits.answers[reason])
        self.lingering = True
        if not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        if self.read_paused:
            self.read_paused = False
            transport.resume_reading()
        self._arm(LINGER, LINGER_S)


class H1LimitsCollector(Collector):
    """The front end's refusals, idle closes and admitted connections on ``/metrics``."""

    def __init__(self, limits: H1Limits) -> None:
        self._limits = limits

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        limits = self._limits
        refused = CounterMetricFamily(
            "kvgate_http_refused", "Requests the HTTP front end refused, by the limit hit "
            "(docs/security.md)", labels=["reason"])
        for reason, count in limits.refused.items():
            refused.add_metric([reason], count)
        closed = CounterMetricFamily(
            "kvgate_http_idle_closed", "Client connections closed for idling: before a first "
            "request (head_timeout_s) or kept alive after one (keep_alive_timeout_s)",
            labels=["when"])
        for when, count in limits.closed.items():
            closed.add_metric([when], count)
        yield refused
        yield closed
        yield GaugeMetricFamily("kvgate_http_connections",
                                "Client connections admitted and open (max_connections)",
                                value=limits.open)


__all__ = ["LINGER_S", "REFUSALS", "GuardedConnection", "H1Limits", "H1LimitsCollector",
           "Refusal", "limits_of"]
