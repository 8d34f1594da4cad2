"""The cache-aware default profile through the gateway, with simulated engines publishing real
ZMQ KV events to the gateway's subscriber: repeated prefixes go where they are cached."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx

from kvgate.engines.ports import free_port
from kvgate.engines.sim.demo import cache_aware_config, sim_config
from kvgate.engines.sim.testing import RunningSim, serve_sim
from kvgate.middleware.app import KvgateApp, create_app


@contextlib.asynccontextmanager
async def _fleet_and_gateway(
    count: int,
) -> AsyncIterator[tuple[list[RunningSim], KvgateApp, httpx.AsyncClient]]:
    events = f"tcp://127.0.0.1:{free_port()}"
    async with contextlib.AsyncExitStack() as stack:
        sims = [await stack.enter_async_context(serve_sim(sim_config(i, events, 0.0)))
                for i in range(count)]
        app = create_app(cache_aware_config([s.url for s in sims], events))
        await stack.enter_async_context(app.running())
        client = await stack.enter_async_context(httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=30))
        yield sims, app, client


def _chat(topic: int, turn: int) -> dict[str, Any]:
    system = f"You are assistant number {topic}. " + f"topic {topic} context words " * 150
    return {"model": "sim-model", "max_tokens": 4, "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": f"question {turn}"}]}


async def _events_applied(app: KvgateApp) -> float:
    text = app.metrics.render().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kvgate_kv_events_applied_total"))


async def test_repeated_prefixes_follow_the_cache() -> None:
    async with _fleet_and_gateway(3) as (_, app, client):
        first: dict[int, str] = {}
        for topic in range(6):
            resp = await client.post("/v1/chat/completions", json=_chat(topic, 0))
            assert resp.status_code == 200
            first[topic] = resp.headers["x-kvgate-engine"]
        # the engines' BlockStored events reach the gateway's index (a ZMQ PUB drops what it
        # sends before its connection is up: on a loaded host the first requests' events can
        # be lost, so another prompt is sent every second until one arrives)
        for attempt in range(200):
            if await _events_applied(app) > 0:
                break
            if attempt % 20 == 19:
                probe = await client.post("/v1/chat/completions", json=_chat(100 + attempt, 0))
                assert probe.status_code == 200
            await asyncio.sleep(0.05)
        assert await _events_applied(app) > 0
        assert len(set(first.values())) > 1  # load spread the cold prefixes
        cached = prompt = 0
        for turn in (1, 2):
            for topic in range(6):
                resp = await client.post("/v1/chat/completions", json=_chat(topic, turn))
                assert resp.headers["x-kvgate-engine"] == first[topic]
                usage = resp.json()["usage"]
                cached += usage["prompt_tokens_details"]["cached_tokens"]
                prompt += usage["prompt_tokens"]
        assert cached / prompt > 0.8


async def test_session_header_echoed_and_sticky() -> None:
    async with _fleet_and_gateway(3) as (_, _app, client):
        engines = set()
        for turn in range(4):
            body = {"model": "sim-model", "max_tokens": 2,
                    "messages": [{"role": "user", "content": f"short {turn}"}]}
            resp = await client.post("/v1/chat/completions", json=body,
                                     headers={"x-session-affinity": "ses_abc123"})
            assert resp.status_code == 200
            assert resp.headers["x-session-affinity"] == "ses_abc123"
            engines.add(resp.headers["x-kvgate-engine"])
        assert len(engines) == 1
        bad = await client.post("/v1/chat/completions", json=body,
                                headers={"x-session-affinity": "x" * 300})
        assert bad.status_code == 400
