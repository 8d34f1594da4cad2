"""Fault injection over real HTTP (uvicorn on loopback)."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from kvgate.engines.sim.core.config import SimConfig
from kvgate.engines.sim.testing import serve_sim

from .helpers import DONE, sse_events

FAST = SimConfig(time_scale=0)
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "ignore_eos": True}


@pytest.mark.parametrize(("fault", "statuses"), [
    ({"fail_next": 2}, [503, 503, 200]),
    ({"fail_next": 1, "status": 500}, [500, 200, 200]),
    ({"fail_next": 1, "status": 429}, [429, 200]),
])
async def test_fail_next(fault: dict[str, Any], statuses: list[int]) -> None:
    async with serve_sim(FAST) as sim, httpx.AsyncClient(base_url=sim.url) as client:
        assert (await client.post("/sim/faults", json=fault)).status_code == 200
        answers = [await client.post("/v1/chat/completions", json=CHAT) for _ in statuses]
    assert [a.status_code for a in answers] == statuses
    failed = answers[0].json()["error"]
    assert failed["code"] == statuses[0] and "fault injection" in failed["message"]
    assert sim.engine.scheduler.stats.finished["length"] == statuses.count(200)


async def _collect(client: httpx.AsyncClient, body: dict[str, Any], into: list[str]) -> None:
    """Stream a chat completion, appending each ``data:`` line as it arrives."""
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                into.append(line)


@pytest.mark.parametrize(("drop_after", "include_usage"), [(0, False), (3, False), (9, True)])
async def test_drop_mid_stream(drop_after: int, include_usage: bool) -> None:
    body = {**CHAT, "stream": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    received: list[str] = []
    async with serve_sim(FAST) as sim, httpx.AsyncClient(base_url=sim.url) as client:
        await client.post("/sim/faults", json={"drop_after_chunks": drop_after})
        with pytest.raises(httpx.RemoteProtocolError):
            await _collect(client, body, received)
        # Armed for one stream only: the next one is whole.
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            whole = await sse_events(resp)
        assert sim.engine.num_running == 0 and sim.engine.scheduler.cache.used_blocks == 0
    assert len(received) == drop_after
    assert all(DONE not in line for line in received)
    assert whole[-1] == DONE and len(whole) == 1 + 8 + int(include_usage) + 1


async def test_delay_first_byte_until_cleared() -> None:
    async with serve_sim(FAST) as sim, httpx.AsyncClient(base_url=sim.url) as client:
        await client.post("/sim/faults", json={"delay_first_byte_s": 0.3})
        start = time.perf_counter()
        slow = await client.post("/v1/chat/completions", json=CHAT)
        slow_s = time.perf_counter() - start
        await client.delete("/sim/faults")
        start = time.perf_counter()
        fast = await client.post("/v1/chat/completions", json=CHAT)
        fast_s = time.perf_counter() - start
    assert slow.status_code == fast.status_code == 200
    assert slow_s >= 0.3 > fast_s


async def test_health_toggle_and_state() -> None:
    async with serve_sim(FAST) as sim, httpx.AsyncClient(base_url=sim.url) as client:
        state = (await client.post("/sim/faults", json={"health": False, "fail_next": 1})).json()
        down = await client.get("/health")
        assert (await client.get("/sim/faults")).json() == state
        cleared = (await client.delete("/sim/faults")).json()
        up = await client.get("/health")
        bad = await client.post("/sim/faults", json={"explode": True})
    assert state["health"] is False and state["fail_next"] == 1
    assert (down.status_code, up.status_code) == (503, 200)
    assert cleared["health"] is True and cleared["fail_next"] == 0
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "BadRequestError"
