"""Fixtures: simulated engines served in-process on loopback, the gateway app in front of them
(its lifespan run by ``app.running()``), and an httpx client over ASGITransport."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvgate.engines.sim.core.config import SimConfig
from kvgate.engines.sim.testing import RunningSim, serve_sim
from kvgate.middleware.app import KvgateApp, create_app
from kvgate.middleware.cli import HTTP_FRONTS
from kvgate.middleware.framework.composition.config import parse_config
from tests.servers import REDIS_SERVER, RedisServer, serve_asgi

#: The HTTP/1.1 front end ``kvgate serve`` runs (middleware/transport/h1server.py), for ``serve_gateway``.
KVGATE_FRONT = HTTP_FRONTS["kvgate"]
FAST_POOL = {"health_interval_s": 0.1, "metrics_interval_s": 0.1, "health_timeout_s": 1.0,
             "unhealthy_after": 1}
DEFAULT_PROFILE: dict[str, Any] = {
    "plugins": [{"type": "health-filter"}, {"type": "model-filter"},
                {"type": "least-in-flight-scorer"}, {"type": "max-score-picker"}],
    "profiles": [{"name": "default", "plugins": [
        {"ref": "health-filter"}, {"ref": "model-filter"},
        {"ref": "least-in-flight-scorer"}, {"ref": "max-score-picker"}]}],
}


@contextlib.asynccontextmanager
async def sim_fleet(count: int, **overrides: Any) -> AsyncIterator[list[RunningSim]]:
    async with contextlib.AsyncExitStack() as stack:
        sims = []
        for i in range(count):
            cfg = SimConfig(**{"engine_id": f"sim-{i}", "time_scale": 0.0, "seed": i, **overrides})
            sims.append(await stack.enter_async_context(serve_sim(cfg)))
        yield sims


def gateway_config(urls: list[str], picker: str = "max-score-picker",
                   **sections: Any) -> dict[str, Any]:
    """A config for ``urls`` with the default profile (optionally another picker)."""
    engines = [{"name": f"sim-{i}", "url": u} for i, u in enumerate(urls)]
    profile = json.loads(json.dumps(DEFAULT_PROFILE).replace("max-score-picker", picker))
    return {"engines": engines, "pool": {**FAST_POOL, **sections.pop("pool", {})},
            **profile, **sections}


@contextlib.asynccontextmanager
async def gateway(data: dict[str, Any]) -> AsyncIterator[tuple[KvgateApp, httpx.AsyncClient]]:
    app = create_app(parse_config(data, "test"))
    async with app.running():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=30) as c:
            yield app, c


@pytest.fixture
async def fleet() -> AsyncIterator[list[RunningSim]]:
    async with sim_fleet(2) as sims:
        yield sims


@pytest.fixture
async def gw(fleet: list[RunningSim]) -> AsyncIterator[tuple[KvgateApp, httpx.AsyncClient]]:
    async with gateway(gateway_config([s.url for s in fleet])) as pair:
        yield pair


@contextlib.asynccontextmanager
async def serve_gateway(data: dict[str, Any], http: str = "httptools",
                        ) -> AsyncIterator[tuple[KvgateApp, str]]:
    """The gateway served by uvicorn on a free loopback port in this event loop (``http``:
    the HTTP protocol, as :func:`tests.servers.serve_asgi`)."""
    app = create_app(parse_config(data, "test"))
    async with serve_asgi(app, http=http) as url:
        yield app, url


@contextlib.asynccontextmanager
async def served(data: dict[str, Any]) -> AsyncIterator[tuple[KvgateApp, httpx.AsyncClient]]:
    """As :func:`gateway`, but over a loopback socket through the HTTP front end ``kvgate
    serve`` runs (:data:`KVGATE_FRONT`) instead of ASGITransport."""
    async with serve_gateway(data, KVGATE_FRONT) as (app, url), \
            httpx.AsyncClient(base_url=url, timeout=30) as client:
        yield app, client


@pytest.fixture
def redis_db(tmp_path: Path) -> Iterator[RedisServer]:
    """A real redis-server with its data on disk: survives ``stop()``/``start()`` (outages)."""
    if REDIS_SERVER is None:
        pytest.skip("redis-server not installed")
    (tmp_path / "redis").mkdir()
    server = RedisServer(data=tmp_path / "redis")
    server.start()
    yield server
    server.stop()
