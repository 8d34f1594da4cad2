"""The simulated engine's HTTP API (a Starlette ASGI app), vLLM-compatible.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (JSON or SSE), ``GET
/v1/models``, ``GET /health``, ``GET /metrics``, ``POST /reset_prefix_cache`` (as vLLM's dev
endpoint), and the simulator's own ``GET|POST|DELETE /sim/faults``
(:mod:`kvgate.engines.sim.core.faults`) and ``GET /sim/state``. A prefill-role engine with
``pd.bootstrap_port`` set also serves the Mooncake bootstrap server on that port
(:mod:`kvgate.engines.sim.bootstrap`), started by the lifespan.

Request path (one inference request): fault checks → parse (:mod:`kvgate.engines.sim.http.protocol`)
→ :meth:`SimApi.execute` hands the request to the engine according to the engine's ``role`` →
the answer is rendered as JSON or SSE from the engine's :class:`RequestHandle`. A prefill-only
role (answering with ``kv_transfer_params``) or a decode role (taking KV that a prefill engine
transferred, counted as ``external_kv_transfer``) plugs in at :meth:`SimApi.execute` and in
:meth:`SimApi.answer_json` for the extra response field.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncGenerator
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from kvgate.engines.sim.bootstrap import BootstrapServer
from kvgate.engines.sim.core.config import SimConfig
from kvgate.engines.sim.core.engine import EngineDead, EngineOverloaded, RequestHandle, SimEngine
from kvgate.engines.sim.core.faults import FaultSpec, FaultState
from kvgate.engines.sim.core.metrics import render_metrics
from kvgate.engines.sim.core.pd import (
    InvalidTransferParams,
    KvBoard,
    PdStats,
    Transfer,
    fetch_transfer,
    is_prefill_request,
    nixl_answer_params,
    offers_kv,
    take_transfer,
    transfer_key,
    transfer_seconds,
)
from kvgate.engines.sim.core.scheduler import SeqSpec
from kvgate.engines.sim.http.protocol import (
    SSE_DONE,
    Api,
    ApiError,
    ParsedRequest,
    Shaper,
    Usage,
    parse_request,
    sse,
)
from kvgate.engines.sim.http.streaming import (
    EventStreamResponse,
    until_done_or_disconnect,
    watch_disconnect,
)
from kvgate.engines.sim.http.tracing import SimTracer

#: Largest request body accepted, in bytes (413 past it): a 32k-token prompt is ~130 KB of
#: text or ~200 KB of token ids, so 16 MiB leaves room for anything sane.
MAX_BODY_BYTES = 16 << 20
_REQUEST_ID_HEADER = "x-request-id"


@dataclass(frozen=True, slots=True)
class SimHandles:
    """What tests reach through ``app.state.sim``."""

    config: SimConfig
    engine: SimEngine
    faults: FaultState
    #: Finished prefills awaiting their decode engine (prefill role, concurrent protocols).
    board: KvBoard
    #: Decode-side transfer counters.
    pd: PdStats
    #: The Mooncake bootstrap server (prefill role with ``pd.bootstrap_port``), else None.
    bootstrap: BootstrapServer | None = None
    #: The ``llm_request`` span exporter (``otlp_traces_endpoint``; engines/sim/http/tracing.py).
    tracer: SimTracer | None = None


def sim_handles(app: Starlette) -> SimHandles:
    """The engine, faults and config behind an app made by :func:`create_sim_app`."""
    handles = app.state.sim
    assert isinstance(handles, SimHandles)
    return handles


def _error(exc: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


async def _read_json(request: Request) -> Any:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise ApiError(413, f"request body larger than {MAX_BODY_BYTES} bytes")
    body = await request.body()
    if len(body) > MAX_BODY_BYTES:
        raise ApiError(413, f"request body larger than {MAX_BODY_BYTES} bytes")
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, f"invalid JSON body: {exc}") from None


class SimApi:
    """Route handlers bound to one engine."""

    def __init__(self, handles: SimHandles) -> None:
        self.h = handles
        self.config = handles.config
        self.created = int(time.time())

    # ---- inference --------------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        return await self.inference(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self.inference(request, "completions")

    async def inference(self, request: Request, api: Api) -> Response:
        """One inference request in its trace span (engines/sim/http/tracing.py), if traced."""
        request_id = request.headers.get(_REQUEST_ID_HEADER) or secrets.token_hex(16)
        tracer = self.h.tracer
        if tracer is None:
            return await self._inference(request, api, request_id)
        with tracer.span(request.headers, request_id, self.config.served_model_names[0]):
            return await self._inference(request, api, request_id)

    async def _inference(self, request: Request, api: Api, request_id: str) -> Response:
        """One inference request: faults, parse, run, answer (see the module docstring)."""
        headers = {_REQUEST_ID_HEADER: request_id}
        faults = self.h.faults
        if faults.delay_first_byte_s > 0:
            await asyncio.sleep(faults.delay_first_byte_s)
        status = faults.take_failure(await request.body() if faults.match else b"")
        if status is not None:
            return _error(ApiError(status, faults.message), headers)
        try:
            req = parse_request(api, await _read_json(request), self.config)
            handle, transfer = await self.execute(req, request_id)
        except ApiError as exc:
            return _error(exc, headers)
        except InvalidTransferParams:
            return await self._park(request, headers)
        prefix = "chatcmpl-" if api == "chat" else "cmpl-"
        shaper = Shaper(req, prefix + request_id, int(time.time()),
                        self.config.enable_prompt_tokens_details)
        run = Run(req, handle, transfer, request_id)
        if req.stream:
            return EventStreamResponse(
                self._sse_events(run, shaper), handle.abort, faults.take_drop(), headers)
        return await self.answer_json(request, run, shaper, headers)

    async def execute(
        self, req: ParsedRequest, request_id: str
    ) -> tuple[RequestHandle, Transfer | None]:
        """Hand a parsed request to the engine according to the role (engines/sim/core/pd.py):
        ``both`` prefills and decodes locally; ``prefill`` runs one token; ``decode`` first
        receives the KV a prefill engine computed (waiting the transfer time), if any."""
        max_tokens, min_tokens, transfer = req.max_tokens, req.min_tokens, None
        if self.config.role == "prefill":
            max_tokens, min_tokens = 1, 0
        elif self.config.role == "decode":
            async with aiohttp.ClientSession() as session:
                transfer = await fetch_transfer(req, session, self.config.pd, self.h.pd)
            if transfer is not None:
                seconds = transfer_seconds(transfer.tokens, self.config.pd)
                await asyncio.sleep(seconds * self.config.time_scale)
        spec = SeqSpec(
            request_id=request_id, prompt_ids=req.prompt_ids, max_tokens=max_tokens,
            cache_salt=req.cache_salt, ignore_eos=req.ignore_eos, min_tokens=min_tokens,
            seed=req.seed, external_tokens=0 if transfer is None else transfer.tokens,
        )
        try:
            return self.h.engine.submit(spec), transfer
        except (EngineOverloaded, EngineDead) as exc:
            raise ApiError(503, str(exc)) from None

    async def _park(self, request: Request, headers: dict[str, str]) -> Response:
        """A Mooncake decode request vLLM would leave waiting for KV nobody sends
        (engines/sim/core/pd.py): held until its client disconnects, never computed."""
        self.h.pd.parked += 1
        try:
            await watch_disconnect(request.receive, lambda: None)
        finally:
            self.h.pd.parked -= 1
        return _error(ApiError(503, "request aborted"), headers)  # unsent: the client is gone

    def finish_prefill(self, run: Run) -> None:
        """Prefill role: offer the finished prefill to its decode engine (or withdraw it)."""
        key = transfer_key(run.req)
        if self.config.role != "prefill" or key is None:
            return
        if not offers_kv(key, run.handle.finish_reason):
            self.h.board.fail(key)
        else:
            self.h.board.publish(key, Transfer(run.handle.prompt_tokens,
                                               run.handle.cached_tokens))

    def usage(self, run: Run) -> Usage:
        """Usage; a decode that received KV reports per ``pd.decode_reports``."""
        usage = _usage(run.handle)
        hit = None if run.transfer is None else run.transfer.prefill_hit
        if hit is not None and self.config.pd.decode_reports == "prefill-hit":
            usage = Usage(usage.prompt_tokens, usage.completion_tokens, hit)
        return usage

    async def answer_json(
        self, request: Request, run: Run, shaper: Shaper, headers: dict[str, str]
    ) -> Response:
        """Wait for the whole completion (aborting it if the client leaves), answer JSON."""
        handle = run.handle
        tokens = await until_done_or_disconnect(request.receive, handle.result(), handle.abort)
        self.finish_prefill(run)
        if handle.finish_reason == "abort":
            return _error(ApiError(503, "request aborted"), headers)
        body = shaper.full(tokens, self.usage(run), handle.finish_reason)
        params = self.prefill_answer_params(request, run)
        if params is not None:
            body["kv_transfer_params"] = params
        return JSONResponse(body, headers=headers)

    def prefill_answer_params(self, request: Request, run: Run) -> dict[str, Any] | None:
        """A finished NIXL prefill's ``kv_transfer_params`` for its decode (prefill role), or
        None: chat, completions and Messages answers carry them alike, as vLLM's do."""
        if self.config.role != "prefill" or not is_prefill_request(run.req) \
                or transfer_key(run.req) is not None:
            return None
        return nixl_answer_params(
            self.config.engine_id, request.url.hostname or "127.0.0.1", request.url.port or 0,
            run.request_id, run.handle.prompt_tokens, run.handle.cached_tokens,
            self.config.block_size)

    async def kv_transfer(self, request: Request) -> Response:
        """Prefill role: a decode engine's long poll for a finished prefill
        (engines/sim/core/pd.py)."""
        key = request.path_params["key"]
        transfer = await take_transfer(self.h.board, key, request.query_params.get("timeout"))
        if transfer is None:
            return _error(ApiError(404, f"no finished prefill {key!r}"))
        return JSONResponse({"tokens": transfer.tokens, "prefill_hit": transfer.prefill_hit})

    async def _sse_events(
        self, run: Run, shaper: Shaper
    ) -> AsyncGenerator[bytes, None]:
        """The SSE events of a stream; ends without ``[DONE]`` if the request was aborted."""
        handle = run.handle
        try:
            first = True
            async for tok in handle.tokens():
                if first and shaper.req.api == "chat":
                    yield sse(shaper.role_chunk())
                first = False
                yield sse(shaper.token_chunk(tok))
            if handle.finish_reason in (None, "abort"):
                return
            if shaper.req.include_usage:
                yield sse(shaper.usage_chunk(self.usage(run)))
            yield SSE_DONE
        finally:
            handle.abort()  # no-op when finished; frees the request on any early exit
            self.finish_prefill(run)

    # ---- everything else --------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        data: list[dict[str, Any]] = [
            {"id": name, "object": "model", "created": self.created, "owned_by": "vllm",
             "root": name, "parent": None, "max_model_len": self.config.effective_max_model_len,
             "permission": []}
            for name in self.config.served_model_names
        ]
        return JSONResponse({"object": "list", "data": data})

    async def health(self, request: Request) -> Response:
        ok = self.h.faults.health and self.h.engine.healthy
        return Response(status_code=200 if ok else 503)

    async def metrics(self, request: Request) -> Response:
        return PlainTextResponse(
            render_metrics(self.h.engine), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def reset_prefix_cache(self, request: Request) -> Response:
        if self.h.engine.reset_prefix_cache():
            return JSONResponse({"reset": True})
        return _error(ApiError(409, "cannot reset the prefix cache while requests hold blocks"))

    async def faults(self, request: Request) -> Response:
        state = self.h.faults
        if request.method == "DELETE":
            state.clear()
        elif request.method == "POST":
            try:
                state.apply(FaultSpec.model_validate(await _read_json(request)))
            except ApiError as exc:
                return _error(exc)
            except ValidationError as exc:
                return _error(ApiError(400, str(exc)))
        return JSONResponse(state.snapshot())

    async def state(self, request: Request) -> Response:
        engine = self.h.engine
        cache = engine.scheduler.cache
        publisher = engine.publisher
        return JSONResponse({
            "engine_id": self.config.engine_id,
            "running": engine.num_running,
            "waiting": engine.num_waiting,
            "kv_cache_usage": cache.usage,
            "cached_blocks": len(cache),
            "used_blocks": cache.used_blocks,
            "stats": asdict(engine.scheduler.stats),
            "kv_events": None if publisher is None else {
                "endpoint": publisher.endpoint, **asdict(publisher.stats)},
            "pd": {**asdict(self.h.pd), "bootstrap": None if self.h.bootstrap is None else {
                "port": self.h.bootstrap.port, "queries": self.h.bootstrap.queries}},
        })


@dataclass(frozen=True, slots=True)
class Run:
    """One inference request in flight: its parse, engine handle and received KV."""

    req: ParsedRequest
    handle: RequestHandle
    transfer: Transfer | None
    request_id: str


def _usage(handle: RequestHandle) -> Usage:
    return Usage(handle.prompt_tokens, handle.completion_tokens, handle.cached_tokens)
