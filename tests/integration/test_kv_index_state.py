"""The KV index states through the gateway (in-process ASGI app) in front of simulated engines
publishing real ZMQ KV events to the gateway's bound socket: a mis-set topic is loud (warning
line, ``degraded`` on /health and in /metrics), predictions agree with what the engines report,
and a tokenizer that is not the engine's degrades the engines, then falls back to the gateway's
own record, which keeps routing repeated prefixes to where they went."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import httpx
import pytest

from kvgate.engines.sim.core import tokenizer as sim_tokenizer
from kvgate.engines.sim.core.config import KvEventsConfig, SimConfig
from kvgate.engines.sim.testing import RunningSim, serve_sim
from kvgate.middleware.app import KvgateApp, create_app
from kvgate.middleware.framework.composition.config import parse_config
from kvgate.middleware.framework.composition.registry import Registry
from kvgate.middleware.framework.plugin import HealthSource, Plugin
from kvgate.plugins.prefix.events.subscriber import KvEventsSubscriber
from tests.servers import free_port

FAST_POOL = {"health_interval_s": 0.1, "metrics_interval_s": 0.1, "health_timeout_s": 1.0}


class _Doubled:
    """A wrong tokenizer: the simulator's ids, each twice (the engine counts half as many)."""

    SPECIAL_TOKENS = sim_tokenizer.SPECIAL_TOKENS

    @staticmethod
    def tokenize(text: str) -> list[int]:
        return [t for t in sim_tokenizer.tokenize(text) for _ in (0, 1)]

    @staticmethod
    def render_chat(messages: Sequence[Mapping[str, Any]],
                    add_generation_prompt: bool = True) -> str:
        return sim_tokenizer.render_chat(messages, add_generation_prompt)


DOUBLED = _Doubled()
SIM_TOKENIZER = "sim"
WRONG_TOKENIZER = f"{__name__}:DOUBLED"


def _config(urls: list[str], events: str, tokenizer: str = SIM_TOKENIZER,
            **kv_params: Any) -> dict[str, Any]:
    return {
        "pool": FAST_POOL,
        "engines": [{"name": f"sim-{i}", "url": u} for i, u in enumerate(urls)],
        "plugins": [
            {"type": "tokenizer", "params": {"tokenizer": {"kind": "module",
                                                            "module": tokenizer}}},
            {"type": "kv-events", "params": {"bind": events, "connect": False, **kv_params}},
            {"type": "prefix-cache-producer", "params": {"mode": "auto",
                                                         "fallback_after_s": 0.2}},
            {"type": "health-filter"}, {"type": "model-filter"},
            {"type": "prefix-cache-scorer"}, {"type": "least-in-flight-scorer"},
            {"type": "max-score-picker"},
        ],
        "profiles": [{"name": "default", "plugins": [
            {"ref": "health-filter"}, {"ref": "model-filter"},
            {"ref": "prefix-cache-scorer", "weight": 3},
            {"ref": "least-in-flight-scorer", "weight": 1}, {"ref": "max-score-picker"}]}],
    }


@contextlib.asynccontextmanager
async def _stack(topics: list[str], tokenizer: str = SIM_TOKENIZER, **kv_params: Any
                 ) -> AsyncIterator[tuple[list[RunningSim], KvgateApp, httpx.AsyncClient]]:
    """Sims ``sim-i`` publishing on ``topics[i]`` to the gateway's bound socket."""
    events = f"tcp://127.0.0.1:{free_port()}"
    async with contextlib.AsyncExitStack() as stack:
        sims = [await stack.enter_async_context(serve_sim(SimConfig(
            engine_id=f"sim-{i}", time_scale=0, seed=i,
            kv_events=KvEventsConfig(endpoint=events, topic=topic))))
            for i, topic in enumerate(topics)]
        app = create_app(parse_config(_config([s.url for s in sims], events, tokenizer,
                                              **kv_params), "test"))
        await stack.enter_async_context(app.running())
        client = await stack.enter_async_context(httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=30))
        yield sims, app, client


def _kv(app: KvgateApp) -> KvEventsSubscriber:
    plugin = app.pipeline.plugins["kv-events"]
    assert isinstance(plugin, KvEventsSubscriber)
    return plugin


async def _warm_up(sims: list[RunningSim], app: KvgateApp) -> None:
    """The sims connect to the gateway's SUB socket; what they publish before the subscription
    arrives is dropped: clear their caches until each one's batch got through."""
    sub = _kv(app)
    for i, sim in enumerate(sims):
        async with httpx.AsyncClient(base_url=sim.url) as c:
            for _ in range(200):
                await c.post("/reset_prefix_cache")
                await asyncio.sleep(0.02)
                if sub.health_state.last_event(f"sim-{i}") is not None:
                    break
            else:
                raise AssertionError(f"no KV events from sim-{i}")


