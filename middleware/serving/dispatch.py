"""The dispatcher: scheduling, engine hops and the bookkeeping of every dispatch.

:meth:`Dispatcher.run` is the one place a dispatch's outcome is accounted: usage hooks once
(as soon as the usage is final, at the latest when the dispatch ends), completion hooks once per
dispatch on every outcome, the state ids the answer created, the metrics. Engine hops
(:meth:`serve_pool`) and in-process backend steps (middleware/serving/plan.py) both go through it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from functools import partial
from typing import Any, TypeVar

import aiohttp
import orjson

from kvgate.middleware.fleet.pool import EndpointPool
from kvgate.middleware.framework.composition.config import GatewayConfig
from kvgate.middleware.framework.composition.pipeline import Pipeline
from kvgate.middleware.framework.errors import (
    HTTPError,
    NoEndpointAvailable,
    Unreachable,
    UpstreamError,
    UpstreamHTTPError,
    model_not_found,
)
from kvgate.middleware.framework.types import (
    Endpoint,
    InferenceRequest,
    Outcome,
    OutcomeKind,
    Receive,
    RoutingDecision,
    Usage,
)
from kvgate.middleware.observe.metrics import GatewayMetrics
from kvgate.middleware.observe.tracing import Tracing, hop_done, routed
from kvgate.middleware.serving.context import Attempt, RequestContext
from kvgate.middleware.serving.disagg import TwoHop, UsageRewriter
from kvgate.middleware.serving.sse import Adjust, EventRelay
from kvgate.middleware.serving.states import StateMap
from kvgate.middleware.serving.upstream import (
    first_chunk,
    parse_answer,
    read_answer,
    relay_stream,
)
from kvgate.middleware.transport.asgi import (
    SSE_HEADERS,
    ClientGone,
    DisconnectSource,
    ReceiveWatch,
    send_bytes,
)
from kvgate.middleware.transport.engine_call import EngineCall, EngineResponse, Timeouts

log = logging.getLogger("kvgate.dispatch")
T = TypeVar("T")
#: One dispatch's work: given its attempt, send the request and relay the answer.
Work = Callable[[Attempt], Coroutine[Any, Any, None]]


class Dispatcher:
    """Owns dispatch and its outcome bookkeeping; stateless between requests but for
    ``states`` (bounded) and the metrics."""

    def __init__(
        self, config: GatewayConfig, pipeline: Pipeline, pool: EndpointPool,
        metrics: GatewayMetrics, states: StateMap, tracing: Tracing | None = None,
    ) -> None:
        self.config = config
        self.pipeline = pipeline
        self.pool = pool
        self.metrics = metrics
        self.states = states
        self.tracing = tracing if tracing is not None else Tracing.off()
        pipeline.scheduler.keep_scores = self.tracing.enabled
        #: The app's HTTP session: a connector's own I/O (``Connector.prepare``).
        self.session: aiohttp.ClientSession | None = None
        server = config.server
        #: Every engine request goes through it (middleware/transport/engine_call.py); its
        #: transports
        #: are bound at startup (middleware/app.py).
        self.engine = EngineCall(pool, self.tracing, Timeouts(
            total=server.request_timeout_s, connect=server.connect_timeout_s))
        dc = config.disaggregation
        self.two_hop: TwoHop | None = None
        if pipeline.connector is not None and dc is not None:
            self.two_hop = TwoHop(pipeline.connector, pool, self.engine, dc.settle_timeout_s,
                                  server.seed, self._count_pd, self.tracing)

    # -- bookkeeping ------------------------------------------------------------------------
    async def run(
        self, ctx: RequestContext, target: Endpoint, work: Work, *, last: bool = True,
        release: Callable[[], None] | None = None,
    ) -> int:
        """One dispatch to ``target``: ``work`` raced against the client's disconnect, then
        its outcome accounted (``release`` first, e.g. the engine lease). Returns the status;
        re-raises what ``work`` raised (``HTTPError``: rendered by the gateway)."""
        attempt = Attempt(target, [*ctx.response_headers, (b"x-kvgate-engine", target.id.encode())])
        kind, will_retry = OutcomeKind.UPSTREAM_ERROR, False
        ctx.engines.append(target.id)
        started = time.monotonic()
        error: str | None = "dispatch failed"
        try:
            await race(work(attempt), ctx.receive, ctx.disconnect)
            kind, error = OutcomeKind.DONE, None
            if attempt.broken is not None:
                kind, error = OutcomeKind.UPSTREAM_ERROR, attempt.broken
                self.metrics.upstream_errors.labels(target.id, "mid_stream").inc()
            return attempt.status
        except ClientGone:
            kind, error = OutcomeKind.CLIENT_DISCONNECT, "client disconnected"
            raise
        except HTTPError as err:
            error, attempt.status = err.message, err.status
            will_retry = isinstance(err, UpstreamError) and err.retryable and not last
            self.metrics.upstream_errors.labels(target.id, "before_first_byte").inc()
            raise
        finally:
            if release is not None:
                release()
            _note(ctx, attempt, started)
            await self._complete(ctx, attempt, kind, error, will_retry)

    async def report_usage(self, ctx: RequestContext, attempt: Attempt) -> None:
        """Usage hooks, once per dispatch, as soon as the usage is known: before a JSON answer
        is sent, before a stream's usage event (and its end) is relayed."""
        usage = attempt.usage
        if usage is None or attempt.usage_reported:
            return
        attempt.usage_reported = True
        req = ctx.request
        tokens = self.metrics.tokens
        tokens.inc((req.model, "prompt"), usage.prompt_tokens)
        tokens.inc((req.model, "completion"), usage.completion_tokens)
        if usage.cached_tokens is not None:
            tokens.inc((req.model, "cached"), usage.cached_tokens)
        if not self.pipeline.usage_hooks:
            return
        timer = self.metrics.hooks
        with self.tracing.span("kvgate.usage"):  # billing's ledger write, quotas
            for hook in self.pipeline.usage_hooks:
                t = time.perf_counter() if timer.on else 0.0
                await hook.on_usage(req, ctx.state, attempt.target, usage)
                if t:
                    timer.observe(hook, "on_usage", t)

    async def _complete(self, ctx: RequestContext, attempt: Attempt, kind: OutcomeKind,
                        error: str | None, will_retry: bool) -> None:
        req = ctx.request
        now = time.monotonic()
        ttft = None if attempt.first_byte_at is None else attempt.first_byte_at - req.received_at
        if ttft is not None:
            self.metrics.ttft.observe((ctx.adapter.name, "true" if req.stream else "false"),
                                      ttft)
        if kind is OutcomeKind.DONE and attempt.tap is not None:  # first: the next turn may
            # already be on its way to another replica, which looks the id up in Redis
            await self.states.record(attempt.tap.state_ids, attempt.target.id, req.tenant)
        errors: list[Exception] = []
        try:
            await self.report_usage(ctx, attempt)
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the completion hooks
            errors.append(exc)
        outcome = Outcome(
            kind=kind, status=attempt.status, usage=attempt.usage, ttft_s=ttft,
            total_s=now - req.received_at, error=error, will_retry=will_retry,
            chunks_relayed=attempt.events,
        )
        await self._completion_hooks(req, ctx, attempt.target, outcome, errors)
        if errors:
            raise errors[0]

    async def _completion_hooks(self, req: InferenceRequest, ctx: RequestContext,
                                target: Endpoint, outcome: Outcome,
                                errors: list[Exception]) -> None:
        """Every completion hook runs, even when another raised: hooks release what the request
        held (token load, admission slots), and one failing must not leak the others'."""
        timer = self.metrics.hooks
        for hook in self.pipeline.completion_hooks:
            try:
                t = time.perf_counter() if timer.on else 0.0
                await hook.on_complete(req, ctx.state, target, outcome)
                if t:
                    timer.observe(hook, "on_complete", t)
            except Exception as exc:  # the first is re-raised by the caller
                if errors:
                    log.exception("request %s: completion hook failed too", req.request_id)
                errors.append(exc)

    def _count_pd(self, result: str) -> None:
        self.metrics.pd_requests.labels(result).inc()

    # -- engines ----------------------------------------------------------------------------
    def _now(self, eps: Sequence[Endpoint]) -> Sequence[Endpoint]:
        """The same engines as the pool sees them now (in-flight counts, health): after a wait
        in an admission gate the request is scheduled on the fleet as it is when it leaves the
        queue, not as it was when it arrived (whose counts would send every request that waited
        through the same burst to the engines that were free then)."""
        ids = {ep.id for ep in eps}
        return [ep for ep in self.pool.snapshot() if ep.id in ids]

    async def serve_pool(self, ctx: RequestContext, eps: Sequence[Endpoint],
                         profile: str | None = None) -> int:
        """Schedule over ``eps`` (with one named profile, or the configured profiles) and
        dispatch, retrying elsewhere on failures before the first byte."""
        req = ctx.request
        self._check_model(req, eps)
        for gate in self.pipeline.gates:  # flow control: wait for headroom (late binding)
            wait = gate.admit(req, ctx.state, eps)
            if wait is not None:
                await race(wait, ctx.receive, ctx.disconnect)
                eps = self._now(eps)
        timer = self.metrics.hooks
        for producer in self.pipeline.producers:
            t = time.perf_counter() if timer.on else 0.0
            await producer.prepare(req, ctx.state, eps)
            if t:
                timer.observe(producer, "prepare", t)
        if ctx.parsed is not None and ctx.parsed.requires_state is not None:  # Redis, if shared
            await self.states.fetch(ctx.parsed.requires_state, req.tenant)
        pinned = self._pinned(ctx, eps)
        excluded: set[str] = set()
        attempts = 1 + self.config.server.retries
        try:
            for attempt in range(attempts):
                with self.tracing.span("kvgate.route") as span:
                    decision = self._schedule(ctx, eps, excluded, profile, pinned)
                    routed(span, decision, ctx.state)
                pinned, last = None, attempt == attempts - 1
                try:
                    return await self._dispatch(ctx, decision, last)
                except UpstreamError as err:
                    if last or not err.retryable:
                        raise
                    excluded.add(decision.target.id)
                    self.metrics.retries.labels(decision.target.id).inc()
                    log.warning("request %s: retrying after %s", req.request_id, err.message)
            raise AssertionError("unreachable")  # pragma: no cover
        finally:
            self.pool.settle(ctx)  # an engine failure not judged by a retry counts now

    def _check_model(self, req: InferenceRequest, eps: Sequence[Endpoint]) -> None:
        if req.model in self.pool.models():
            return
        if not any(ep.healthy for ep in eps):
            raise NoEndpointAvailable("no healthy engine is available")
        if any(ep.healthy and not ep.models for ep in eps):
            return  # an engine's models are not discovered yet: let the filters decide
        raise model_not_found(req.model, self.pool.models())

    def _pinned(self, ctx: RequestContext, eps: Sequence[Endpoint]) -> Endpoint | None:
        """The engine holding the state this request requires, if known and healthy."""
        state_id = ctx.parsed.requires_state if ctx.parsed is not None else None
        if state_id is None:
            return None
        # another tenant's id (or, keys on, one of no known owner): 404, nothing dispatched
        holder = self.states.owned(state_id, ctx.request.tenant, "previous_response_id")
        if holder is None:
            return None
        for ep in eps:
            if ep.id == holder.engine and ep.healthy:
                self.states.count("hit")
                return ep
        self.states.count("unhealthy")
        log.warning("request %s: %s is held by %s, which is out of rotation; routing it "
                    "normally", ctx.request.request_id, state_id, holder.engine)
        return None

    def _schedule(self, ctx: RequestContext, eps: Sequence[Endpoint], excluded: set[str],
                  profile: str | None, pinned: Endpoint | None) -> RoutingDecision:
        req, state, scheduler = ctx.request, ctx.state, self.pipeline.scheduler
        if pinned is not None:
            try:
                if profile is not None:
                    return scheduler.schedule_profile(profile, req, state, [pinned])
                return scheduler.schedule(req, state, [pinned])
            except NoEndpointAvailable:
                log.warning("request %s: the filters refused %s, which holds its state",
                            req.request_id, pinned.id)
        candidates = [ep for ep in eps if ep.id not in excluded] if excluded else eps
        if not candidates:
            raise NoEndpointAvailable("no other engine left to retry on")
        if profile is not None:
            return scheduler.schedule_profile(profile, req, state, candidates)
        return scheduler.schedule(req, state, candidates)

    async def _dispatch(self, ctx: RequestContext, decision: RoutingDecision, last: bool) -> int:
        req = ctx.request
        ctx.profiles = tuple(decision.profiles)
        timer = self.metrics.hooks
        for hook in self.pipeline.dispatch_hooks:
            t = time.perf_counter() if timer.on else 0.0
            await hook.before_dispatch(req, ctx.state, decision)
            if t:
                timer.observe(hook, "before_dispatch", t)
        target = decision.target
        lease = self.pool.acquire(target.id, req.prompt_token_estimate)
        return await self.run(ctx, target, partial(self._route, ctx, decision), last=last,
                              release=lease.release)

    def _route(self, ctx: RequestContext, decision: RoutingDecision,
               attempt: Attempt) -> Coroutine[Any, Any, None]:
        """One hop to the target, or two (prefill, then/with decode) when the decision names a
        prefill engine, a connector is configured and the API allows it (middleware/disagg).
        Returns the hop's coroutine (no coroutine layer of its own on the one-hop path)."""
        prefill = decision.prefill
        if (self.two_hop is None or prefill is None or prefill.id == decision.target.id
                or not ctx.adapter.disaggregable):
            return self._forward(ctx, attempt)
        return self._two_hops(ctx, decision, prefill, attempt)

    async def _two_hops(self, ctx: RequestContext, decision: RoutingDecision, prefill: Endpoint,
                        attempt: Attempt) -> None:
        assert self.session is not None and self.two_hop is not None
        ctx.engines.append(f"prefill:{prefill.id}")

        async def forward(body: dict[str, Any] | None, rewriter: UsageRewriter | None,
                          att: Attempt) -> None:
            await self._forward(ctx, att, body, rewriter)

        async def done(ok: bool) -> None:
            for hook in self.pipeline.prefill_hooks:
                await hook.on_prefill_done(ctx.request, ctx.state, prefill, ok)

        await self.two_hop.run(self.session, ctx, decision, forward, attempt, done)

    def _body(self, ctx: RequestContext, body: dict[str, Any] | None) -> bytes:
        """The bytes sent: the client's unchanged when nothing changed them."""
        if body is not None:
            return orjson.dumps(body)
        req = ctx.request
        shaped = ctx.adapter.prepare_body(req.body, req.stream)
        if shaped is not None:
            return orjson.dumps(shaped)
        return req.raw_body if req.raw_body is not None else orjson.dumps(req.body)

    def _forward(self, ctx: RequestContext, attempt: Attempt,
                 body: dict[str, Any] | None = None,
                 rewriter: UsageRewriter | None = None) -> Coroutine[Any, Any, None]:
        """One engine hop (:meth:`_hop`), in its trace span when tracing is on (no extra
        coroutine layer when off)."""
        if not self.tracing.enabled:
            return self._hop(ctx, attempt, body, rewriter)
        return self._traced_hop(ctx, attempt, body, rewriter)

    async def _traced_hop(self, ctx: RequestContext, attempt: Attempt,
                          body: dict[str, Any] | None, rewriter: UsageRewriter | None) -> None:
        """:meth:`_hop` in its trace span (middleware/observe/tracing.py)."""
        attrs = {"kvgate.engine": attempt.target.id,
                 "kvgate.role": "decode" if rewriter is not None else "both"}
        status = 0
        with self.tracing.span("kvgate.upstream", attrs, client=True) as span:
            try:
                await self._hop(ctx, attempt, body, rewriter)
            except HTTPError as err:
                status = err.status
                raise
            finally:
                hop_done(span, attempt.status or status, attempt.first_byte_at,
                         ctx.request.received_at)

    async def _hop(self, ctx: RequestContext, attempt: Attempt, body: dict[str, Any] | None,
                   rewriter: UsageRewriter | None) -> None:
        """One engine hop (:meth:`_send`) whose verdict feeds the engine's circuit breaker
        (middleware/fleet/breaker.py): served, or failed by the engine's fault (judged after the
        retry: ``pool.suspect``); an engine that cannot be reached was taken out of rotation by
        the engine call; a client that left or an engine 4xx (408 and 429 included) gives
        none."""
        target = attempt.target.id
        try:
            await self._send(ctx, attempt, body, rewriter)
        except UpstreamError as err:
            if err.engine_fault and not isinstance(err, Unreachable):
                self.pool.suspect(ctx, target, err.message)
            raise
        self.pool.report_outcome(target, attempt.broken)

    async def _send(self, ctx: RequestContext, attempt: Attempt, body: dict[str, Any] | None,
                    rewriter: UsageRewriter | None) -> None:
        """Send ``body`` (default: the adapter-shaped client body) to the attempt's target and
        relay the answer; ``rewriter`` edits the usage the client and the usage hooks see."""
        req, adapter = ctx.request, ctx.adapter
        resp = await self.engine.open(attempt.target, adapter.upstream_path(ctx.path),
                                      self._body(ctx, body), req.request_id, ctx.headers)
        self.pool.settle(ctx)  # this engine answers: an earlier one's failure was its own
        attempt.tap = adapter.new_tap(req.client_wants_usage)
        if not req.stream:
            await self._answer(ctx, attempt, resp, rewriter)
            return
        try:
            chunk = await first_chunk(resp)
        except asyncio.CancelledError:  # client gone, or a concurrent prefill fell back
            resp.close()
            raise
        if rewriter is not None:  # decode answers after the prefill: its hit is (nearly) due
            await rewriter.settle()
        relay = EventRelay(attempt.tap, _adjuster(ctx, rewriter))
        attempt.headers[:0] = SSE_HEADERS
        attempt.headers.extend(ctx.plugin_headers())
        await relay_stream(resp, chunk, ctx.send, relay, attempt, adapter.stream_error,
                           lambda: self.report_usage(ctx, attempt),
                           self.config.server.stream_idle_timeout_s)

    async def _answer(self, ctx: RequestContext, attempt: Attempt, resp: EngineResponse,
                      rewriter: UsageRewriter | None) -> None:
        """A whole JSON answer: usage read, hooks run, then the bytes (the engine's own unless
        the P/D rewrite changed them) sent."""
        raw = await read_answer(resp, attempt)
        payload = parse_answer(raw)
        tap = attempt.tap
        assert tap is not None
        if payload is not None:
            tap.on_json(payload)
        usage = tap.usage
        if rewriter is not None:
            await rewriter.settle()
            if payload is not None:
                changed, usage = rewriter.adjust(payload, usage, ctx.adapter.set_cached_tokens)
                raw = orjson.dumps(payload) if changed else raw
        attempt.usage = usage
        await self.report_usage(ctx, attempt)
        ct = resp.headers.get("content-type", "application/json").encode()
        out = [(b"content-type", ct), *attempt.headers, *ctx.plugin_headers()]
        await send_bytes(ctx.send, attempt.status, raw, out)


