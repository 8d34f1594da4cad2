"""KV index states on two real vLLM CPU engines that bind their own KV-event sockets with vLLM's
default (empty) topic, as deployed: the gateway (in process, ``prefix-cache-producer`` mode
auto, the model's own tokenizer) gives each engine its own SUB socket, so the events are
attributed although no topic names the engine; every prediction it checks against the engines'
``cached_tokens`` (vLLM's last-token cap applied, block size 128 on CPU) lands within one
block, and both engines stay ``exact``."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvgate.engines.local.launcher import LocalEngine
from kvgate.engines.local.model import SERVED_NAME
from kvgate.middleware.app import KvgateApp, create_app
from kvgate.middleware.framework.composition.config import parse_config
from kvgate.plugins.prefix.events.subscriber import KvEventsSubscriber

pytestmark = pytest.mark.e2e

WORDS = ("river", "stone", "lantern", "harbor", "copper", "meadow", "signal", "orbit", "canvas",
         "thunder", "velvet", "garden", "pixel", "summit", "cobalt", "ember", "glacier", "prism")


@contextlib.asynccontextmanager
async def _gateway(engines: list[LocalEngine], model: Path
                   ) -> AsyncIterator[tuple[KvgateApp, httpx.AsyncClient]]:
    config: dict[str, Any] = {
        "pool": {"health_interval_s": 0.5, "metrics_interval_s": 0.5},
        "engines": [{"name": e.name, "url": e.url, "kv_events": e.kv_events} for e in engines],
        "plugins": [
            {"type": "tokenizer", "params": {"tokenizer": {"kind": "hf",
                                                            "model_dir": str(model)}}},
            {"type": "kv-events", "params": {"silence_s": 30}},  # CPU steps take seconds
            {"type": "prefix-cache-producer", "params": {"mode": "auto"}},
            {"type": "health-filter"}, {"type": "model-filter"},
            {"type": "prefix-cache-scorer"}, {"type": "least-in-flight-scorer"},
            {"type": "max-score-picker"},
        ],
        "profiles": [{"name": "default", "plugins": [
            {"ref": "health-filter"}, {"ref": "model-filter"},
            {"ref": "prefix-cache-scorer", "weight": 3},
            {"ref": "least-in-flight-scorer", "weight": 1}, {"ref": "max-score-picker"}]}],
    }
    app = create_app(parse_config(config, "e2e"))
    async with app.running(), httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                                base_url="http://gw", timeout=300) as client:
        yield app, client


def _chat(doc: int, turn: int) -> dict[str, Any]:
    rng = random.Random(doc)
    text = " ".join(rng.choice(WORDS) for _ in range(500))
    return {"model": SERVED_NAME, "max_tokens": 4, "messages": [
        {"role": "system", "content": f"Document {doc}: {text}"},
        {"role": "user", "content": f"Question {turn}: what is the {WORDS[turn]}?"}]}


async def _warm_up(engines: list[LocalEngine], sub: KvEventsSubscriber) -> None:
    """A PUB drops what it sends before our subscription arrives: new prompts straight to each
    engine until one of its events got through."""
    for engine in engines:
        async with httpx.AsyncClient(base_url=engine.url, timeout=300) as c:
            for i in range(20):
                body = {"model": SERVED_NAME, "max_tokens": 1,
                        "prompt": f"warm up {engine.name} {i} " + "word " * 300}
                assert (await c.post("/v1/completions", json=body)).status_code == 200
                await asyncio.sleep(0.5)
                if sub.health_state.last_event(engine.name) is not None:
                    break
            else:
                raise AssertionError(f"no KV events from {engine.name}")


async def test_predictions_on_real_engines_with_vllms_empty_topic(
        bind_fleet: list[LocalEngine], tiny_model: Path) -> None:
    async with _gateway(bind_fleet, tiny_model) as (app, client):
        sub = app.pipeline.plugins["kv-events"]
        assert isinstance(sub, KvEventsSubscriber)
        await _warm_up(bind_fleet, sub)
        cached = 0
        for turn in range(3):
            for doc in range(3):
                resp = await client.post("/v1/chat/completions", json=_chat(doc, turn))
                assert resp.status_code == 200
                cached += resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] or 0
        assert cached > 0  # later turns hit the documents' blocks
        assert sub.stats.unknown_topics == 0
        health = (await client.get("/health")).json()["plugins"]["kv-events"]["engines"]
        results = {e.name: sub.health_state.results(e.name) for e in bind_fleet}
        checked = sum(sum(r.values()) for r in results.values())
        within = sum(r["within_block"] for r in results.values())
        assert checked == 9, results
        assert within == checked, results
        for engine in bind_fleet:
            assert health[engine.name]["state"] == "exact", health
            assert health[engine.name]["events"] == "connect"
        assert sub.index.block_size(bind_fleet[0].name) == 128
