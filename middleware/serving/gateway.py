"""The entry of every API request: request id, auth, the body parsed once, request hooks, then
the model plan or the pool through the dispatcher (middleware/serving/dispatch.py). Errors become
responses here only, in the request's API shape (its adapter's ``error_body``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Sequence

import aiohttp

from kvgate.middleware.fleet.pool import EndpointPool
from kvgate.middleware.framework.api import ApiAdapter, is_by_id, match_route
from kvgate.middleware.framework.composition.config import GatewayConfig
from kvgate.middleware.framework.composition.pipeline import Pipeline
from kvgate.middleware.framework.errors import (
    ConfigError,
    HTTPError,
    NoEndpointAvailable,
    NotFound,
    UpstreamError,
    internal_error,
)
from kvgate.middleware.framework.loopback import loopback_context
from kvgate.middleware.framework.plugin import authenticate
from kvgate.middleware.framework.types import (
    Endpoint,
    InferenceRequest,
    Principal,
    Receive,
    Scope,
    Send,
)
from kvgate.middleware.observe.access_log import AccessLog
from kvgate.middleware.observe.metrics import GatewayMetrics
from kvgate.middleware.observe.tracing import Tracing
from kvgate.middleware.serving.context import RequestContext, TrackedSend
from kvgate.middleware.serving.disagg import TwoHop
from kvgate.middleware.serving.dispatch import Dispatcher, race
from kvgate.middleware.serving.plan import MODEL_PLAN, PlanRunner
from kvgate.middleware.serving.requests import (
    RequestIds,
    build_request,
    client_request_id,
    load_body,
)
from kvgate.middleware.serving.states import StateMap
from kvgate.middleware.serving.upstream import end_exchange
from kvgate.middleware.transport.asgi import (
    ClientGone,
    disconnect_source,
    header_map,
    read_body,
    send_bytes,
)
from kvgate.middleware.transport.engine_call import EngineResponse
from kvgate.middleware.transport.error_response import send_error

log = logging.getLogger("kvgate.gateway")


class ApiRoutes:
    """``(method, path)`` -> adapter for every adapter's routes; by-id routes matched by
    pattern. Two claims on one route are refused (ConfigError)."""

    def __init__(self, adapters: Iterable[ApiAdapter], taken: Iterable[str] = ()) -> None:
        self.exact: dict[tuple[str, str], ApiAdapter] = {}
        self.by_id: list[tuple[str, str, ApiAdapter]] = []
        reserved = frozenset(taken)
        for adapter in adapters:
            for method, path in adapter.routes:
                key = (method.upper(), path)
                if key in self.exact or path in reserved or any(
                        (m, p) == key for m, p, _ in self.by_id):
                    raise ConfigError(f"API {adapter.name!r}: route {key[0]} {path} is "
                                      "already taken")
                if is_by_id(path):
                    self.by_id.append((*key, adapter))
                else:
                    self.exact[key] = adapter

    def paths(self) -> frozenset[str]:
        return frozenset(p for _, p in self.exact) | frozenset(p for _, p, _ in self.by_id)

    def match(self, method: str, path: str) -> tuple[ApiAdapter, str | None] | None:
        """The adapter serving ``method path`` and the id of a by-id route (else None)."""
        adapter = self.exact.get((method, path))
        if adapter is not None:
            return adapter, None
        for m, pattern, owner in self.by_id:
            if m == method and (found := match_route(pattern, path)) is not None:
                return owner, found
        return None

    def allows_path(self, path: str) -> bool:
        """Whether some method is served on ``path`` (then another method is a 405)."""
        return any(p == path for _, p in self.exact) or any(
            match_route(p, path) is not None for _, p, _ in self.by_id)


class Gateway:
    """Serves API requests: the app routes each adapter's routes to :meth:`handle`."""

    def __init__(
        self, config: GatewayConfig, pipeline: Pipeline, pool: EndpointPool,
        metrics: GatewayMetrics, states: StateMap | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.config = config
        self.pipeline = pipeline
        self.pool = pool
        self.metrics = metrics
        self.states = states if states is not None else StateMap()
        self.tracing = tracing if tracing is not None else Tracing.off()
        self.dispatcher = Dispatcher(config, pipeline, pool, metrics, self.states, self.tracing)
        self.plans = PlanRunner(self.dispatcher)
        self.access_log = AccessLog(config.server.access_log)
        self.request_ids = RequestIds()
        catalog = pipeline.catalog
        #: Public catalog names: metric labels for models no engine lists (provider models).
        self._catalog_models = frozenset(
            str(card["id"]) for card in (catalog.list_models(None) if catalog else ()))

    @property
    def two_hop(self) -> TwoHop | None:
        return self.dispatcher.two_hop

    @property
    def session(self) -> aiohttp.ClientSession | None:
        return self.dispatcher.session

    @session.setter
    def session(self, session: aiohttp.ClientSession | None) -> None:
        self.dispatcher.session = session

    async def handle(self, scope: Scope, receive: Receive, send: Send,
                     adapter: ApiAdapter, state_id: str | None = None) -> None:
        """One request to ``adapter``'s route (``state_id``: a by-id route's id). A loopback
        call (middleware/framework/loopback.py) brings its principal, request id and tier."""
        loop = loopback_context(scope)
        self.metrics.hooks.tick()
        ctx = RequestContext(
            adapter=adapter, send=TrackedSend(send), receive=receive,
            headers=header_map(scope), path=scope["path"], query=scope.get("query_string", b""),
            request_id=(loop.request_id if loop and loop.request_id else self.request_ids()),
            response_headers=[], loopback=loop, disconnect=disconnect_source(scope))
        trace = self.tracing.start_request(ctx.headers, adapter.name)
        try:
            client_rid = ctx.client_request_id = client_request_id(ctx.headers)
            ctx.response_headers.append((b"x-request-id", (client_rid or ctx.request_id).encode()))
            if state_id is not None:
                ctx.status = await self._by_id(ctx, scope["method"], state_id)
            else:
                ctx.status = await self._serve(ctx, client_rid)
        except ClientGone:
            ctx.status = 499
        except HTTPError as err:
            ctx.status, ctx.error_code = err.status, err.code or err.type
            await self.send_error(ctx, err)
        except Exception:
            log.exception("unexpected error (request %s)", ctx.request_id)
            ctx.error_code = "internal_error"
            await self.send_error(ctx, internal_error(ctx.request_id))
        except asyncio.CancelledError:  # the server stops, or an in-process caller cancels
            ctx.status = 499
            raise
        finally:
            if ctx.req is not None:
                await self._request_end(ctx.req, ctx)
            self.access_log.write(ctx, scope["method"])
            if trace is not None:
                self.tracing.end_request(trace, _span_attributes(ctx))
        metrics = self.metrics
        metrics.requests.inc((adapter.name, self._model_label(ctx), str(ctx.status)))
        metrics.latency.observe((adapter.name,), time.monotonic() - ctx.received_at)

    async def _request_end(self, req: InferenceRequest, ctx: RequestContext) -> None:
        """Every request-end hook runs, even when another raised (each releases its own)."""
        timer = self.metrics.hooks
        for hook in self.pipeline.request_end_hooks:
            try:
                t = time.perf_counter() if timer.on else 0.0
                await hook.on_request_end(req, ctx.state, ctx.status)
                if t:
                    timer.observe(hook, "on_request_end", t)
            except Exception:
                log.exception("request %s: request-end hook failed", req.request_id)

    async def send_error(self, ctx: RequestContext, err: HTTPError) -> None:
        """An API request's error as a response in its adapter's shape
        (middleware/transport/error_response.py); an engine's 4xx too (:class:`UpstreamHTTPError`:
        its
        status and cleaned message, never its bytes: docs/security.md, "Client faults and the
        breaker")."""
        if ctx.started:
            log.error("error after the response started (%s): %s", ctx.request_id, err.message)
            return
        await send_error(ctx.send, err, ctx.adapter, ctx.response_headers)

    def _model_label(self, ctx: RequestContext) -> str:
        """The request's model as a bounded metric label: a model an engine serves or a catalog
        name (request hooks have resolved aliases to it by now), else ``other``."""
        req = ctx.req
        if req is not None and (req.model in self.pool.models()
                                or req.model in self._catalog_models):
            return req.model
        return "other"

    def _principal(self, ctx: RequestContext) -> Principal | None:
        """The loopback call's principal, else the authenticator's verdict (401)."""
        if ctx.loopback is not None:
            return ctx.loopback.principal
        auth = self.pipeline.authenticator
        return None if auth is None else authenticate(auth, ctx.headers)

    async def _serve(self, ctx: RequestContext, client_rid: str | None) -> int:
        with self.tracing.span("kvgate.auth"):
            principal = ctx.principal = self._principal(ctx)
        body = await read_body(ctx.receive, ctx.headers, self.config.server.max_body_bytes)
        data = load_body(body)
        ctx.parsed = ctx.adapter.parse(data, ctx.headers)
        req = ctx.req = build_request(ctx.adapter, ctx.parsed, data, body, ctx.headers,
                                      ctx.request_id, client_rid)
        if principal is not None:
            req.principal = principal
            req.tenant, req.key_id = principal.tenant, principal.key_id
        if ctx.loopback is not None:
            req.service_tier = ctx.loopback.tier
        timer = self.metrics.hooks
        for hook in self.pipeline.request_hooks:
            t = time.perf_counter() if timer.on else 0.0
            await hook.on_request(req, ctx.state)
            if t:
                timer.observe(hook, "on_request", t)
        state_id = ctx.parsed.requires_state
        if state_id is not None and req.tenant is not None and self.pipeline.deferrals:
            await self.states.fetch(state_id, req.tenant)  # refused before it is queued
            self.states.owned(state_id, req.tenant, "previous_response_id")
        for deferral in self.pipeline.deferrals:
            deferred = await deferral.defer(req, ctx.adapter.name, ctx.path)
            if deferred is not None:
                headers = [(b"content-type", deferred.content_type.encode()),
                           *ctx.response_headers,
                           *((k.encode(), v.encode()) for k, v in deferred.headers.items())]
                await send_bytes(ctx.send, deferred.status, deferred.body, headers)
                return deferred.status
        plan = ctx.state.get(MODEL_PLAN)  # set by a model catalog: pools, providers, fallbacks
        if plan is not None:
            return await self.plans.run(plan, ctx)
        return await self.dispatcher.serve_pool(ctx, self.pool.snapshot())

    async def _by_id(self, ctx: RequestContext, method: str, state_id: str) -> int:
        """A by-id route: answered by a StateResolver (an id it owns, e.g. a queued background
        response), else forwarded as is to the engine that holds ``state_id``."""
        principal = self._principal(ctx)
        body = await read_body(ctx.receive, ctx.headers, self.config.server.max_body_bytes)
        for resolver in self.pipeline.resolvers:
            answer = await resolver.resolve(ctx.adapter.name, method, state_id, principal)
            if answer is not None:
                headers = [(b"content-type", answer.content_type.encode()),
                           *ctx.response_headers,
                           *((k.encode(), v.encode()) for k, v in answer.headers.items())]
                await send_bytes(ctx.send, answer.status, answer.body, headers)
                return answer.status
        tenant = None if principal is None else principal.tenant
        await self.states.fetch(state_id, tenant)
        holder = self.states.holder(state_id, tenant)
        if holder is None:
            self.states.count("miss")
            raise NotFound(f"no {ctx.adapter.name} object with id {state_id!r}", param="id")
        ep = _healthy(self.pool.snapshot(), holder.engine)
        if ep is None:
            self.states.count("unhealthy")
            raise NoEndpointAvailable(f"the engine holding {state_id!r} is out of rotation")
        self.states.count("hit")
        return await race(self._forward_by_id(ctx, method, body, ep), ctx.receive,
                          ctx.disconnect)

    async def _forward_by_id(self, ctx: RequestContext, method: str, body: bytes,
                             ep: Endpoint) -> int:
        """Method, path, query and body to the engine through the engine call
        (middleware/transport/engine_call.py), its answer relayed as is. Not a dispatch: there is no
        parsed request for the completion hooks (they take an ``InferenceRequest``), and no
        hook took anything for it (no ``before_dispatch``, no lease) that they would release."""
        query = ctx.query.decode("latin-1")
        path = ctx.adapter.upstream_path(ctx.path) + (f"?{query}" if query else "")
        content_type = ctx.headers.get("content-type", "application/json") if body else None
        resp = await self.dispatcher.engine.open(ep, path, body or None, ctx.request_id,
                                                 ctx.headers, method=method,
                                                 content_type=content_type)
        return await _relay_raw(ctx, resp, ep.id)


def _span_attributes(ctx: RequestContext) -> dict[str, object]:
    """The request span's closing attributes (None values are left out)."""
    req = ctx.req
    return {"kvgate.request_id": ctx.request_id, "http.response.status_code": ctx.status,
            "gen_ai.request.model": None if req is None else req.model,
            "kvgate.tenant": None if req is None else req.tenant}


def _healthy(eps: Sequence[Endpoint], engine: str) -> Endpoint | None:
    return next((ep for ep in eps if ep.id == engine and ep.healthy), None)


async def _relay_raw(ctx: RequestContext, resp: EngineResponse, engine: str) -> int:
    """The engine's answer as is (status, content type, bytes as they arrive)."""
    ct = resp.headers.get("content-type", "application/json").encode()
    headers = [(b"content-type", ct), *ctx.response_headers,
               (b"x-kvgate-engine", engine.encode())]
    await ctx.send({"type": "http.response.start", "status": resp.status, "headers": headers})
    ended = False
    try:
        while chunk := await resp.receive():
            await ctx.send({"type": "http.response.body", "body": chunk, "more_body": True})
        ended = True
    except (UpstreamError, TimeoutError) as exc:
        log.warning("request %s: engine broke off: %s", ctx.request_id, exc)
    finally:
        end_exchange(resp, ended)
    await ctx.send({"type": "http.response.body", "body": b"", "more_body": False})
    return resp.status


__all__ = ["ApiRoutes", "Gateway"]
