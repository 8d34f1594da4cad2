"""Run simulated engines inside the current event loop, for tests.

``async with serve_sim(SimConfig(time_scale=0)) as sim:`` starts uvicorn on a free loopback
port in the running loop (with the app's lifespan, so the engine starts and stops with it) and
yields a :class:`RunningSim`: ``sim.url`` (``http://127.0.0.1:PORT``), ``sim.engine``,
``sim.faults``, and ``sim.bootstrap_port`` (a prefill engine's Mooncake bootstrap server, when
``pd.bootstrap_port`` is set; 0 there picks a free port). Leaving the block stops the server
and closes the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass

import uvicorn
from starlette.applications import Starlette

from kvgate.engines.sim.core.config import SimConfig
from kvgate.engines.sim.core.engine import SimEngine
from kvgate.engines.sim.core.faults import FaultState
from kvgate.engines.sim.http.app import sim_handles
from kvgate.engines.sim.http.server import create_sim_app

#: How long startup may take before :func:`serve_sim` gives up, in seconds.
STARTUP_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class RunningSim:
    """A simulated engine served on loopback."""

    url: str
    port: int
    app: Starlette
    engine: SimEngine
    faults: FaultState
    config: SimConfig
    #: The bound port of the Mooncake bootstrap server (prefill role), else None.
    bootstrap_port: int | None = None


def _bind_loopback(host: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(128)
    sock.setblocking(False)
    return sock


async def _wait_started(server: uvicorn.Server, task: asyncio.Task[None]) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + STARTUP_TIMEOUT_S
    while not server.started:
        if task.done():
            task.result()  # re-raises the startup failure
            raise RuntimeError("simulated engine server exited during startup")
        if loop.time() > deadline:
            raise TimeoutError("simulated engine server did not start")
        await asyncio.sleep(0.005)


@contextlib.asynccontextmanager
async def serve_sim(
    config: SimConfig | None = None, host: str = "127.0.0.1"
) -> AsyncIterator[RunningSim]:
    """Serve a simulated engine on a free port of ``host`` for the duration of the block."""
    config = config or SimConfig()
    app = create_sim_app(config)
    sock = _bind_loopback(host)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(
        app, http="httptools", lifespan="on", access_log=False, log_level="warning",
        timeout_graceful_shutdown=2, server_header=False, date_header=False,
    ))
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    try:
        await _wait_started(server, task)
        handles = sim_handles(app)
        bootstrap = None if handles.bootstrap is None else handles.bootstrap.port
        yield RunningSim(url=f"http://{host}:{port}", port=port, app=app,
                         engine=handles.engine, faults=handles.faults, config=config,
                         bootstrap_port=bootstrap)
    finally:
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await task
        sock.close()
