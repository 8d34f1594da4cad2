"""The simulated engine's ASGI app: the engine and its companions built from a
:class:`SimConfig`, the lifespan that runs them, and every route (vLLM's API from
:mod:`kvgate.engines.sim.http.app`, the agent APIs from
:mod:`kvgate.engines.sim.http.agent_app`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvgate.engines.sim.bootstrap import BootstrapServer
from kvgate.engines.sim.core.config import SimConfig
from kvgate.engines.sim.core.engine import SimEngine
from kvgate.engines.sim.core.faults import FaultState
from kvgate.engines.sim.core.pd import KvBoard, PdStats
from kvgate.engines.sim.http.agent_app import AgentApi
from kvgate.engines.sim.http.app import SimApi, SimHandles
from kvgate.engines.sim.http.tracing import SimTracer


def _handles(config: SimConfig) -> SimHandles:
    """The engine and its companions; a prefill engine with ``pd.bootstrap_port`` gets a
    Mooncake bootstrap server sharing its board."""
    board = KvBoard(config.pd.board_limit)
    pd = config.pd
    bootstrap = None if config.role != "prefill" or pd.bootstrap_port is None else \
        BootstrapServer(config.engine_id, board, pd.bootstrap_host, pd.bootstrap_port)
    tracer = None if config.otlp_traces_endpoint is None else \
        SimTracer(config.otlp_traces_endpoint, config.engine_id)
    return SimHandles(config=config, engine=SimEngine(config), faults=FaultState(),
                      board=board, pd=PdStats(), bootstrap=bootstrap, tracer=tracer)


def create_sim_app(config: SimConfig) -> Starlette:
    """A vLLM-compatible simulated engine as an ASGI app.

    The engine is built here but does no work until started: by the ASGI lifespan (uvicorn),
    or lazily by the first request (e.g. under ``httpx.ASGITransport``, which runs no lifespan;
    then close it with ``await sim_handles(app).engine.aclose()``). ``app.state.sim`` (see
    :func:`sim_handles`) holds the engine, the fault state and the config;
    ``app.state.engine`` is the engine itself. The bootstrap server, if any, runs only under
    the lifespan.
    """
    handles = _handles(config)
    bootstrap = handles.bootstrap
    api = SimApi(handles)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        handles.engine.start()
        try:
            if bootstrap is not None:
                await bootstrap.start()
            yield
        finally:
            if bootstrap is not None:
                await bootstrap.stop()
            await handles.engine.aclose()
            if handles.tracer is not None:
                await asyncio.to_thread(handles.tracer.shutdown)

    app = Starlette(routes=_routes(api), lifespan=lifespan,
                    exception_handlers={404: _not_found})
    app.state.sim = handles
    app.state.engine = handles.engine
    return app


async def _not_found(request: Request, exc: Exception) -> Response:
    """FastAPI's answer for a route the engine does not serve."""
    return JSONResponse({"detail": "Not Found"}, status_code=404)


def _routes(api: SimApi) -> list[Route]:
    """Every route; the inference ones depend on the runner (``generate`` or ``pooling``)."""
    agent = AgentApi(api)
    generate = [
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
    ] if api.config.runner == "generate" else []
    return [
        *generate, *agent.routes(),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
        Route("/reset_prefix_cache", api.reset_prefix_cache, methods=["POST"]),
        Route("/sim/faults", api.faults, methods=["GET", "POST", "DELETE"]),
        Route("/sim/state", api.state, methods=["GET"]),
        Route("/sim/kv_transfer/{key}", api.kv_transfer, methods=["GET"]),
    ]