def _chat(topic: int, turn: int) -> dict[str, Any]:
    """Topics differ from their first word on, so no two share even the first block."""
    word = "".join(chr(ord("a") + int(d)) for d in str(topic))
    system = f"{word} assistant. " + f"topic {topic} context words " * 40
    return {"model": "sim-model", "max_tokens": 2, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": f"question {turn}"}]}


async def _metric(client: httpx.AsyncClient, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    text = (await client.get("/metrics")).text
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, value = line.rsplit(" ", 1)
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


async def _engines_health(client: httpx.AsyncClient) -> dict[str, Any]:
    resp = await client.get("/health")
    assert resp.status_code == 200
    engines: dict[str, Any] = resp.json()["plugins"]["kv-events"]["engines"]
    return engines


async def _until(predicate: Any, limit_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + limit_s
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def test_mis_set_topic_on_the_bound_socket_is_loud(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    async with _stack(["kv@typo", "kv@typo"]) as (_, app, client):
        sent = 0

        async def unknown_seen() -> bool:  # new prompts: each one publishes a BlockStored
            nonlocal sent
            sent += 1
            await client.post("/v1/chat/completions", json=_chat(sent, 0))
            return _kv(app).stats.unknown_topics > 0
        await _until(unknown_seen)

        async def both_degraded() -> bool:
            engines = await _engines_health(client)
            return all(engines[f"sim-{i}"]["state"] == "degraded" for i in range(2))
        await _until(both_degraded, 3.0)  # a few seconds at most after the first message
        engines = await _engines_health(client)
        assert "'kv@typo'" in engines["sim-0"]["reason"]
        assert engines["sim-0"]["routing"] == "approximate"
        lines = [r.getMessage() for r in caplog.records]
        assert any("attributable to no engine (last topic 'kv@typo')" in m for m in lines)
        assert any("engine sim-1 exact -> degraded: unattributable" in m for m in lines)
        assert await _metric(client, "kvgate_kv_index_state", engine="sim-0",
                             state="degraded") == 1
        assert await _metric(client, "kvgate_kv_events_unknown_topics_total") >= 1


async def test_the_only_engine_on_the_bound_socket_takes_any_topic() -> None:
    async with _stack([""]) as (sims, app, client):
        await _warm_up(sims, app)
        resp = await client.post("/v1/chat/completions", json=_chat(1, 0))
        assert resp.status_code == 200
        await _until(_async(lambda: len(_kv(app).index) > 0))
        assert _kv(app).stats.unknown_topics == 0
        assert (await _engines_health(client))["sim-0"]["state"] == "exact"


def _async(predicate: Any) -> Any:
    async def check() -> bool:
        return bool(predicate())
    return check


async def test_predictions_agree_with_the_engines() -> None:
    async with _stack(["kv@sim-0", "kv@sim-1"]) as (sims, app, client):
        await _warm_up(sims, app)
        served = 0
        for turn in range(3):
            for topic in range(4):
                resp = await client.post("/v1/chat/completions", json=_chat(topic, turn))
                assert resp.status_code == 200
                served += 1
        assert await _metric(client, "kvgate_kv_predictions_total",
                             result="within_block") == served
        assert await _metric(client, "kvgate_kv_predictions_total", result="over") == 0
        assert await _metric(client, "kvgate_kv_predictions_total", result="under") == 0
        engines = await _engines_health(client)
        for name in ("sim-0", "sim-1"):
            assert engines[name]["state"] == "exact"
            assert engines[name]["routing"] == "precise"
            if engines[name]["predictions_checked"]:
                assert engines[name]["predictions_within_block"] == 1.0


async def test_wrong_tokenizer_degrades_then_falls_back_to_the_record(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    async with _stack(["kv@sim-0", "kv@sim-1"], WRONG_TOKENIZER, prediction_window=10,
                      prediction_min_checks=5) as (sims, app, client):
        await _warm_up(sims, app)
        states = _kv(app).health_state
        for i in range(100):  # new topics spread over both engines
            await client.post("/v1/chat/completions", json=_chat(100 + i // 2, i % 2))
            if all(states.state(f"sim-{e}") != "exact" for e in range(2)):
                break

        async def fallen_back() -> bool:
            engines = await _engines_health(client)
            return all(engines[f"sim-{e}"]["state"] == "approximate" for e in range(2))
        await _until(fallen_back)
        engines = await _engines_health(client)
        assert "token ids are not the engine's" in engines["sim-0"]["reason"]
        assert engines["sim-0"]["reason"].startswith("fallen back to the gateway's record")
        lines = [r.getMessage() for r in caplog.records]
        assert any("engine sim-0 exact -> degraded: token ids are not the engine's" in m
                   for m in lines)
        assert any("engine sim-0 degraded -> approximate" in m for m in lines)
        assert await _metric(client, "kvgate_kv_index_state", state="approximate") == 2
        # the gateway's record still sends a repeated prefix where it went
        first = await client.post("/v1/chat/completions", json=_chat(9, 0))
        for turn in (1, 2):
            again = await client.post("/v1/chat/completions", json=_chat(9, turn))
            assert again.headers["x-kvgate-engine"] == first.headers["x-kvgate-engine"]


class _Sections(Plugin, HealthSource):
    """A HealthSource whose section depends on its name: ``broken`` raises, ``quiet`` is empty."""

    type_name = "test-health-sections"

    def health(self) -> Mapping[str, object]:
        if self.name == "broken":
            raise RuntimeError("bug in a plugin")
        return {} if self.name == "quiet" else {"answer": 42}


async def test_plugin_health_sections_never_break_health(
        caplog: pytest.LogCaptureFixture) -> None:
    base = Registry.from_entry_points()
    registry = Registry({**base.plugins, _Sections.type_name: _Sections}, base.engines,
                        base.connectors)
    async with serve_sim(SimConfig(time_scale=0)) as sim:
        data = _config([sim.url], f"tcp://127.0.0.1:{free_port()}")
        data["plugins"] = [*data["plugins"], *({"type": _Sections.type_name, "name": n}
                                               for n in ("broken", "quiet", "fine"))]
        app = create_app(parse_config(data, "test"), registry)
        async with app.running(), httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
            resp = await client.get("/health")
    assert resp.status_code == 200
    sections = resp.json()["plugins"]
    assert sections["broken"] == {"error": "health() failed; see the gateway log"}
    assert sections["fine"] == {"answer": 42}
    assert "quiet" not in sections
    assert sections["kv-events"]["engines"]["sim-0"]["state"] == "exact"
    assert "plugin 'broken': health() failed" in caplog.text
