"""The engine call: every request kvgate sends to an engine goes through :meth:`EngineCall.open`
(the dispatcher's hops, the P/D prefill hop, the by-id relay), over a small
:class:`EngineTransport` (httpx's ``AsyncBaseTransport`` idea: send a request, get a response
with its status, headers and a body to read or receive piece by piece).

The call builds the headers (``content-type``, ``x-request-id``, the engine's own from the
pool, the trace context), picks the transport for the engine's URL, sends, takes an engine
that cannot be reached out of rotation, and turns an error status into its class
(middleware/framework/errors.py: ``EngineFailed`` 5xx, ``EngineBusy`` 408/429, ``UpstreamHTTPError``
other 4xx). It returns a response with a status below 400 whose body is unread; reading it is
middleware/serving/upstream.py's.

Transports, both raising kvgate's own errors only (``Unreachable``, ``EngineTimeout``,
``StreamBroken``):

* :class:`~kvgate.middleware.transport.h1client.H1Client`: the lean HTTP/1.1 client, for
  ``http://`` engines
  (``server.engine_client: lean``, the default);
* :class:`AiohttpTransport`: an ``aiohttp.ClientSession``, for every other engine, and for all
  of them with ``server.engine_client: aiohttp``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping
from typing import NamedTuple, Protocol

import aiohttp

from kvgate.middleware.framework.errors import (
    EngineTimeout,
    StreamBroken,
    Unreachable,
    UpstreamError,
    engine_status_error,
)
from kvgate.middleware.framework.redact import scrub
from kvgate.middleware.framework.types import Endpoint
from kvgate.middleware.observe.tracing import Tracing


class Timeouts(NamedTuple):
    """``total``: the whole exchange, connect to last byte; ``connect``: a free connection plus
    the TCP connect (seconds; None: unbounded)."""

    total: float | None
    connect: float | None


class EngineResponse(Protocol):
    """An engine's answer once its head is in. ``headers``: names lower-case.

    ``read`` gives the whole body and ends the exchange; ``receive`` what arrived so far
    (``b""`` at the end); ``release`` ends it keeping the connection if the body was read to
    its end, ``close`` ends it closing the connection (the engine sees the client leave)."""

    @property
    def status(self) -> int: ...

    @property
    def headers(self) -> Mapping[str, str]: ...

    async def read(self) -> bytes: ...

    def receive(self) -> Awaitable[bytes]: ...

    def release(self) -> None: ...

    def close(self) -> None: ...


class EngineTransport(Protocol):
    """Sends one request to an engine. Raises ``Unreachable`` (no connection, or it closed
    before an answer), ``EngineTimeout`` and ``StreamBroken`` (an answer that is not HTTP)."""

    def handles(self, url: str) -> bool:
        """Whether this transport can reach ``url``."""
        ...

    async def send(
        self, method: str, url: str, *, data: bytes | None, headers: Mapping[str, str],
        timeout: Timeouts,  # noqa: ASYNC109 - the exchange's own deadlines
    ) -> EngineResponse: ...

    async def close(self) -> None: ...


class AiohttpResponse:
    """An ``aiohttp.ClientResponse`` as an :class:`EngineResponse` (its errors translated)."""

    __slots__ = ("_resp", "headers", "status")

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self.status = resp.status
        self.headers: Mapping[str, str] = resp.headers

    async def read(self) -> bytes:
        try:
            return await self._resp.read()
        except TimeoutError:
            raise EngineTimeout("engine answer timed out") from None
        except aiohttp.ClientError as exc:
            raise StreamBroken(f"{type(exc).__name__}: {exc}") from None
        finally:
            self._resp.release()

    def receive(self) -> Awaitable[bytes]:
        return self._receive()

    async def _receive(self) -> bytes:
        try:
            return await self._resp.content.readany()
        except TimeoutError:
            raise EngineTimeout("engine answer timed out") from None
        except aiohttp.ClientError as exc:
            raise StreamBroken(f"{type(exc).__name__}: {exc}") from None

    def release(self) -> None:
        self._resp.release()

    def close(self) -> None:
        self._resp.close()


class AiohttpTransport:
    """An ``aiohttp.ClientSession`` as an :class:`EngineTransport` (any URL)."""

    def __init__(self, session: aiohttp.ClientSession) -> None:
        self.session = session
        self._timeouts: dict[Timeouts, aiohttp.ClientTimeout] = {}

    def handles(self, url: str) -> bool:
        return True

    async def send(
        self, method: str, url: str, *, data: bytes | None, headers: Mapping[str, str],
        timeout: Timeouts,  # noqa: ASYNC109 - the exchange's own deadlines
    ) -> AiohttpResponse:
        limits = self._timeouts.get(timeout)
        if limits is None:
            limits = self._timeouts[timeout] = aiohttp.ClientTimeout(
                total=timeout.total, connect=timeout.connect)
        try:
            resp = await self.session.request(method, url, data=data, headers=headers,
                                              timeout=limits)
        except TimeoutError:
            raise EngineTimeout("engine did not answer in time") from None
        except aiohttp.ClientConnectionError as exc:
            raise Unreachable(f"{type(exc).__name__}: {exc}") from None
        except aiohttp.ClientError as exc:
            raise StreamBroken(f"{type(exc).__name__}: {exc}") from None
        return AiohttpResponse(resp)

    async def close(self) -> None:
        """The session is the app's (it probes the engines too): closed by its owner."""


