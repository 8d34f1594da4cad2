"""A burst of requests sharing a new prefix, through the cache-aware profile, in front of two
simulated engines publishing KV events. The engines hold every request 0.5 s before running it
(fault ``delay_first_byte_s``), so the whole burst (6 requests over ~25 ms) is routed before the
first request's ``BlockStored`` can arrive. Speculative entries let placement see the prefix the
first request is computing (its decisions are no longer all "cold"), and the burst follows it:
the prefix is computed once and reused five times, since the queue it waits behind (six
~2.1k-token prompts) is far below the saturation point (``load_weight`` 0.02: a queue worth
fifty times the prefix held). Without speculation the burst is placed blind, as cold work spread by
pressure over both engines, each computing the prefix."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
import pytest

from kvgate.engines.ports import free_port
from kvgate.engines.sim.demo import cache_aware_config, sim_config
from kvgate.engines.sim.testing import serve_sim
from kvgate.middleware.app import create_app
from kvgate.middleware.framework.composition.config import GatewayConfig

SYSTEM = "You are the archivist of the northern library. " + "shelf ledger entry " * 700
BURST = 6
STAGGER_S = 0.004
ENGINE_DELAY_S = 0.5


def _config(urls: list[str], events: str, speculative_ttl_s: float) -> GatewayConfig:
    config = cache_aware_config(urls, events)
    plugins = tuple(
        p.model_copy(update={"params": {**p.params, "speculative_ttl_s": speculative_ttl_s}})
        if p.type == "prefix-cache-producer" else p
        for p in config.plugins
    )
    return config.model_copy(update={"plugins": plugins})


@contextlib.asynccontextmanager
async def _gateway(speculative_ttl_s: float) -> AsyncIterator[httpx.AsyncClient]:
    events = f"tcp://127.0.0.1:{free_port()}"
    async with contextlib.AsyncExitStack() as stack:
        sims = [await stack.enter_async_context(serve_sim(sim_config(i, events, 0.0)))
                for i in range(2)]
        async with httpx.AsyncClient() as admin:
            for sim in sims:
                fault = {"delay_first_byte_s": ENGINE_DELAY_S}
                assert (await admin.post(sim.url + "/sim/faults", json=fault)).is_success
        app = create_app(_config([s.url for s in sims], events, speculative_ttl_s))
        await stack.enter_async_context(app.running())
        yield await stack.enter_async_context(httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=30))


def _decisions(metrics: str) -> dict[str, float]:
    out = {}
    for line in metrics.splitlines():
        if line.startswith("kvgate_placement_decisions_total{"):
            kind = line.split('kind="', 1)[1].split('"', 1)[0]
            out[kind] = float(line.rsplit(" ", 1)[1])
    return out


async def _one(client: httpx.AsyncClient, i: int) -> str:
    await asyncio.sleep(i * STAGGER_S)
    body = {"model": "sim-model", "max_tokens": 2, "messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": f"question {i}"}]}
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp.headers["x-kvgate-engine"]


@pytest.mark.parametrize(("speculative_ttl_s", "seen"), [(2.0, True), (0.0, False)])
async def test_burst_of_a_new_prefix_is_placed_knowing_the_first_request(
    speculative_ttl_s: float, seen: bool
) -> None:
    async with _gateway(speculative_ttl_s) as client:
        placed = await asyncio.gather(*(_one(client, i) for i in range(BURST)))
        decisions = _decisions((await client.get("/metrics")).text)
    # seen: one engine computes the prefix once; blind: spread as cold work, computed twice
    assert len(set(placed)) == (1 if seen else 2), placed
    assert sum(decisions.values()) == BURST
    assert (decisions["cold"] < BURST) is seen, decisions