def _adjuster(ctx: RequestContext, rewriter: UsageRewriter | None) -> Adjust | None:
    """The stream relay's P/D usage edit through the request's adapter."""
    if rewriter is None:
        return None
    set_cached = ctx.adapter.set_cached_tokens

    def adjust(payload: dict[str, Any], usage: Usage) -> Usage:
        return rewriter.adjust(payload, usage, set_cached)[1] or usage

    return adjust


def _note(ctx: RequestContext, attempt: Attempt, started: float) -> None:
    """What the access log reports of a dispatch (the last one's usage wins)."""
    ctx.upstream_s += time.monotonic() - started
    if attempt.usage is not None:
        ctx.usage = attempt.usage
    if ctx.first_byte_at is None:
        ctx.first_byte_at = attempt.first_byte_at
    if attempt.broken is not None:
        ctx.error_code = "stream_broken"


async def race(work: Coroutine[Any, Any, T], receive: Receive,
               source: DisconnectSource | None = None) -> T:
    """Run ``work`` unless the client disconnects first (then cancel it: ClientGone).

    ``work`` runs in the calling task; the disconnect cancels that task where it awaits. With
    the server's ``source`` (middleware/transport/h1server.py) the disconnect is a callback;
    without one
    (another ASGI server, an in-process caller) a :class:`ReceiveWatch` task waits on
    ``receive``. Per
    request this saves a second task and an ``asyncio.wait`` (its futures, callbacks and sets:
    ~5 % of kvgate's CPU at 1 KiB in a py-spy profile), and with a source the watcher too."""
    current = asyncio.current_task()
    assert current is not None
    watch = source if source is not None else ReceiveWatch(receive)
    if watch.disconnected:
        work.close()
        raise ClientGone()
    gone = False

    def on_disconnect() -> None:
        nonlocal gone
        gone = True
        current.cancel()

    watch.watch(on_disconnect)
    try:
        result = await work
    except asyncio.CancelledError:
        if not gone or current.uncancel() > 0:  # not ours, or also cancelled from outside
            raise
        raise ClientGone() from None
    finally:
        watch.unwatch(on_disconnect)
    if gone and current.uncancel() == 0:  # ``work`` swallowed the cancellation
        raise ClientGone()
    return result


__all__ = ["Dispatcher", "UpstreamHTTPError", "Work", "race"]
