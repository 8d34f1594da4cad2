"""One object per client request (:class:`RequestContext`) and one per dispatch (:class:`Attempt`).

Everything the core knows about a request travels in its context: the adapter of its API, the
ASGI channels, the parsed request, the plugins' cycle state and the headers every response
carries. Each dispatch (an engine hop or a backend call; a retried request has two) has an
:class:`Attempt`: its target, what happened on the wire, its usage tap. The dispatcher
(middleware/serving/dispatch.py) turns attempts into usage and completion hooks.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from kvgate.middleware.framework.api import ApiAdapter, ParsedRequest, UsageTap
from kvgate.middleware.framework.loopback import LoopbackContext
from kvgate.middleware.framework.types import (
    RESPONSE_HEADERS,
    CycleState,
    Endpoint,
    Headers,
    InferenceRequest,
    Principal,
    Receive,
    Send,
    Usage,
)
from kvgate.middleware.transport.asgi import DisconnectSource


class TrackedSend:
    """Wraps ``send`` to know whether the response has started (then no error body can follow).

    Not a coroutine function: it returns the server's own awaitable, so a send costs no extra
    coroutine (two per request)."""

    __slots__ = ("_send", "started")

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False

    def __call__(self, message: MutableMapping[str, Any]) -> Awaitable[None]:
        self.started = True
        return self._send(message)


@dataclass(slots=True, eq=False)
class RequestContext:
    """One client request, from entry to the ledger."""

    adapter: ApiAdapter
    send: TrackedSend
    receive: Receive
    #: The client's request headers (lower-cased; ``authorization`` and ``x-api-key``
    #: included: never logged).
    headers: dict[str, str]
    path: str
    query: bytes
    request_id: str
    #: Headers on every response to this request (``x-request-id``).
    response_headers: Headers
    received_at: float = field(default_factory=time.monotonic)
    parsed: ParsedRequest | None = None
    req: InferenceRequest | None = None
    state: CycleState = field(default_factory=CycleState)
    #: The status the client got (499: it left first).
    status: int = 500
    #: Set when the request came through the in-process loopback (a deferred job's run).
    loopback: LoopbackContext | None = None
    #: For the access log (middleware/observe/access_log.py), set by the dispatcher: the engines
    #: (and backends) dispatched to in order (a prefill hop as ``prefill:NAME``), the profiles the
    #: scheduler ran, the last dispatch's usage, the first upstream byte, the time upstream.
    engines: list[str] = field(default_factory=list)
    profiles: tuple[str, ...] = ()
    usage: Usage | None = None
    first_byte_at: float | None = None
    upstream_s: float = 0.0
    #: The error code of the error answer (``HTTPError.code``, else its type), or
    #: ``stream_broken`` (the engine broke off mid-answer), if any.
    error_code: str | None = None
    #: The client's well-formed ``x-request-id``, as soon as it is read.
    client_request_id: str | None = None
    #: Who the authenticator said the caller is (before the body is parsed).
    principal: Principal | None = None
    #: The server's notice of the client leaving (kvgate's own HTTP server gives one), else
    #: None: the dispatcher watches ``receive``.
    disconnect: DisconnectSource | None = None
    #: An engine failure of this request whose breaker verdict waits for the retry (engine,
    #: reason), and whether a second engine failed it too: then it is the request's fault
    #: (middleware/fleet/pool.py ``suspect``, ``settle``).
    suspect: tuple[str, str] | None = None
    request_fault: bool = False

    @property
    def started(self) -> bool:
        return self.send.started

    @property
    def request(self) -> InferenceRequest:
        """The parsed request (only after parsing: the dispatcher runs after it)."""
        assert self.req is not None, "request not parsed yet"
        return self.req

    def plugin_headers(self) -> Headers:
        """Headers plugins asked for (``add_response_header``), as they stand now."""
        headers = self.state.get(RESPONSE_HEADERS)
        if not headers:
            return []
        return [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]


@dataclass(slots=True, eq=False)
class Attempt:
    """One dispatch of a request: its target and what happened on the wire so far."""

    target: Endpoint
    headers: Headers
    tap: UsageTap | None = None
    status: int = 0
    first_byte_at: float | None = None
    #: The usage the client and the usage hooks see (after any P/D rewrite).
    usage: Usage | None = None
    events: int = 0
    #: Why the stream ended early, if it did.
    broken: str | None = None
    usage_reported: bool = False


__all__ = ["Attempt", "RequestContext", "TrackedSend"]
