"""Who may read ``/metrics`` and the full ``/health``, and the admin listener that serves them
without a key (``server.admin_port``, ``kvgate serve --admin-port``; docs/security.md "Metrics
and health").

``/metrics`` carries every tenant's name, token counts and spend; ``/health`` the engines'
addresses, index states and the plugins' internals. With API keys on (an authenticator that
refuses a caller without credentials, :func:`auth_required`), the main port serves them to an
admin key only: ``/metrics`` answers 401 without a valid key and 403 for a key without
``admin`` (:func:`check_metrics_access`), and ``/health`` tells everyone else only whether the
gateway serves (``{"status": ...}``, same status code). With auth off both are as they were.

The admin listener is the usual Prometheus way: a second port, bound on the same host, that
only operators reach (a pod port, a firewall rule), serving ``GET /metrics`` and the full
``GET /health`` without a key and nothing else (404). It is a second uvicorn server on the
gateway's event loop (kvgate's HTTP/1.1 protocol, no lifespan of its own), started and stopped
by the gateway's lifespan. With ``--workers N`` every worker binds it with ``SO_REUSEPORT``
and answers for itself, as on the main port (middleware/workers.py).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from typing import Protocol

import uvicorn

from kvgate.middleware.framework.errors import Forbidden, HTTPError, MethodNotAllowed, NotFound
from kvgate.middleware.framework.plugin import Authenticator, authenticate
from kvgate.middleware.framework.types import Receive, Scope, Send
from kvgate.middleware.process import WORKERS_ENV
from kvgate.middleware.transport.asgi import send_bytes, send_json
from kvgate.middleware.transport.error_response import send_error

log = logging.getLogger("kvgate.admin_port")

PROMETHEUS_CT = (b"content-type", b"text/plain; version=0.0.4; charset=utf-8")
#: How long the admin listener's connections may take to finish at shutdown [s]: a scrape is
#: milliseconds; past this they are cut, so the gateway's own shutdown is not held up.
SHUTDOWN_GRACE_S = 2


def auth_required(auth: Authenticator | None) -> bool:
    """Whether API keys are on: an authenticator that refuses a caller without credentials
    (not one that lets anyone in, as ``api-keys`` with ``disabled: true`` does)."""
    if auth is None:
        return False
    try:
        auth.authenticate(None, None)
    except HTTPError:
        return True
    return False


def is_admin(auth: Authenticator | None, headers: Mapping[str, str]) -> bool:
    """The request carries a valid admin key (a principal with ``admin`` true; auth switched
    off counts). Never raises: a bad key is just not an admin."""
    if auth is None or not ({"authorization", "x-api-key"} & headers.keys()):
        return False
    try:
        principal = authenticate(auth, headers)
    except HTTPError:
        return False
    return getattr(principal, "admin", False) is True


def check_metrics_access(auth: Authenticator | None, headers: Mapping[str, str]) -> None:
    """``/metrics`` on the main port: anyone with auth off; with API keys on an admin key
    (Unauthorized without a valid key, Forbidden for a key without ``admin``)."""
    if not auth_required(auth):
        return
    assert auth is not None
    principal = authenticate(auth, headers)
    if getattr(principal, "admin", False) is not True:
        raise Forbidden("/metrics needs an admin key (it names every tenant); scrape the admin "
                        "port (server.admin_port) instead", code="admin_key_required")


class OpsViews(Protocol):
    """What the admin listener serves (the gateway app)."""

    def metrics_page(self) -> bytes: ...

    def health_report(self) -> tuple[int, dict[str, object]]: ...


class AdminApp:
    """ASGI app of the admin listener: ``GET /metrics`` and the full ``GET /health``, no key."""

    def __init__(self, views: OpsViews) -> None:
        self.views = views

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        try:
            if path not in ("/metrics", "/health"):
                raise NotFound(f"the admin port serves /metrics and /health, not {path}")
            if method != "GET":
                raise MethodNotAllowed(f"use GET here, not {method}")
            if path == "/metrics":
                await send_bytes(send, 200, self.views.metrics_page(), [PROMETHEUS_CT])
            else:
                status, body = self.views.health_report()
                await send_json(send, status, body)
        except HTTPError as err:
            await send_error(send, err)


def _bind(host: str, port: int, reuse_port: bool) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(128)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


class AdminListener:
    """The admin port's server: :meth:`start` binds ``host:port`` (OSError if it cannot) and
    serves :class:`AdminApp`; :meth:`stop` closes it. ``port`` 0 picks a free one (``port``
    then holds it)."""

    def __init__(self, views: OpsViews, host: str, port: int, log_level: str) -> None:
        self.host, self.port = host, port
        self.config = uvicorn.Config(
            AdminApp(views), http="kvgate.middleware.transport.h1server:H1Protocol", lifespan="off",
            log_config=None, access_log=False, log_level=log_level, proxy_headers=False,
            server_header=False, date_header=False, timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
        )
        self._server: uvicorn.Server | None = None
        self._sock: socket.socket | None = None

    async def start(self) -> None:
        workers = int(os.environ.get(WORKERS_ENV, "1"))
        self._sock = _bind(self.host, self.port, reuse_port=workers > 1)
        self.port = self._sock.getsockname()[1]
        self.config.load()
        server = uvicorn.Server(self.config)
        server.lifespan = self.config.lifespan_class(self.config)
        await server.startup(sockets=[self._sock])
        self._server = server
        log.info("admin port: /metrics and /health on %s:%d (no key)", self.host, self.port)

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            await server.shutdown(sockets=[self._sock] if self._sock is not None else None)
        elif self._sock is not None:
            self._sock.close()
        self._sock = None


__all__ = ["AdminApp", "AdminListener", "OpsViews", "auth_required", "check_metrics_access",
           "is_admin"]
