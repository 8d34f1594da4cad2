"""The simulator's HTTP API through httpx: shapes, streaming, usage, cached tokens, errors."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from kvgate.engines.sim.core.config import SimConfig
from kvgate.engines.sim.core.tokenizer import chat_token_ids
from kvgate.engines.sim.http.app import sim_handles
from kvgate.engines.sim.http.server import create_sim_app
from kvgate.engines.sim.testing import serve_sim
from kvgate.engines.vllm import VllmAdapter

from .helpers import DONE, long_text, sse_events, stream_text, token_prompt

FAST = SimConfig(time_scale=0)


def _body(api: str, prompt: Any, **kw: Any) -> dict[str, Any]:
    key = "messages" if api == "chat" else "prompt"
    value = [{"role": "user", "content": prompt}] if api == "chat" else prompt
    return {"model": "sim-model", key: value, "ignore_eos": True, **kw}


def _path(api: str) -> str:
    return "/v1/chat/completions" if api == "chat" else "/v1/completions"


def _text(api: str, payload: dict[str, Any]) -> str:
    choice = payload["choices"][0]
    return str(choice["message"]["content"] if api == "chat" else choice["text"])


@pytest.mark.parametrize("api", ["chat", "completions"])
async def test_json_answer(api: str) -> None:
    async with serve_sim(FAST) as sim, httpx.AsyncClient(base_url=sim.url) as client:
        resp = await client.post(_path(api), json=_body(api, "Hello there!", max_tokens=7),
                                 headers={"x-request-id": "req-1"})
    assert resp.status_code == 200
    assert resp.headers["x-request-id"] == "req-1"
    payload = resp.json()
    assert payload["object"] == ("chat.completion" if api == "chat" else "text_completion")
    assert payload["id"].endswith("req-1")
    prompt_tokens = payload["usage"]["prompt_tokens"]
    if api == "chat":
        assert prompt_tokens == len(chat_token_ids([{"role": "user", "content": "Hello there!"}]))
    assert payload["usage"] == {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + 7,
                                "completion_tokens": 7,
                                "prompt_tokens_details": {"cached_tokens": 0}}
    assert payload["choices"][0]["finish_reason"] == "length"
    assert len(_text(api, payload).split()) == 7


@pytest.mark.parametrize("api", ["chat", "completions"])
@pytest.mark.parametrize("include_usage", [True, False])
async def test_stream(api: str, include_usage: bool) -> None:
    opts = {"stream_options": {"include_usage": True}} if include_usage else {}
    async with serve_sim(FAST) as sim, httpx.AsyncClient(base_url=sim.url) as client:
        plain = (await client.post(_path(api), json=_body(api, "same", max_tokens=5))).json()
        async with client.stream("POST", _path(api),
                                 json=_body(api, "same", max_tokens=5, stream=True, **opts)) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            events = await sse_events(r)
    assert events[-1] == DONE
    chunks = events[:-1]
    if include_usage:
        usage_chunk = chunks.pop()
        assert usage_chunk["choices"] == [] and usage_chunk["usage"] == plain["usage"]
    assert all("usage" not in c for c in chunks)
    if api == "chat":
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        chunks = chunks[1:]
    assert len(chunks) == 5
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 4 + ["length"]
    assert stream_text(chunks) == _text(api, plain)  # deterministic text


@pytest.mark.parametrize(("api", "block_size"), [("chat", 16), ("completions", 16),
                                                 ("completions", 32)])
async def test_repeated_long_prompt_hits_the_cache(api: str, block_size: int) -> None:
    prompt = long_text(400, seed=1)
    async with serve_sim(SimConfig(time_scale=0, block_size=block_size)) as sim, \
            httpx.AsyncClient(base_url=sim.url) as client:
        first = (await client.post(_path(api), json=_body(api, prompt, max_tokens=2))).json()
        second = (await client.post(_path(api), json=_body(api, prompt, max_tokens=2))).json()
        other = (await client.post(_path(api), json=_body(api, prompt, max_tokens=2,
                                                          cache_salt="tenant-b"))).json()
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and cached % block_size == 0
    assert cached == (prompt_tokens - 1) // block_size * block_size
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # salted: isolated


@pytest.mark.parametrize("stream", [False, True])
async def test_prompt_tokens_details_can_be_disabled(stream: bool) -> None:
    cfg = SimConfig(time_scale=0, enable_prompt_tokens_details=False)
    body = _body("completions", long_text(200), max_tokens=2)
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    async with serve_sim(cfg) as sim, httpx.AsyncClient(base_url=sim.url) as client:
        for _ in range(2):
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                if stream:
                    usage = (await sse_events(resp))[-2]["usage"]
                else:
                    await resp.aread()
                    usage = resp.json()["usage"]
    assert "prompt_tokens_details" not in usage
    assert usage["completion_tokens"] == 2
    assert VllmAdapter().extract_usage({"usage": usage}).cached_tokens is None  # type: ignore[union-attr]


@pytest.mark.parametrize(("path", "body", "status", "kind"), [
    ("/v1/completions", {"model": "gpt-x", "prompt": "x"}, 404, "NotFoundError"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "BadRequestError"),
    ("/v1/completions", {"prompt": [[1, 2], [3]]}, 400, "BadRequestError"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 3}, 400,
     "BadRequestError"),
    ("/v1/chat/completions", b"{not json", 400, "BadRequestError"),
])
async def test_errors(path: str, body: Any, status: int, kind: str) -> None:
    async with serve_sim(FAST) as sim, httpx.AsyncClient(base_url=sim.url) as client:
        if isinstance(body, bytes):
            resp = await client.post(path, content=body)
        else:
            resp = await client.post(path, json=body)
    assert resp.status_code == status
    error = resp.json()["error"]
    assert error["type"] == kind and error["code"] == status and error["message"]
    assert set(error) == {"message", "type", "param", "code"}


async def test_models_health_metrics() -> None:
    cfg = SimConfig(time_scale=0, served_model_names=["a", "b"], capacity_blocks=128)
    async with serve_sim(cfg) as sim, httpx.AsyncClient(base_url=sim.url) as client:
        models = (await client.get("/v1/models")).json()
        health = await client.get("/health")
        prompt = token_prompt(100)
        for _ in range(2):
            await client.post("/v1/completions", json={"model": "b", "prompt": prompt,
                                                       "max_tokens": 3})
        metrics = VllmAdapter().parse_metrics((await client.get("/metrics")).text, 0.0)
    assert [m["id"] for m in models["data"]] == ["a", "b"]
    assert models["object"] == "list" and models["data"][0]["max_model_len"] == 2048
    assert health.status_code == 200
    assert (metrics.prefix_cache_queries, metrics.prefix_cache_hits) == (200, 96)
    assert (metrics.running, metrics.waiting, metrics.kv_usage) == (0, 0, 0)


async def test_asgi_transport_without_lifespan() -> None:
    """Under httpx.ASGITransport (no lifespan) the engine starts lazily; close it explicitly."""
    app = create_sim_app(FAST)
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://sim") as client:
            resp = await client.post("/v1/completions", json=_body("completions", "hi",
                                                                    max_tokens=3))
    finally:
        await sim_handles(app).engine.aclose()
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3


async def _e2e(client: httpx.AsyncClient, seed: int) -> float:
    start = time.perf_counter()
    resp = await client.post("/v1/completions", json=_body(
        "completions", token_prompt(2000, seed), max_tokens=16))
    assert resp.status_code == 200
    return time.perf_counter() - start


async def test_concurrent_load_slows_requests_down() -> None:
    cfg = SimConfig(time_scale=0.25)
    async with serve_sim(cfg) as sim, httpx.AsyncClient(base_url=sim.url) as client:
        alone = await _e2e(client, seed=100)
        loaded = await asyncio.gather(*(_e2e(client, seed=i) for i in range(16)))
    # Modelled alone: (66 ms prefill + 15 x 5.5 ms decode) x 0.25 ≈ 37 ms.
    assert 0.025 < alone < 0.2
    # 16 prefills of 2,000 tokens share 8,192-token steps and slow each other's decodes.
    assert sum(loaded) / len(loaded) > 2 * alone
