"""The request pipeline: parse -> request hooks -> producers -> schedule -> dispatch -> relay
-> usage / completion hooks. Retries once elsewhere when an engine fails before the first byte.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Coroutine, MutableMapping, Sequence
from typing import Any, TypeVar

import aiohttp

from middleware.asgi import (
    JSON_CT,
    ClientGone,
    Headers,
    Receive,
    Send,
    disconnect_watcher,
    header_map,
    read_body,
    send_bytes,
    send_error,
)
from middleware.config import GatewayConfig
from middleware.disagg import TwoHop, UsageRewriter
from middleware.errors import (
    HTTPError,
    NoEndpointAvailable,
    UpstreamError,
    UpstreamHTTPError,
    internal_error,
    model_not_found,
)
from middleware.metrics import GatewayMetrics
from middleware.pipeline import Pipeline
from middleware.plan import MODEL_PLAN, PlanRunner
from middleware.pool import EndpointPool
from middleware.requests import client_request_id, new_request_id, parse_request
from middleware.sse import SSETap
from middleware.types import (
    RESPONSE_HEADERS,
    Api,
    CycleState,
    Endpoint,
    InferenceRequest,
    Outcome,
    OutcomeKind,
    RoutingDecision,
)
from middleware.upstream import (
    Progress,
    first_chunk,
    open_request,
    read_json_response,
    relay_stream,
)

log = logging.getLogger("kvgate.gateway")
T = TypeVar("T")

_SSE_HEADERS: Headers = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class Gateway:
    """Owns the per-request logic; the app routes inference requests to :meth:`handle`."""

    def __init__(
        self, config: GatewayConfig, pipeline: Pipeline, pool: EndpointPool,
        metrics: GatewayMetrics,
    ) -> None:
        self.config = config
        self.pipeline = pipeline
        self.pool = pool
        self.metrics = metrics
        self.session: aiohttp.ClientSession | None = None
        server = config.server
        self._timeout = aiohttp.ClientTimeout(
            total=server.request_timeout_s, connect=server.connect_timeout_s
        )
        catalog = pipeline.catalog
        #: Public catalog names: metric labels for models no engine lists (provider models).
        self._catalog_models = frozenset(
            str(card["id"]) for card in (catalog.list_models(None) if catalog else ()))
        dc = config.disaggregation
        self.two_hop: TwoHop | None = None
        if pipeline.connector is not None and dc is not None:
            self.two_hop = TwoHop(pipeline.connector, pool, self._timeout, dc.settle_timeout_s,
                                  server.seed, self._count_pd)

    async def handle(self, scope: dict[str, Any], receive: Receive, send: Send, api: Api) -> None:
        started = time.monotonic()
        send = _Tracked(send)
        headers = header_map(scope)
        extra: Headers = []
        status = 500
        req: InferenceRequest | None = None
        try:
            rid, client_rid = new_request_id(), client_request_id(headers)
            extra.append((b"x-request-id", (client_rid or rid).encode()))
            auth = self.pipeline.authenticator
            principal = None if auth is None else auth.authenticate(headers.get("authorization"))
            body = await read_body(receive, headers, self.config.server.max_body_bytes)
            req = parse_request(api, body, headers, rid, client_rid)
            if principal is not None:
                req.principal = principal
                req.tenant, req.key_id = principal.tenant, principal.key_id
            status = await self._serve(req, receive, send, extra)
        except ClientGone:
            status = 499
        except HTTPError as err:
            status = err.status
            await self._send_error(send, err, extra)
        except Exception:
            log.exception("unexpected error (request %s)", _rid(extra))
            await self._send_error(send, internal_error(_rid(extra)), extra)
        self.metrics.requests.labels(api.value, self._model_label(req), str(status)).inc()
        self.metrics.latency.labels(api.value).observe(time.monotonic() - started)

    def _model_label(self, req: InferenceRequest | None) -> str:
        """The request's model as a bounded metric label: a model an engine serves or a catalog
        name (request hooks have resolved aliases to it by now), else ``other``."""
        if req is not None and (req.model in self.pool.models()
                                or req.model in self._catalog_models):
            return req.model
        return "other"

    async def _send_error(self, send: Send, err: HTTPError, extra: Headers) -> None:
        if isinstance(send, _Tracked) and send.started:
            log.error("error after the response started (%s): %s", _rid(extra), err.message)
            return
        if isinstance(err, UpstreamHTTPError):
            headers = [(b"content-type", err.content_type.encode()), *extra]
            await send_bytes(send, err.status, err.raw_body, headers)
        else:
            await send_error(send, err, extra)

    async def _serve(
        self, req: InferenceRequest, receive: Receive, send: Send, extra: Headers
    ) -> int:
        state = CycleState()
        for hook in self.pipeline.request_hooks:
            await hook.on_request(req, state)
        plan = state.get(MODEL_PLAN)  # set by a model catalog: pools, providers, fallbacks
        if plan is not None:
            return await PlanRunner(self, _race).run(plan, req, state, receive, send, extra)
        return await self.serve_engines(req, state, receive, send, extra, self.pool.snapshot())

    async def serve_engines(
        self, req: InferenceRequest, state: CycleState, receive: Receive, send: Send,
        extra: Headers, eps: Sequence[Endpoint], profile: str | None = None,
    ) -> int:
        """Schedule over ``eps`` (with one named profile, or the configured profiles) and
        dispatch, retrying elsewhere on failures before the first byte."""
        self._check_model(req, eps)
        for producer in self.pipeline.producers:
            await producer.prepare(req, state, eps)
        excluded: set[str] = set()
        attempts = 1 + self.config.server.retries
        for attempt in range(attempts):
            decision = self._schedule(req, state, eps, excluded, profile)
            last = attempt == attempts - 1
            try:
                return await self._dispatch(req, state, decision, receive, send, extra, last)
            except UpstreamError as err:
                if last or not err.retryable:
                    raise
                excluded.add(decision.target.id)
                self.metrics.retries.labels(decision.target.id).inc()
                log.warning("request %s: retrying after %s", req.request_id, err.message)
        raise AssertionError("unreachable")  # pragma: no cover

    def _check_model(self, req: InferenceRequest, eps: Sequence[Endpoint]) -> None:
        if req.model in self.pool.models():
            return
        if not any(ep.healthy for ep in eps):
            raise NoEndpointAvailable("no healthy engine is available")
        if any(ep.healthy and not ep.models for ep in eps):
            return  # an engine's models are not discovered yet: let the filters decide
        raise model_not_found(req.model, self.pool.models())

    def _schedule(
        self, req: InferenceRequest, state: CycleState, eps: Sequence[Endpoint], excluded: set[str],
        profile: str | None = None,
    ) -> RoutingDecision:
        candidates = [ep for ep in eps if ep.id not in excluded] if excluded else eps
        if not candidates:
            raise NoEndpointAvailable("no other engine left to retry on")
        if profile is not None:
            return self.pipeline.scheduler.schedule_profile(profile, req, state, candidates)
        return self.pipeline.scheduler.schedule(req, state, candidates)

    async def _dispatch(
        self, req: InferenceRequest, state: CycleState, decision: RoutingDecision,
        receive: Receive, send: Send, extra: Headers, last: bool,
    ) -> int:
        for hook in self.pipeline.dispatch_hooks:
            await hook.before_dispatch(req, state, decision)
        target = decision.target
        lease = self.pool.acquire(target.id, req.prompt_token_estimate)
        progress = Progress(headers=[*extra, (b"x-kvgate-engine", target.id.encode())])
        kind, error = OutcomeKind.DONE, None
        will_retry = False
        try:
            await _race(self._route(req, state, decision, send, progress), receive)
            if progress.broken is not None:
                kind, error = OutcomeKind.UPSTREAM_ERROR, progress.broken
                self.metrics.upstream_errors.labels(target.id, "mid_stream").inc()
            return progress.status
        except ClientGone:
            kind, error = OutcomeKind.CLIENT_DISCONNECT, "client disconnected"
            raise
        except (UpstreamError, UpstreamHTTPError) as err:
            kind, error = OutcomeKind.UPSTREAM_ERROR, err.message
            progress.status = err.status
            will_retry = isinstance(err, UpstreamError) and err.retryable and not last
            self.metrics.upstream_errors.labels(target.id, "before_first_byte").inc()
            raise
        finally:
            lease.release()
            await self._complete(req, state, target, progress, kind, error, will_retry)

    async def _route(
        self, req: InferenceRequest, state: CycleState, decision: RoutingDecision, send: Send,
        progress: Progress,
    ) -> None:
        """One hop to the target, or two (prefill, then/with decode) when the decision names a
        prefill engine and a connector is configured (middleware/disagg.py)."""
        target = decision.target
        prefill = decision.prefill
        if self.two_hop is None or prefill is None or prefill.id == target.id:
            await self._forward(req, state, target, send, progress)
            return
        assert self.session is not None

        async def forward(
            body: dict[str, Any] | None, rewriter: UsageRewriter | None, prog: Progress
        ) -> None:
            await self._forward(req, state, target, send, prog, body, rewriter)

        async def done(ok: bool) -> None:
            assert prefill is not None
            for hook in self.pipeline.prefill_hooks:
                await hook.on_prefill_done(req, state, prefill, ok)

        await self.two_hop.run(self.session, req, decision, forward, progress, done)

    async def _forward(
        self, req: InferenceRequest, state: CycleState, target: Endpoint, send: Send,
        progress: Progress, body: dict[str, Any] | None = None,
        rewriter: UsageRewriter | None = None,
    ) -> None:
        """Send ``body`` (default: the adapter-shaped client body) to ``target``, relay the
        answer; ``rewriter`` edits the usage the client and the usage hooks see."""
        assert self.session is not None
        adapter = self.pool.adapter(target.id)
        if body is None:
            body = adapter.prepare_body(req, req.body)
            raw = req.raw_body if body is req.body and req.raw_body is not None else _dumps(body)
        else:
            raw = _dumps(body)
        headers = {"content-type": "application/json", "x-request-id": req.request_id,
                   **self.pool.headers(target.id)}
        url = target.url + req.api.path
        try:
            resp = await open_request(self.session, url, raw, headers, self._timeout)
        except UpstreamError as err:
            if err.unreachable:
                self.pool.report_failure(target.id, err.message)
            raise
        if not req.stream:
            payload = await read_json_response(resp, adapter, progress)
            if rewriter is not None:
                payload = await rewriter.rewrite_json(payload)
                progress.usage = adapter.extract_usage(json.loads(payload))
            await self._report_usage(req, state, target, progress)
            ct = resp.headers.get("content-type", "application/json").encode()
            out = [(b"content-type", ct), *progress.headers, *_plugin_headers(state)]
            await send_bytes(send, progress.status, payload, out)
            return
        try:
            chunk = await first_chunk(resp)
        except asyncio.CancelledError:  # client gone, or a concurrent prefill fell back
            resp.close()
            raise
        if rewriter is not None:  # decode answers after the prefill: its hit is (nearly) due
            await rewriter.settle()
        tap = SSETap(adapter.extract_usage, strip_usage=not req.client_wants_usage,
                     rewrite=None if rewriter is None else rewriter.rewrite_chunk)
        progress.headers[:0] = _SSE_HEADERS
        progress.headers.extend(_plugin_headers(state))
        await relay_stream(resp, chunk, send, tap, progress,
                           lambda: self._report_usage(req, state, target, progress))

    async def _report_usage(
        self, req: InferenceRequest, state: CycleState, target: Endpoint, progress: Progress
    ) -> None:
        """Usage hooks, once per dispatch, as soon as the usage is known: before a JSON answer
        is sent, before a stream's usage event (and ``[DONE]``) is relayed."""
        usage = progress.usage
        if usage is None or progress.usage_reported:
            return
        progress.usage_reported = True
        self._count_tokens(req.model, usage.prompt_tokens, usage.completion_tokens,
                           usage.cached_tokens)
        for uhook in self.pipeline.usage_hooks:
            await uhook.on_usage(req, state, target, usage)

    async def _complete(
        self, req: InferenceRequest, state: CycleState, target: Endpoint, progress: Progress,
        kind: OutcomeKind, error: str | None, will_retry: bool,
    ) -> None:
        now = time.monotonic()
        ttft = None if progress.first_byte_at is None else progress.first_byte_at - req.received_at
        if ttft is not None:
            self.metrics.ttft.labels(req.api.value, str(req.stream).lower()).observe(ttft)
        errors: list[Exception] = []
        try:
            await self._report_usage(req, state, target, progress)
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the completion hooks
            errors.append(exc)
        outcome = Outcome(
            kind=kind, status=progress.status, usage=progress.usage, ttft_s=ttft,
            total_s=now - req.received_at, error=error, will_retry=will_retry,
            chunks_relayed=progress.events,
        )
        await self._completion_hooks(req, state, target, outcome, errors)
        if errors:
            raise errors[0]

    async def _completion_hooks(
        self, req: InferenceRequest, state: CycleState, target: Endpoint, outcome: Outcome,
        errors: list[Exception],
    ) -> None:
        """Every completion hook runs, even when another raised: hooks release what the request
        held (token load, admission slots), and one failing must not leak the others'."""
        for chook in self.pipeline.completion_hooks:
            try:
                await chook.on_complete(req, state, target, outcome)
            except Exception as exc:  # the first is re-raised by the caller
                if errors:
                    log.exception("request %s: completion hook failed too", req.request_id)
                errors.append(exc)

    def _count_pd(self, result: str) -> None:
        self.metrics.pd_requests.labels(result).inc()

    def _count_tokens(self, model: str, prompt: int, completion: int, cached: int | None) -> None:
        tokens = self.metrics.tokens
        tokens.labels(model, "prompt").inc(prompt)
        tokens.labels(model, "completion").inc(completion)
        if cached is not None:
            tokens.labels(model, "cached").inc(cached)


class _Tracked:
    """Wraps ``send`` to know whether the response has started (then no error body can follow)."""

    __slots__ = ("_send", "started")

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False

    async def __call__(self, message: MutableMapping[str, Any]) -> None:
        self.started = True
        await self._send(message)


async def _race(work: Coroutine[Any, Any, T], receive: Receive) -> T:
    """Run ``work`` unless the client disconnects first (then cancel it: ClientGone)."""
    task = asyncio.ensure_future(work)
    watcher = disconnect_watcher(receive)
    try:
        done, _ = await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientGone()
    finally:
        watcher.cancel()


def _plugin_headers(state: CycleState) -> Headers:
    headers = state.get(RESPONSE_HEADERS)
    if not headers:
        return []
    return [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]


def _dumps(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def _rid(extra: Headers) -> str:
    for name, value in extra:
        if name == b"x-request-id":
            return value.decode()
    return "-"


__all__ = ["JSON_CT", "Gateway"]