class Engines(Protocol):
    """What the engine call needs of the engine pool (middleware/fleet/pool.py ``EndpointPool``)."""

    def headers(self, endpoint_id: str) -> Mapping[str, str]:
        """Headers every request to the engine carries (its API key)."""
        ...

    def report_failure(self, endpoint_id: str, reason: str) -> None:
        """The engine could not be reached: out of rotation until a probe passes."""
        ...


class EngineCall:
    """Opens every engine request (module docstring). ``lean`` serves the URLs it handles,
    ``general`` the others; both are bound at startup (:meth:`bind`)."""

    def __init__(self, pool: Engines, tracing: Tracing, timeouts: Timeouts) -> None:
        self.pool = pool
        self.tracing = tracing
        self.timeouts = timeouts
        self.general: EngineTransport | None = None
        self.lean: EngineTransport | None = None

    def bind(self, general: EngineTransport, lean: EngineTransport | None = None) -> None:
        self.general, self.lean = general, lean

    def transport(self, url: str) -> EngineTransport:
        lean = self.lean
        if lean is not None and lean.handles(url):
            return lean
        assert self.general is not None, "EngineCall.bind was not called (app startup)"
        return self.general

    async def open(
        self, target: Endpoint, path: str, body: bytes | None, request_id: str,
        incoming: Mapping[str, str], *, method: str = "POST",
        content_type: str | None = "application/json",
    ) -> EngineResponse:
        """Send ``body`` to ``target``'s ``path`` (``incoming``: the client's headers, for the
        trace context); a response with a status below 400, body unread."""
        headers = {"x-request-id": request_id, **self.pool.headers(target.id)} \
            if content_type is None else \
            {"content-type": content_type, "x-request-id": request_id,
             **self.pool.headers(target.id)}
        self.tracing.inject(headers, incoming)
        url = target.url + path
        try:
            resp = await self.transport(url).send(method, url, data=body, headers=headers,
                                                  timeout=self.timeouts)
        except EngineTimeout:
            raise EngineTimeout(
                f"engine did not answer within {self.timeouts.total} s") from None
        except UpstreamError as exc:  # the client sees it: no engine address (redact.py)
            message = f"cannot reach engine: {type(exc).__name__}: {scrub(str(exc))}"
            if isinstance(exc, Unreachable):
                self.pool.report_failure(target.id, message)
                raise Unreachable(message) from None
            raise StreamBroken(message) from None
        if resp.status < 400:
            return resp
        try:
            payload = await resp.read()
        except UpstreamError:
            payload = b""
        raise engine_status_error(resp.status, payload)


__all__ = ["AiohttpResponse", "AiohttpTransport", "EngineCall", "EngineResponse",
           "EngineTransport", "Engines", "Timeouts"]
