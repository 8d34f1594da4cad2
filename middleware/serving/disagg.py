"""Two-hop dispatch (prefill/decode disaggregation): the I/O around a :class:`Connector`.

The gateway calls :meth:`TwoHop.run` instead of a plain forward when the routing decision names
a prefill engine other than its target and a connector is configured. The decode hop is the
gateway's ordinary forward (same retry, relay, disconnect and completion handling), given the
connector's decode body and a :class:`UsageRewriter`.

* Sequential connectors: POST the prefill body (non-streaming), read its JSON answer, build the
  decode body from it, forward decode.
* Concurrent connectors: start the prefill hop as a task and forward decode at once.

Before either hop the connector's ``prepare`` runs (its I/O, e.g. vLLM Mooncake's bootstrap
query); when it raises :class:`TransferUnavailable` no hop is sent and the request is decoded
locally. A hop that fails is reported to the connector (``hop_failed``) so it drops what it
cached about that prefill engine.

Fallback: a prefill hop that fails (engine error, unreachable, an answer without transfer
parameters) is logged and counted, and the request is decoded locally by the decode engine
(a plain single-hop forward, no usage rewrite). For concurrent connectors this happens only if
the decode engine has not started answering (it cannot: it waits for the KV).

Cleanup: a concurrent prefill hop still running when decode fails, finishes, or the client
disconnects is cancelled, which closes its connection, and the engine aborts the request
(vLLM, SGLang and the simulator all abort on disconnect). A sequential prefill whose decode
never comes holds its KV on the prefill engine until the engine's own lease expires (vLLM:
``kv_lease_duration``, ~30 s); nothing the gateway can send frees it earlier.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import aiohttp
import orjson

from kvgate.middleware.fleet.pool import EndpointPool
from kvgate.middleware.framework.connector import (
    Connector,
    DecodeCachedConvention,
    HopContext,
    PrefillHit,
    reported_cached,
    rewrite_usage,
)
from kvgate.middleware.framework.errors import TransferUnavailable, UpstreamError
from kvgate.middleware.framework.types import InferenceRequest, RoutingDecision, Usage
from kvgate.middleware.observe.tracing import Tracing, hop_done
from kvgate.middleware.serving.context import Attempt, RequestContext
from kvgate.middleware.serving.upstream import parse_answer, read_answer
from kvgate.middleware.transport.engine_call import EngineCall

log = logging.getLogger("kvgate.disagg")
#: What makes a request fall back to decoding locally: its prefill hop failed (any engine
#: error, an engine's 4xx included), or the transfer cannot be set up.
PREFILL_FAILED = (UpstreamError, TransferUnavailable)

_ROOM_BITS = 63  # SGLang's bootstrap_room: a random int in [0, 2^63 - 1]


class UsageRewriter:
    """Puts the prefill side's cache hit into the decode answer's usage (JSON or SSE chunk)."""

    def __init__(
        self, hit: PrefillHit, convention: DecodeCachedConvention,
        settle: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.hit = hit
        self.convention = convention
        self._settle = settle

    def rewrite_chunk(self, payload: dict[str, Any]) -> bool:
        """Rewrite one parsed answer or usage chunk in place; True if it changed."""
        cached = self.hit.for_client(reported_cached(payload), self.convention)
        return rewrite_usage(payload, cached)

    def adjust(
        self, payload: dict[str, Any], usage: Usage | None,
        set_cached: Callable[[dict[str, Any], int | None], bool],
    ) -> tuple[bool, Usage | None]:
        """Any API: make ``payload`` (an answer or usage event, whose usage the tap read as
        ``usage``) show the prefill hit through the adapter's ``set_cached``; returns whether
        it changed and the usage the client and the hooks see."""
        reported = usage.cached_tokens if usage is not None else None
        cached = self.hit.for_client(reported, self.convention)
        changed = set_cached(payload, cached)
        if usage is None:
            return changed, None
        if cached is not None:  # reads and writes within the prompt: nothing billed twice
            cached = max(0, min(cached, usage.prompt_tokens - usage.cache_write_tokens))
        return changed, dataclasses.replace(usage, cached_tokens=cached)

    async def settle(self) -> None:
        """Wait (bounded) for a concurrent prefill's answer, which carries its cache hit."""
        if self._settle is not None:
            await self._settle()

    async def rewrite_json(self, body: bytes) -> bytes:
        """A whole JSON answer, after waiting (bounded) for a concurrent prefill's answer."""
        await self.settle()
        try:
            payload: Any = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return body
        if isinstance(payload, dict) and self.rewrite_chunk(payload):
            return json.dumps(payload, separators=(",", ":")).encode()
        return body


