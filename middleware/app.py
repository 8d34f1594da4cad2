"""The ASGI application: routes, lifespan, and the app factory ``create_app``.

The app owns every background task (pool probing, plugin lifecycles) through its lifespan;
nothing runs at import time. ``async with app.running():`` does the same for in-process use
(tests with ``httpx.ASGITransport``, which does not send lifespan events).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Coroutine, Mapping
from pathlib import Path
from typing import Any

import aiohttp

from kvgate.middleware.fleet.breaker import BreakerCollector
from kvgate.middleware.fleet.pool import EndpointPool
from kvgate.middleware.framework.composition.config import GatewayConfig
from kvgate.middleware.framework.composition.pipeline import build_pipeline
from kvgate.middleware.framework.composition.registry import Registry
from kvgate.middleware.framework.errors import (
    ConfigError,
    HTTPError,
    MethodNotAllowed,
    NotFound,
    internal_error,
    model_not_found,
)
from kvgate.middleware.framework.loopback import Loopback
from kvgate.middleware.framework.plugin import (
    AsgiApp,
    HealthSource,
    HttpRequest,
    MetricsSource,
    allowed_models,
    authenticate,
)
from kvgate.middleware.framework.redact import public_view
from kvgate.middleware.framework.types import Receive, Scope, Send
from kvgate.middleware.observe.metrics import GatewayMetrics
from kvgate.middleware.observe.tracing import Tracing
from kvgate.middleware.serving.gateway import ApiRoutes, Gateway
from kvgate.middleware.serving.routing_state import RoutingStateFile
from kvgate.middleware.serving.states import StateMapCollector, state_map
from kvgate.middleware.transport.admin_port import (
    PROMETHEUS_CT,
    AdminListener,
    auth_required,
    check_metrics_access,
    is_admin,
)
from kvgate.middleware.transport.asgi import (
    ClientGone,
    header_map,
    read_body,
    send_bytes,
    send_json,
)
from kvgate.middleware.transport.engine_call import AiohttpTransport
from kvgate.middleware.transport.error_response import send_error
from kvgate.middleware.transport.h1client import H1Client, H1Collector, host_port
from kvgate.middleware.transport.h1limits import H1Limits, H1LimitsCollector

log = logging.getLogger("kvgate.app")

_MODELS_PREFIX = "/v1/models/"
#: Paths the app serves itself (no API adapter or plugin may take them).
_CORE_PATHS = frozenset({"/v1/models", "/health", "/metrics"})


#: The longest one plugin's ``stop`` may take at shutdown [s]. A stop flushes a spool, a queue
#: or a connection in well under a second; past this it is stuck (a task that ignores its
#: cancellation, a peer that never answers), and a shutdown that never ends would hold the port
#: and every other plugin's resources until the process is killed.
STOP_TIMEOUT_S = 15.0


async def _bounded(step: Coroutine[Any, Any, None], what: str) -> None:
    """Run one shutdown step for at most :data:`STOP_TIMEOUT_S`; a stuck one is cancelled,
    left behind and named in a WARNING, and the shutdown goes on."""
    task = asyncio.ensure_future(step)
    done, _ = await asyncio.wait({task}, timeout=STOP_TIMEOUT_S)
    if task in done:
        task.result()  # a failed stop still raises, as before
        return
    task.cancel()
    log.warning("shutdown: %s did not stop within %.0f s; cancelled and left behind, the "
                "shutdown goes on", what, STOP_TIMEOUT_S)


class KvgateApp:
    """ASGI callable. Build it with :func:`create_app`."""

    def __init__(self, config: GatewayConfig, registry: Registry) -> None:
        self.config = config
        self.pipeline = build_pipeline(config, registry)
        self.pool = EndpointPool(
            config.engines, self.pipeline.adapters, config.pool, self.pipeline.listeners
        )
        self.metrics = GatewayMetrics(self.pool.snapshot, config.server.hook_timing_every)
        self.metrics.registry.register(
            BreakerCollector(self.pool.breaker_states, self.pool.transitions))
        for plugin in self.pipeline.plugins.values():
            if isinstance(plugin, MetricsSource):
                self.metrics.registry.register(plugin.collector())
        self.metrics.add_plugins(self.pipeline.plugins)
        self.pipeline.scheduler.timer = self.metrics.hooks
        plugin_paths = {path for _, path in self.pipeline.routes}
        adapters = registry.api_adapters(config.apis, config.source)
        self.apis = ApiRoutes(adapters, _CORE_PATHS | plugin_paths)
        self.mounts = check_mounts(config.source, self.pipeline.mounts,
                                   _CORE_PATHS | plugin_paths | self.apis.paths())
        states = state_map(config)  # shared through Redis with shared_state
        self.metrics.registry.register(StateMapCollector(states))
        self.tracing = Tracing.from_config(config.tracing)
        self.gateway = Gateway(config, self.pipeline, self.pool, self.metrics, states,
                               tracing=self.tracing)
        self.routing_state = _routing_state(config, self.pipeline.plugins)
        if self.routing_state is not None:
            self.metrics.registry.register(self.routing_state.collector())
        self.started_at = int(time.time())
        self._session: aiohttp.ClientSession | None = None
        self._client: H1Client | None = None
        self.metrics.registry.register(H1Collector(
            lambda: self._client, {host_port(e.url): e.name for e in config.engines}))
        #: what the HTTP front end (middleware/transport/h1server.py) holds its connections to
        self.h1_limits = H1Limits(config.server)
        self.metrics.registry.register(H1LimitsCollector(self.h1_limits))
        gates = self.pipeline.gates
        self.loopback = Loopback(self, self.pipeline.authenticator, self.pool.snapshot,
                                 live_queued=lambda: sum(g.queued() for g in gates))
        for user in self.pipeline.loopback_users:
            user.bind_loopback(self.loopback)
        server = config.server
        #: ``server.admin_port``: /metrics and the full /health without a key (None: none).
        self.admin: AdminListener | None = None if server.admin_port is None else \
            AdminListener(self, server.host, server.admin_port, server.log_level)

    # -- lifespan ------------------------------------------------------------------------
    async def startup(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=0, limit_per_host=self.config.server.connections_per_engine,
            keepalive_timeout=30, enable_cleanup_closed=True,
        )
        self._session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, skip_auto_headers=("User-Agent",)
        )
        self.gateway.session = self._session
        lean = None
        if self.config.server.engine_client == "lean":
            lean = self._client = H1Client(self.config.server.connections_per_engine)
        self.gateway.dispatcher.engine.bind(AiohttpTransport(self._session), lean)
        await self.pool.start(self._session)
        for plugin in self.pipeline.lifecycles:
            await plugin.start()
        if self.routing_state is not None:
            self.routing_state.start()
        if self.admin is not None:
            await self.admin.start()
        log.info("kvgate ready: %d engines, models %s", len(self.config.engines),
                 sorted(self.pool.models()))

    async def shutdown(self) -> None:
        if self.admin is not None:
            await _bounded(self.admin.stop(), "the admin port")
        if self.routing_state is not None:
            await _bounded(self.routing_state.stop(), "the routing state's last save")
        for plugin in reversed(self.pipeline.lifecycles):
            await _bounded(plugin.stop(), f"plugin {getattr(plugin, 'name', plugin)!r}")
        await _bounded(self.pool.stop(), "the engine pool")
        await _bounded(self.gateway.states.close(), "the shared state-id store")
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._client is not None:
            await self._client.close()
            self._client = None
        if self.tracing.enabled:  # exports what is queued: blocking, so off the loop
            await asyncio.to_thread(self.tracing.shutdown)
        self.gateway.access_log.flush()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[KvgateApp]:
        await self.startup()
        try:
            yield self
        finally:
            await self.shutdown()

    # -- ASGI ------------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as exc:
                    log.exception("startup failed")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        method: str = scope["method"]
        found = self.apis.match(method, path)
        if found is not None:
            await self.gateway.handle(scope, receive, send, *found)
            return
        for prefix, mounted in self.mounts:
            if path == prefix or path.startswith(prefix + "/"):
                await mounted(scope, receive, send)
                return
        try:
            if self.apis.allows_path(path):
                raise MethodNotAllowed(f"{method} is not allowed on {path}")
            if path == "/health":
                _require(method, "GET")
                await self._health(send, header_map(scope))
            elif path == "/metrics":
                _require(method, "GET")
                check_metrics_access(self.pipeline.authenticator, header_map(scope))
                await send_bytes(send, 200, self.metrics_page(), [PROMETHEUS_CT])
            elif path == "/v1/models" or path.startswith(_MODELS_PREFIX):
                _require(method, "GET")
                await send_json(send, 200, self._models(path, header_map(scope)))
            else:
                await self._plugin_route(scope, receive, send)
        except HTTPError as err:
            await send_error(send, err)
        except ClientGone:
            return
        except Exception:
            rid = uuid.uuid4().hex
            log.exception("unexpected error on %s %s (request %s)", method, path, rid)
            await send_error(send, internal_error(rid))

    async def _plugin_route(self, scope: Scope, receive: Receive, send: Send) -> None:
        path, method = scope["path"], scope["method"]
        route = self.pipeline.routes.get((method, path))
        if route is None:
            if any(p == path for _, p in self.pipeline.routes):
                raise MethodNotAllowed(f"{method} is not allowed on {path}")
            raise NotFound(f"no route for {method} {path}")
        headers = header_map(scope)
        body = await read_body(receive, headers, self.config.server.max_body_bytes)
        query = urllib.parse.parse_qs(scope.get("query_string", b"").decode("latin-1"))
        resp = await route.handler(HttpRequest(method, path, query, headers, body))
        out = [(b"content-type", resp.content_type.encode()),
               *((k.encode(), v.encode()) for k, v in resp.headers.items())]
        await send_bytes(send, resp.status, resp.body, out)

    def metrics_page(self) -> bytes:
        """The Prometheus exposition of every series (tenants' included): for an admin key or
        the admin port (middleware/transport/admin_port.py)."""
        return self.metrics.render()

    def health_report(self) -> tuple[int, dict[str, object]]:
        """``/health``'s status and full body: engines, plugin sections, routing state. 200
        (ready) once a probe has confirmed an engine that is in rotation; 503 before
        (``starting``) and while none is."""
        engines = self.pool.status()
        healthy = sum(1 for e in engines if e["healthy"])
        ready = self.pool.ready()
        starting = not any(e["confirmed"] for e in engines)
        body: dict[str, object] = {
            "status": "ok" if ready else "starting" if starting else "unavailable",
            "engines_healthy": healthy, "engines_total": len(engines), "engines": engines,
        }
        sections = self._plugin_health()
        if sections:
            body["plugins"] = sections
        if self.routing_state is not None:
            body["routing_state"] = self.routing_state.health()
        shared_ids = self.gateway.states.health()
        if shared_ids is not None:  # Redis down: ids not held here are refused
            body["state_ids"] = shared_ids
        return 200 if ready else 503, body

    async def _health(self, send: Send, headers: dict[str, str]) -> None:
        """``/health`` on the API port: the full report for an admin key. Otherwise, with API
        keys on, only ``{"status"}`` (no engines, tenants, index states or plugin sections:
        docs/security.md); with auth off, the report without engine URLs, socket addresses or
        host names (middleware/framework/redact.py)."""
        status, body = self.health_report()
        auth = self.pipeline.authenticator
        if is_admin(auth, headers):
            await send_json(send, status, body)
        elif auth_required(auth):
            await send_json(send, status, {"status": body["status"]})
        else:
            await send_json(send, status, public_view(body))

    def _plugin_health(self) -> dict[str, object]:
        """``HealthSource`` plugins' sections by plugin name (empty ones left out)."""
        out: dict[str, object] = {}
        for name, plugin in self.pipeline.plugins.items():
            if not isinstance(plugin, HealthSource):
                continue
            try:
                section = plugin.health()
            except Exception:  # one plugin's bug must not take /health down
                log.exception("plugin %r: health() failed", name)
                out[name] = {"error": "health() failed; see the gateway log"}
                continue
            if section:
                out[name] = dict(section)
        return out

    def _models(self, path: str, headers: dict[str, str]) -> Mapping[str, object]:
        """``GET /v1/models[/{id}]``: from the catalog plugin if configured, else the models
        the engines serve; with an authenticator, authenticated (401) and filtered by the
        key's allow-list, like OpenAI's own endpoint."""
        model_id = path[len(_MODELS_PREFIX):] if path.startswith(_MODELS_PREFIX) else None
        auth = self.pipeline.authenticator
        principal = None if auth is None else authenticate(auth, headers)
        catalog = self.pipeline.catalog
        if catalog is not None:
            if model_id is None:
                return {"object": "list", "data": list(catalog.list_models(principal))}
            return catalog.get_model(model_id, principal)
        allow = allowed_models(principal)
        visible = sorted(m for m in self.pool.models() if allow is None or m in allow)
        data = [{"id": m, "object": "model", "created": self.started_at, "owned_by": "kvgate"}
                for m in visible]
        if model_id is None:
            return {"object": "list", "data": data}
        for card in data:
            if card["id"] == model_id:
                return card
        raise model_not_found(model_id, visible)


def _routing_state(config: GatewayConfig, plugins: Mapping[str, object]
                   ) -> RoutingStateFile | None:
    """The routing-state file of this fleet (``server.routing_state_dir``), or None."""
    directory = config.server.routing_state_dir
    if directory is None:
        return None
    engines = [(e.name, e.url) for e in config.engines]
    return RoutingStateFile(Path(directory), engines, plugins, config.server.routing_state_save_s)


def _covers(prefix: str, path: str) -> bool:
    """Whether requests for ``path`` (or its by-id subtree) could fall under ``prefix``."""
    return (path == prefix or path.startswith(prefix + "/")
            or prefix.startswith(path.rstrip("/") + "/"))


def check_mounts(source: str, mounts: tuple[tuple[str, AsgiApp], ...],
                 taken: frozenset[str]) -> tuple[tuple[str, AsgiApp], ...]:
    """The ASGI mounts, refused (ConfigError) when a prefix is malformed or overlaps a core,
    API or plugin path (``/v1/models`` covers its by-id subtree) or another mount."""
    seen: list[str] = []
    for prefix, _ in mounts:
        if not prefix.startswith("/") or prefix.endswith("/") or "{" in prefix:
            raise ConfigError(f"{source}: mount prefix {prefix!r} must start with '/' and "
                              "not end with one")
        clash = sorted(p for p in (*taken, *seen) if _covers(prefix, p) or _covers(p, prefix))
        if clash:
            raise ConfigError(f"{source}: mount {prefix!r} overlaps {', '.join(clash)}")
        seen.append(prefix)
    return mounts


def _require(method: str, expected: str) -> None:
    if method != expected:
        raise MethodNotAllowed(f"use {expected} here, not {method}")


def create_app(config: GatewayConfig, registry: Registry | None = None) -> KvgateApp:
    """Build the gateway app; raises ConfigError if the config cannot work."""
    return KvgateApp(config, registry if registry is not None else Registry.from_entry_points())
