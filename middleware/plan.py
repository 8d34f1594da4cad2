"""Running a :class:`~middleware.backend.ModelPlan`: steps in order, falling back on failure.

Each step serves the request under the step's public model name (``req.model`` and the body's
``model`` are set to it, so billing prices and the ledger records the model that served).
A step that fails with a status in ``plan.fallback_on`` before the client's response started
hands over to the next step; the failed dispatch has had its completion hooks already (its
ledger record is replaced by the next one: records are idempotent by request id).

Backend steps are dispatched here: the backend returns OpenAI-shaped dicts, this module sends
them (JSON whole; streams as ``data:`` events then ``[DONE]``, never buffered), running the
usage hooks before the bytes carrying the usage are sent and the completion hooks on every
outcome -- the same contract as :class:`middleware.gateway.Gateway` for HTTP engines.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Protocol

from middleware.asgi import JSON_CT, ClientGone, Headers, Receive, Send, send_bytes
from middleware.backend import (
    MODEL_PLAN,
    Backend,
    BackendReply,
    BackendStep,
    ModelPlan,
    PoolStep,
)
from middleware.errors import HTTPError, NoEndpointAvailable
from middleware.metrics import GatewayMetrics
from middleware.pipeline import Pipeline
from middleware.pool import EndpointPool
from middleware.sse import error_event
from middleware.types import (
    RESPONSE_HEADERS,
    CycleState,
    Endpoint,
    InferenceRequest,
    OutcomeKind,
)
from middleware.upstream import Progress

__all__ = ["MODEL_PLAN", "GatewayOps", "PlanRunner", "plugin_headers"]
log = logging.getLogger("kvgate.plan")
Race = Callable[[Coroutine[Any, Any, None], Receive], Coroutine[Any, Any, None]]
_SSE: Headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
                 (b"x-accel-buffering", b"no")]
_DONE = b"data: [DONE]\n\n"


class GatewayOps(Protocol):
    """What a plan needs from the gateway (middleware.gateway.Gateway implements it)."""

    pool: EndpointPool
    pipeline: Pipeline
    metrics: GatewayMetrics

    async def serve_engines(
        self, req: InferenceRequest, state: CycleState, receive: Receive, send: Send,
        extra: Headers, eps: Sequence[Endpoint], profile: str | None,
    ) -> int: ...

    async def _report_usage(
        self, req: InferenceRequest, state: CycleState, target: Endpoint, progress: Progress
    ) -> None: ...

    async def _complete(
        self, req: InferenceRequest, state: CycleState, target: Endpoint, progress: Progress,
        kind: OutcomeKind, error: str | None, will_retry: bool,
    ) -> None: ...


class PlanRunner:
    """Serves one request along a plan (stateless between requests)."""

    def __init__(self, gateway: GatewayOps, race: Race) -> None:
        self.gw = gateway
        self._race = race

    async def run(self, plan: ModelPlan, req: InferenceRequest, state: CycleState,
                  receive: Receive, send: Send, extra: Headers) -> int:
        for i, step in enumerate(plan.steps):
            if req.model != step.model or req.body.get("model") != step.model:
                req.model = step.model
                req.update_body(model=step.model)
            try:
                if isinstance(step, PoolStep):
                    return await self._pool(step, req, state, receive, send, extra)
                return await self._backend(step, req, state, receive, send, extra)
            except HTTPError as err:
                last = i == len(plan.steps) - 1
                if last or err.status not in plan.fallback_on or getattr(send, "started", False):
                    raise
                log.warning("request %s: model %r failed (%d: %s); falling back to %r",
                            req.request_id, step.model, err.status, err.message,
                            plan.steps[i + 1].model)
        raise NoEndpointAvailable("the model plan has no steps")

    async def _pool(self, step: PoolStep, req: InferenceRequest, state: CycleState,
                    receive: Receive, send: Send, extra: Headers) -> int:
        eps: Sequence[Endpoint] = self.gw.pool.snapshot()
        if step.engines is not None:
            eps = [ep for ep in eps if ep.id in step.engines]
        return await self.gw.serve_engines(req, state, receive, send, extra, eps, step.profile)

    async def _backend(self, step: BackendStep, req: InferenceRequest, state: CycleState,
                       receive: Receive, send: Send, extra: Headers) -> int:
        backend = self.gw.pipeline.backends.get(step.kind)
        if backend is None:  # the pipeline checks this at startup
            raise NoEndpointAvailable(f"no backend of kind {step.kind!r} is installed")
        target = step.endpoint
        progress = Progress(headers=[*extra, (b"x-kvgate-engine", target.id.encode())])
        kind: OutcomeKind = OutcomeKind.UPSTREAM_ERROR
        error: str | None = "backend failed"
        try:
            await self._race(self._forward(backend, step, req, state, target, send, progress),
                             receive)
            kind, error = OutcomeKind.DONE, None
            if progress.broken is not None:
                kind, error = OutcomeKind.UPSTREAM_ERROR, progress.broken
                self.gw.metrics.upstream_errors.labels(target.id, "mid_stream").inc()
            return progress.status
        except ClientGone:
            kind, error = OutcomeKind.CLIENT_DISCONNECT, "client disconnected"
            raise
        except HTTPError as err:
            error, progress.status = err.message, err.status
            self.gw.metrics.upstream_errors.labels(target.id, "before_first_byte").inc()
            raise
        finally:
            await self.gw._complete(req, state, target, progress, kind, error, False)

    async def _forward(self, backend: Backend, step: BackendStep, req: InferenceRequest,
                       state: CycleState, target: Endpoint, send: Send,
                       progress: Progress) -> None:
        reply = await backend.open(req, step)
        progress.status, progress.first_byte_at = 200, time.monotonic()
        if reply.payload is not None:
            progress.usage = backend.extract_usage(reply.payload)
            await self.gw._report_usage(req, state, target, progress)
            out = [JSON_CT, *progress.headers, *plugin_headers(state)]
            await send_bytes(send, 200, json.dumps(reply.payload).encode(), out)
            return
        await self._stream(backend, reply, req, state, target, send, progress)

    async def _stream(self, backend: Backend, reply: BackendReply, req: InferenceRequest,
                      state: CycleState, target: Endpoint, send: Send,
                      progress: Progress) -> None:
        assert reply.chunks is not None
        headers = [*_SSE, *progress.headers, *plugin_headers(state)]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        try:
            await self._relay(backend, reply, req, state, target, send, progress)
        except HTTPError as err:
            progress.broken = f"provider stream broke: {err.message}"
        finally:  # also on cancellation (client gone): close the provider's stream now
            aclose = getattr(reply.chunks, "aclose", None)
            if aclose is not None:
                await aclose()
        tail = _DONE if progress.broken is None else error_event(progress.broken)
        await send({"type": "http.response.body", "body": tail, "more_body": False})

    async def _relay(self, backend: Backend, reply: BackendReply, req: InferenceRequest,
                     state: CycleState, target: Endpoint, send: Send,
                     progress: Progress) -> None:
        assert reply.chunks is not None
        async for chunk in reply.chunks:
            usage = backend.extract_usage(chunk)
            if usage is not None and progress.usage is None:
                progress.usage = usage  # hooks before the usage and [DONE] are sent
                await self.gw._report_usage(req, state, target, progress)
                if not req.client_wants_usage and chunk.get("choices") == []:
                    continue
            progress.events += 1
            data = b"data: " + json.dumps(chunk).encode() + b"\n\n"
            await send({"type": "http.response.body", "body": data, "more_body": True})


def plugin_headers(state: CycleState) -> Headers:
    """Response headers plugins asked for (``add_response_header``)."""
    headers = state.get(RESPONSE_HEADERS) or {}
    return [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
