"""What kvgate's HTTP/1.1 front end (middleware/transport/h1server.py) takes from uvicorn's server,
by
shape only: no private uvicorn module is imported.

uvicorn's server builds the protocol per connection as ``H1Protocol(config=, server_state=,
app_state=)`` (``uvicorn.run(..., http="kvgate.middleware.transport.h1server:H1Protocol")``): the
fields of
its config and server state the protocol reads are the Protocols below. That construction is
uvicorn's own contract, not a public API, so ``pyproject.toml`` pins uvicorn to the range the
tests ran against (``tests/unit/middleware/test_uvicorn_range.py`` fails outside it).

The helpers are kvgate's own small versions of what the protocol needs per connection (the
socket's addresses, TLS or not) and the answer beyond ``limit_concurrency``.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Protocol

from kvgate.middleware.transport.error_response import PLAIN, send_error, with_status

Message = MutableMapping[str, Any]
App = Callable[[MutableMapping[str, Any], Callable[[], Awaitable[Message]],
                Callable[[Message], Awaitable[None]]], Awaitable[None]]
Address = tuple[str, int] | None


class ServerConfig(Protocol):
    """The fields of ``uvicorn.Config`` the protocol reads."""

    loaded: bool
    loaded_app: Any
    root_path: str
    limit_concurrency: int | None
    timeout_keep_alive: float

    def load(self) -> None: ...


class ServerState(Protocol):
    """The fields of uvicorn's ``ServerState`` the protocol reads and writes: open connections
    and request tasks (waited for at shutdown), the default response headers, a counter."""

    total_requests: int
    connections: set[Any]
    tasks: set[asyncio.Task[None]]
    default_headers: list[tuple[bytes, bytes]]


def _address(sock: socket.socket | None, info: object, method: str) -> Address:
    if sock is not None:
        try:
            found = getattr(sock, method)()
        except OSError:
            return None
    else:
        found = info
    if isinstance(found, list | tuple) and len(found) >= 2:
        return str(found[0]), int(found[1])
    return None


def addresses(transport: asyncio.Transport) -> tuple[Address, Address, str]:
    """``(server, client, scheme)`` of a connection: the socket's own and its peer's address
    (None for a Unix socket), ``https`` when it speaks TLS."""
    sock = transport.get_extra_info("socket")
    server = _address(sock, transport.get_extra_info("sockname"), "getsockname")
    client = _address(sock, transport.get_extra_info("peername"), "getpeername")
    scheme = "https" if transport.get_extra_info("sslcontext") else "http"
    return server, client, scheme


async def service_unavailable(_scope: MutableMapping[str, Any],
                              _receive: Callable[[], Awaitable[Message]],
                              send: Callable[[Message], Awaitable[None]]) -> None:
    """The answer past ``limit_concurrency``: 503, plain text, the connection closed (as
    uvicorn answers it)."""
    await send_error(send, with_status(503, "Service Unavailable"), PLAIN,
                     [(b"connection", b"close")])


__all__ = ["App", "Message", "ServerConfig", "ServerState", "addresses", "service_unavailable"]
