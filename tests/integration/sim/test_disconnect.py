"""A client that goes away frees its request: it leaves the batch and releases its blocks."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest

from kvgate.engines.sim.core.config import SimConfig
from kvgate.engines.sim.core.engine import SimEngine
from kvgate.engines.sim.testing import serve_sim

from .helpers import eventually, token_prompt

# Real-time steps (5.4 ms per decode step): 2,000 tokens would take ~11 s.
SLOW = SimConfig(time_scale=1.0)
BODY = {"prompt": token_prompt(300), "max_tokens": 2000, "ignore_eos": True}


async def _until_idle(engine: SimEngine) -> None:
    await eventually(lambda: not (engine.num_running or engine.num_waiting))


@pytest.mark.parametrize("events_before_leaving", [1, 5])
async def test_stream_disconnect(events_before_leaving: int) -> None:
    async with serve_sim(SLOW) as sim, httpx.AsyncClient(base_url=sim.url) as client:
        async with client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as r:
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen == events_before_leaving:
                    assert sim.engine.num_running == 1
                    assert sim.engine.scheduler.cache.used_blocks > 0
                    break
        await _until_idle(sim.engine)
        assert sim.engine.scheduler.cache.used_blocks == 0
        assert sim.engine.scheduler.stats.finished["abort"] == 1


async def test_non_streaming_disconnect() -> None:
    async with serve_sim(SLOW) as sim:
        async with httpx.AsyncClient(base_url=sim.url, timeout=0.2) as client:
            with pytest.raises(httpx.ReadTimeout):
                await client.post("/v1/completions", json=BODY)
        await _until_idle(sim.engine)
        assert sim.engine.scheduler.cache.used_blocks == 0
        assert sim.engine.scheduler.stats.finished["abort"] == 1


async def test_disconnect_while_queued() -> None:
    cfg = SimConfig(time_scale=1.0, max_num_seqs=1)
    async with serve_sim(cfg) as sim, httpx.AsyncClient(base_url=sim.url) as client:
        first = asyncio.create_task(client.post("/v1/completions", json=BODY))
        await eventually(lambda: sim.engine.num_running == 1)
        async with httpx.AsyncClient(base_url=sim.url, timeout=0.2) as impatient:
            with pytest.raises(httpx.ReadTimeout):
                await impatient.post("/v1/completions", json={**BODY, "prompt": "queued"})
        await eventually(lambda: sim.engine.num_waiting == 0)
        assert sim.engine.num_running == 1  # the first request is unaffected
        first.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await first
        await _until_idle(sim.engine)