def prefill_hit(rc: RequestContext, connector: Connector, answer: dict[str, Any]) -> int | None:
    """The prefill engine's own cache hit: the cached tokens its answer's usage reports, read
    through the request's adapter (the prefill hop answers in the client's API: a Messages
    prefill reports ``cache_read_input_tokens``), else what the connector finds (e.g. vLLM's
    ``kv_transfer_params.remote_prefill_cached_tokens``)."""
    tap = rc.adapter.new_tap(False)
    tap.on_json(answer)
    if tap.usage is not None and tap.usage.cached_tokens is not None:
        return tap.usage.cached_tokens
    return connector.prefill_hit(answer)


#: The gateway's decode forward: (body, rewriter, attempt) -> relayed to the client.
Forward = Callable[[dict[str, Any] | None, UsageRewriter | None, Attempt], Awaitable[None]]
#: Told once the prefill hop ended (True: answered), e.g. to run the PrefillHook plugins.
PrefillDone = Callable[[bool], Awaitable[None]]


class TwoHop:
    """Runs one request over a prefill and a decode engine with a connector."""

    def __init__(
        self, connector: Connector, pool: EndpointPool, engine: EngineCall,
        settle_timeout_s: float, seed: int, count: Callable[[str], None] | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.connector = connector
        self.tracing = tracing if tracing is not None else Tracing.off()
        self._count = count
        self.pool = pool
        self.engine = engine
        self.settle_timeout_s = settle_timeout_s
        self.rng = random.Random(seed)
        #: Counters for tests and metrics: two-hop requests, fallbacks, cancelled prefills.
        self.stats = {"two_hop": 0, "fallback": 0, "prefill_cancelled": 0}

    def _tally(self, result: str) -> None:
        self.stats[result] += 1
        if self._count is not None:
            self._count(result)

    def context(self, req: InferenceRequest, decision: RoutingDecision) -> HopContext:
        assert decision.prefill is not None
        return HopContext(req.request_id, decision.prefill, decision.target,
                          self.rng.getrandbits(_ROOM_BITS))

    async def run(
        self, session: aiohttp.ClientSession, rc: RequestContext, decision: RoutingDecision,
        forward: Forward, progress: Attempt, done: PrefillDone | None = None,
    ) -> None:
        req = rc.request
        ctx = self.context(req, decision)
        try:
            ctx = await self.connector.prepare(session, ctx)
        except TransferUnavailable as err:
            self._fallback(req, ctx, _why(err))
            if done is not None:
                await done(False)  # no prefill hop was sent: release what dispatch charged
            await forward(None, None, progress)
            return
        prefill = _bound(self._prefill, rc)
        prefill = prefill if done is None else _reporting(prefill, done)
        if self.connector.concurrent:
            await self._concurrent(prefill, rc, ctx, forward, progress)
        else:
            await self._sequential(prefill, rc, ctx, forward, progress)

    def _decode_body(
        self, rc: RequestContext, ctx: HopContext, answer: Mapping[str, Any] | None
    ) -> dict[str, Any]:
        req = rc.request
        prepared = rc.adapter.prepare_body(req.body, req.stream) or req.body
        return self.connector.decode_body(req, dict(prepared), ctx, answer)

    async def _prefill(
        self, rc: RequestContext, req: InferenceRequest, ctx: HopContext, hit: PrefillHit,
    ) -> dict[str, Any]:
        """The prefill hop: POST through the engine call (an engine that cannot be reached
        leaves the rotation there), read the JSON answer, record its cache hit."""
        prefill = ctx.prefill
        body = self.connector.prefill_body(req, dict(req.body), ctx)
        lease = self.pool.acquire(prefill.id, req.prompt_token_estimate)
        attrs = {"kvgate.engine": prefill.id, "kvgate.role": "prefill"}
        try:
            with self.tracing.span("kvgate.upstream", attrs, client=True) as span:
                resp = await self.engine.open(prefill, rc.adapter.upstream_path(rc.path),
                                              orjson.dumps(body), req.request_id, rc.headers)
                raw = await read_answer(resp, None)
                hop_done(span, resp.status, time.monotonic(), rc.request.received_at)
        finally:
            lease.release()
        answer = parse_answer(raw)
        if answer is None:
            raise TransferUnavailable("prefill answer is not a JSON object")
        hit.set(prefill_hit(rc, self.connector, answer))
        return answer

    def _fallback(self, req: InferenceRequest, ctx: HopContext, why: str) -> None:
        self._tally("fallback")
        log.warning("request %s: prefill on %s failed (%s); decoding locally on %s",
                    req.request_id, ctx.prefill.id, why, ctx.decode.id)

    async def _sequential(
        self, prefill: _PrefillFn, rc: RequestContext, ctx: HopContext, forward: Forward,
        progress: Attempt,
    ) -> None:
        req = rc.request
        hit = PrefillHit()
        try:
            answer = await prefill(req, ctx, hit)
            body = self._decode_body(rc, ctx, answer)
        except PREFILL_FAILED as err:
            self.connector.hop_failed(ctx)
            self._fallback(req, ctx, _why(err))
            await forward(None, None, progress)
            return
        self._tally("two_hop")
        progress.headers.append((b"x-kvgate-prefill-engine", ctx.prefill.id.encode()))
        await forward(body, UsageRewriter(hit, self.connector.decode_reports), progress)

    async def _concurrent(
        self, prefill_fn: _PrefillFn, rc: RequestContext, ctx: HopContext, forward: Forward,
        progress: Attempt,
    ) -> None:
        req = rc.request
        hit = PrefillHit()
        prefill = asyncio.ensure_future(prefill_fn(req, ctx, hit))

        async def settle() -> None:
            if not prefill.done():
                await asyncio.wait((prefill,), timeout=self.settle_timeout_s)

        headers = list(progress.headers)
        progress.headers.append((b"x-kvgate-prefill-engine", ctx.prefill.id.encode()))
        rewriter = UsageRewriter(hit, self.connector.decode_reports, settle)
        decode = asyncio.ensure_future(forward(self._decode_body(rc, ctx, None), rewriter,
                                               progress))
        try:
            await asyncio.wait((prefill, decode), return_when=asyncio.FIRST_COMPLETED)
            err = _failure(prefill)
            if err is not None:
                self.connector.hop_failed(ctx)
                if not decode.done() and progress.first_byte_at is None:
                    await _cancel(decode)
                    self._fallback(req, ctx, err)
                    progress.headers[:] = headers
                    await forward(None, None, progress)
                    return
                log.warning("request %s: prefill on %s failed after decode started: %s",
                            req.request_id, ctx.prefill.id, err)
            try:
                await decode
            except Exception:
                self.connector.hop_failed(ctx)  # e.g. a stale rendezvous the decode rejected
                raise
            self._tally("two_hop")
        finally:
            if not prefill.done():
                self._tally("prefill_cancelled")
            await _cancel(prefill)
            await _cancel(decode)


_PrefillFn = Callable[[InferenceRequest, HopContext, PrefillHit], Awaitable[dict[str, Any]]]


def _bound(
    prefill: Callable[[RequestContext, InferenceRequest, HopContext, PrefillHit],
                      Awaitable[dict[str, Any]]],
    rc: RequestContext,
) -> _PrefillFn:
    """``prefill`` with the request context bound (the hop's path is the API's)."""

    async def run(req: InferenceRequest, ctx: HopContext, hit: PrefillHit) -> dict[str, Any]:
        return await prefill(rc, req, ctx, hit)

    return run


def _reporting(prefill: _PrefillFn, done: PrefillDone) -> _PrefillFn:
    """``prefill`` that calls ``done(ok)`` once it ends, however it ends."""

    async def run(req: InferenceRequest, ctx: HopContext, hit: PrefillHit) -> dict[str, Any]:
        ok = False
        try:
            answer = await prefill(req, ctx, hit)
            ok = True
            return answer
        finally:
            await done(ok)

    return run


def _why(err: BaseException) -> str:
    return getattr(err, "message", None) or str(err) or type(err).__name__


def _failure(task: asyncio.Future[Any]) -> str | None:
    """Why a finished prefill task failed (None: still running, or it succeeded)."""
    if not task.done() or task.cancelled():
        return None
    exc = task.exception()
    if exc is None:
        return None
    if isinstance(exc, PREFILL_FAILED):
        return _why(exc)
    raise exc


async def _cancel(task: asyncio.Future[Any]) -> None:
    if not task.done():
        task.cancel()
    await asyncio.gather(task, return_exceptions=True)
