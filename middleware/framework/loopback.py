"""In-process calls through the gateway's own request path (deferred jobs).

A :class:`Loopback` builds an ASGI scope for ``method path body`` and runs the app on it, so a
job queued earlier goes through auth context, catalog, allow-lists, routing, retries, billing
and the ledger exactly like a live request. The scope carries a private
``scope["kvgate"]`` :class:`LoopbackContext` that the gateway honours:

* ``principal`` replaces authentication (no secret is stored with a job; the principal is
  looked up again by key id when the job runs, see :meth:`Loopback.principal_for`);
* ``request_id`` replaces the generated request id (a job's id: the ledger upserts by
  request id, so a job run twice after a crash is billed once);
* ``tier`` sets ``InferenceRequest.service_tier`` (None for live traffic): the pricing tier.

Network clients cannot set scope keys (the ASGI server builds the scope from the wire), so a
header named like it does nothing. The answer is collected whole, up to ``max_bytes``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvgate.middleware.framework.errors import BadAnswer, UpstreamError
from kvgate.middleware.framework.plugin import AsgiApp, Authenticator, PrincipalLookup
from kvgate.middleware.framework.types import Endpoint, LoopbackResponse, Message, Principal, Scope

#: The scope key of a loopback call's context.
SCOPE_KEY = "kvgate"


@dataclass(frozen=True, slots=True)
class LoopbackContext:
    """What a loopback call tells the gateway (``scope["kvgate"]``)."""

    principal: Principal | None
    request_id: str | None
    tier: str | None


def loopback_context(scope: Scope) -> LoopbackContext | None:
    """The loopback context of ``scope``, if the request came through a :class:`Loopback`."""
    found = scope.get(SCOPE_KEY)
    return found if isinstance(found, LoopbackContext) else None


class Loopback:
    """Calls ``app`` in process. ``max_bytes`` bounds one collected answer (a larger one is a
    502 ``BadAnswer``, not retried): 64 MiB, well past any JSON answer an engine gives
    to one request, yet bounding what one job makes the gateway hold."""

    def __init__(self, app: AsgiApp, authenticator: Authenticator | None,
                 endpoints: Callable[[], Sequence[Endpoint]] = tuple,
                 max_bytes: int = 64 * 1024 * 1024,
                 live_queued: Callable[[], int] = int) -> None:
        self._app = app
        self._auth = authenticator
        self._endpoints = endpoints
        self._live_queued = live_queued
        self.max_bytes = max_bytes

    def endpoints(self) -> Sequence[Endpoint]:
        """The engine pool's current snapshot (health, in-flight load, scraped metrics): what a
        deferred-work runner reads to start jobs only while the fleet has headroom."""
        return self._endpoints()

    def live_queued(self) -> int:
        """Live requests waiting in the gateway's flow control now (0 without one): deferred
        work starts only while none wait (it sits below every live priority band)."""
        return self._live_queued()

    def authenticate(self, headers: Mapping[str, str]) -> Principal | None:
        """The gateway's authenticator on lower-cased ``headers`` (raises Unauthorized); None
        when no authenticator is configured."""
        if self._auth is None:
            return None
        return self._auth.authenticate(headers.get("authorization"), headers.get("x-api-key"))

    @property
    def has_auth(self) -> bool:
        return self._auth is not None

    def principal_for(self, key_id: str | None) -> Principal | None:
        """The principal of key ``key_id`` as the authenticator knows it now (its current
        allow-list and budget), if the authenticator can look keys up by id; None otherwise."""
        if key_id is None or not isinstance(self._auth, PrincipalLookup):
            return None
        return self._auth.principal_for(key_id)

    async def call(
        self, method: str, path: str, body: bytes, *, principal: Principal | None = None,
        request_id: str | None = None, tier: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> LoopbackResponse:
        raw_headers = [(b"content-type", b"application/json"),
                       (b"content-length", str(len(body)).encode())]
        raw_headers += [(k.lower().encode("latin-1"), v.encode("latin-1"))
                        for k, v in (headers or {}).items()]
        scope: Scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": method.upper(), "scheme": "http", "path": path, "raw_path": path.encode(),
            "query_string": b"", "root_path": "", "headers": raw_headers,
            "client": ("127.0.0.1", 0), "server": ("kvgate-loopback", 0),
            SCOPE_KEY: LoopbackContext(principal, request_id, tier),
        }
        collector = _Collector(body, self.max_bytes)
        await self._app(scope, collector.receive, collector.send)
        return collector.response()


class _Collector:
    """ASGI channels of one loopback call: the body once, then no disconnect until the answer
    is complete; the answer collected."""

    def __init__(self, body: bytes, max_bytes: int) -> None:
        self._body: bytes | None = body
        self._done = asyncio.Event()
        self._max = max_bytes
        self.status = 0
        self.headers: dict[str, str] = {}
        self.chunks: list[bytes] = []
        self.size = 0

    async def receive(self) -> Message:
        if self._body is not None:
            body, self._body = self._body, None
            return {"type": "http.request", "body": body, "more_body": False}
        await self._done.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = int(message["status"])
            self.headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                            for k, v in message.get("headers", [])}
        elif message["type"] == "http.response.body":
            chunk = bytes(message.get("body", b""))
            self.size += len(chunk)
            if self.size > self._max:
                self._done.set()
                raise BadAnswer(f"answer exceeds {self._max} bytes")
            self.chunks.append(chunk)
            if not message.get("more_body", False):
                self._done.set()

    def response(self) -> LoopbackResponse:
        self._done.set()
        if self.status == 0:
            raise UpstreamError("the gateway sent no answer")
        return LoopbackResponse(self.status, self.headers, b"".join(self.chunks))


__all__ = ["SCOPE_KEY", "Loopback", "LoopbackContext", "LoopbackResponse", "loopback_context"]
