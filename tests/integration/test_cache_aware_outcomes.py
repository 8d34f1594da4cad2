"""The cache-aware default profile over real HTTP (uvicorn on loopback) in front of two simulated
engines publishing KV events: whatever happens to a request — answered, an engine error (retried
elsewhere, then relayed), a stream cut mid-way, the client giving up — the token-load scorer
releases every charge it made and the pool's in-flight counters return to zero."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from kvgate.engines.ports import free_port
from kvgate.engines.sim.demo import cache_aware_config, sim_config
from kvgate.engines.sim.testing import RunningSim, serve_sim
from kvgate.middleware.app import KvgateApp, create_app
from kvgate.middleware.framework.composition.config import PluginConfig
from kvgate.middleware.framework.composition.registry import Registry
from kvgate.middleware.framework.plugin import Plugin, UsageHook
from kvgate.middleware.framework.types import CycleState, Endpoint, InferenceRequest, Usage
from kvgate.plugins.load.loads import EngineLoad
from kvgate.plugins.load.token_load import TokenLoadScorer
from tests.servers import serve_asgi

CHAT = {"model": "sim-model", "max_tokens": 6, "ignore_eos": True,
        "messages": [{"role": "user", "content": "tell me about rivers " * 40}]}


class FailingUsage(Plugin, UsageHook):
    """A usage hook that raises (like a billing ledger that cannot write)."""

    type_name = "failing-usage-hook"

    async def on_usage(self, req: InferenceRequest, state: CycleState, target: Endpoint,
                       usage: Usage) -> None:
        raise ValueError("usage hook failed")


def _app(urls: list[str], events: str, failing_usage_hook: bool) -> KvgateApp:
    config = cache_aware_config(urls, events)
    if not failing_usage_hook:
        return create_app(config)
    hook = PluginConfig.model_validate({"type": FailingUsage.type_name})
    config = config.model_copy(update={"plugins": (hook, *config.plugins)})
    base = Registry.from_entry_points()
    plugins: dict[str, type[Plugin]] = {**base.plugins, FailingUsage.type_name: FailingUsage}
    return create_app(config, Registry(plugins, base.engines, base.connectors))


@contextlib.asynccontextmanager
async def _stack(
    failing_usage_hook: bool = False,
) -> AsyncIterator[tuple[list[RunningSim], KvgateApp, str]]:
    events = f"tcp://127.0.0.1:{free_port()}"
    async with contextlib.AsyncExitStack() as stack:
        sims = [await stack.enter_async_context(serve_sim(sim_config(i, events, 0.0)))
                for i in range(2)]
        app = _app([s.url for s in sims], events, failing_usage_hook)
        url = await stack.enter_async_context(serve_asgi(app))
        yield sims, app, url


async def _until(predicate: Callable[[], bool], limit_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + limit_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "not released in time"
        await asyncio.sleep(0.02)


async def _send(client: httpx.AsyncClient, stream: bool) -> int | str:
    """Status code, or the name of the exception the client saw."""
    body = {**CHAT, "stream": stream}
    try:
        if not stream:
            return (await client.post("/v1/chat/completions", json=body)).status_code
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            async for _ in resp.aiter_lines():
                pass
            return resp.status_code
    except httpx.HTTPError as exc:
        return type(exc).__name__


#: (case, fault set on both engines, stream, client read timeout s, what the client sees,
#: dispatches)
OUTCOMES: list[tuple[str, dict[str, Any] | None, bool, float, int | str, int]] = [
    ("answered", None, False, 30.0, 200, 1),
    ("answered, streamed", None, True, 30.0, 200, 1),
    ("engine 503, retried on the other, then 502", {"fail_next": 1}, False, 30.0, 502, 2),
    ("engine 400, relayed", {"fail_next": 1, "status": 400}, False, 30.0, 400, 1),
    ("stream cut mid-way", {"drop_after_chunks": 2}, True, 30.0, 200, 1),
    ("client gives up waiting", {"delay_first_byte_s": 1.5}, False, 0.3, "ReadTimeout", 1),
    ("client gives up a stream", {"delay_first_byte_s": 1.5}, True, 0.3, "ReadTimeout", 1),
]


@pytest.mark.parametrize(("case", "fault", "stream", "read_s", "seen", "dispatches"), OUTCOMES,
                         ids=[c[0] for c in OUTCOMES])
async def test_token_load_released_on_every_outcome(
    case: str, fault: dict[str, Any] | None, stream: bool, read_s: float, seen: int | str,
    dispatches: int,
) -> None:
    async with _stack() as (sims, app, url):
        scorer = app.pipeline.plugins["token-load-scorer"]
        assert isinstance(scorer, TokenLoadScorer)
        async with httpx.AsyncClient(timeout=30.0) as admin:
            for sim in sims if fault is not None else []:
                assert (await admin.post(sim.url + "/sim/faults", json=fault)).is_success
        # only reading the answer may time out (connecting on a loaded machine must not)
        timeout = httpx.Timeout(30.0, read=read_s)
        async with httpx.AsyncClient(base_url=url, timeout=timeout) as client:
            assert await _send(client, stream) == seen
        stats = scorer.tracker.stats
        await _until(lambda: len(scorer.tracker) == 0 and stats.charged == dispatches)
        await _until(lambda: all(ep.in_flight_requests == 0 for ep in app.pool.snapshot()))
        assert stats.released == dispatches and stats.swept == stats.evicted == 0
        assert all(scorer.tracker.load(ep.id) == EngineLoad() for ep in app.pool.snapshot())


@pytest.mark.parametrize("stream", [False, True])
async def test_a_failing_usage_hook_does_not_leak_token_load(stream: bool) -> None:
    """A usage hook that raises (JSON: before the answer is sent; a stream: when its usage
    chunk passes) fails the request, and the completion hooks still release its token load.
    (A completion hook that raises: tests/unit/routing_load/test_gateway_flow.py.)"""
    async with _stack(failing_usage_hook=True) as (_, app, url):
        async with httpx.AsyncClient(base_url=url, timeout=30.0) as client:
            seen = await _send(client, stream)
        # JSON: the error is answered; a stream has started, so it is cut short
        assert seen == (500 if not stream else "RemoteProtocolError")
        scorer = app.pipeline.plugins["token-load-scorer"]
        assert isinstance(scorer, TokenLoadScorer)
        await _until(lambda: scorer.tracker.stats.released == 1)
        assert scorer.tracker.stats.charged == 1 and len(scorer.tracker) == 0
