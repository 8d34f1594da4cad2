"""Running a :class:`~kvgate.middleware.framework.backend.ModelPlan`: steps in order, falling back
on failure.

Each step serves the request under the step's public model name (``req.model`` and the body's
``model`` are set to it, so billing prices and the ledger records the model that served).
A step that fails with a status in ``plan.fallback_on`` before the client's response started
hands over to the next step; the failed dispatch has had its completion hooks already (its
ledger record is replaced by the next one: records are idempotent by request id).

Backend steps are dispatched here: the backend returns OpenAI-shaped dicts, this module sends
them (JSON whole; streams as ``data:`` events then ``[DONE]``, never buffered), running the
usage hooks before the bytes carrying the usage are sent and the completion hooks on every
outcome through :meth:`kvgate.middleware.serving.dispatch.Dispatcher.run`, as for HTTP engines.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import orjson

from kvgate.middleware.framework.backend import (
    MODEL_PLAN,
    Backend,
    BackendReply,
    BackendStep,
    ModelPlan,
    PoolStep,
)
from kvgate.middleware.framework.errors import HTTPError, NoEndpointAvailable
from kvgate.middleware.framework.types import Endpoint
from kvgate.middleware.serving.context import Attempt, RequestContext
from kvgate.middleware.serving.dispatch import Dispatcher
from kvgate.middleware.transport.asgi import JSON_CT, SSE_HEADERS, send_bytes

__all__ = ["MODEL_PLAN", "PlanRunner"]
log = logging.getLogger("kvgate.plan")
_DONE = b"data: [DONE]\n\n"


class PlanRunner:
    """Serves one request along a plan (stateless between requests)."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher

    async def run(self, plan: ModelPlan, ctx: RequestContext) -> int:
        req = ctx.request
        for i, step in enumerate(plan.steps):
            if req.model != step.model or req.body.get("model") != step.model:
                req.model = step.model
                req.update_body(model=step.model)
            try:
                if isinstance(step, PoolStep):
                    return await self._pool(step, ctx)
                return await self._backend(step, ctx)
            except HTTPError as err:
                last = i == len(plan.steps) - 1
                if last or err.status not in plan.fallback_on or ctx.started:
                    raise
                log.warning("request %s: model %r failed (%d: %s); falling back to %r",
                            req.request_id, step.model, err.status, err.message,
                            plan.steps[i + 1].model)
        raise NoEndpointAvailable("the model plan has no steps")

    async def _pool(self, step: PoolStep, ctx: RequestContext) -> int:
        eps: Sequence[Endpoint] = self.dispatcher.pool.snapshot()
        if step.engines is not None:
            eps = [ep for ep in eps if ep.id in step.engines]
        return await self.dispatcher.serve_pool(ctx, eps, step.profile)

    async def _backend(self, step: BackendStep, ctx: RequestContext) -> int:
        backend = self.dispatcher.pipeline.backends.get(step.kind)
        if backend is None:  # the pipeline checks this at startup
            raise NoEndpointAvailable(f"no backend of kind {step.kind!r} is installed")

        async def work(attempt: Attempt) -> None:
            await self._forward(backend, step, ctx, attempt)

        return await self.dispatcher.run(ctx, step.endpoint, work)

    async def _forward(self, backend: Backend, step: BackendStep, ctx: RequestContext,
                       attempt: Attempt) -> None:
        reply = await backend.open(ctx.request, step)
        attempt.status, attempt.first_byte_at = 200, time.monotonic()
        if reply.payload is not None:
            attempt.usage = backend.extract_usage(reply.payload)
            await self.dispatcher.report_usage(ctx, attempt)
            out = [JSON_CT, *attempt.headers, *ctx.plugin_headers()]
            await send_bytes(ctx.send, 200, orjson.dumps(reply.payload), out)
            return
        await self._stream(backend, reply, ctx, attempt)

    async def _stream(self, backend: Backend, reply: BackendReply, ctx: RequestContext,
                      attempt: Attempt) -> None:
        assert reply.chunks is not None
        headers = [*SSE_HEADERS, *attempt.headers, *ctx.plugin_headers()]
        await ctx.send({"type": "http.response.start", "status": 200, "headers": headers})
        try:
            await self._relay(backend, reply, ctx, attempt)
        except HTTPError as err:
            attempt.broken = f"provider stream broke: {err.message}"
        finally:  # also on cancellation (client gone): close the provider's stream now
            aclose = getattr(reply.chunks, "aclose", None)
            if aclose is not None:
                await aclose()
        tail = _DONE if attempt.broken is None else ctx.adapter.stream_error(attempt.broken)
        await ctx.send({"type": "http.response.body", "body": tail, "more_body": False})

    async def _relay(self, backend: Backend, reply: BackendReply, ctx: RequestContext,
                     attempt: Attempt) -> None:
        assert reply.chunks is not None
        wants_usage = ctx.request.client_wants_usage
        async for chunk in reply.chunks:
            usage = backend.extract_usage(chunk)
            if usage is not None and attempt.usage is None:
                attempt.usage = usage  # hooks before the usage and [DONE] are sent
                await self.dispatcher.report_usage(ctx, attempt)
                if not wants_usage and chunk.get("choices") == []:
                    continue
            attempt.events += 1
            data = b"data: " + orjson.dumps(chunk) + b"\n\n"
            await ctx.send({"type": "http.response.body", "body": data, "more_body": True})
