"""A client that goes away cancels the upstream request; counters are released."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp
import pytest

from kvgate.middleware.cli import HTTP_FRONTS
from tests.integration.conftest import gateway_config, serve_gateway, sim_fleet


async def _wait(predicate: Callable[[], bool], limit_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + limit_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("front", sorted(HTTP_FRONTS))
@pytest.mark.parametrize("stream", [True, False])
async def test_client_disconnect_aborts_engine_request(stream: bool, front: str) -> None:
    """Through both HTTP fronts of ``kvgate serve``: kvgate's own tells the dispatcher of the
    disconnect by callback (middleware/transport/asgi.py ``DisconnectSource``), uvicorn's through
    ``receive``."""
    # time_scale 1: a 2,000-token answer takes ~10 s on the simulated H100, so it is still
    # running when the client goes away
    async with sim_fleet(1, time_scale=1.0) as sims, \
            serve_gateway(gateway_config([sims[0].url]), HTTP_FRONTS[front]) as (app, url):
        engine = sims[0].engine
        body = {"model": "sim-model", "max_tokens": 2000, "stream": stream,
                "ignore_eos": True, "messages": [{"role": "user", "content": "go on"}]}
        async with aiohttp.ClientSession() as session:
            if stream:
                resp = await session.post(url + "/v1/chat/completions", json=body)
                assert resp.status == 200
                first = await resp.content.readany()
                assert first.startswith(b"data: ")
                assert app.pool.snapshot()[0].in_flight_requests == 1
                resp.close()  # the client goes away mid-answer
            else:
                pending = asyncio.create_task(session.post(url + "/v1/chat/completions", json=body))
                await _wait(lambda: engine.num_running == 1)
                assert app.pool.snapshot()[0].in_flight_requests == 1
                pending.cancel()  # the client gives up before the JSON answer
                with pytest.raises(asyncio.CancelledError):
                    await pending
        await _wait(lambda: engine.num_running == 0 and engine.num_waiting == 0)
        await _wait(lambda: app.pool.snapshot()[0].in_flight_requests == 0)
        metrics = app.metrics.render().decode()
        assert 'status="499"' in metrics
