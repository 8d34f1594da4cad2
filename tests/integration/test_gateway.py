"""The gateway through create_app in front of in-process simulated engines: JSON and SSE, usage,
retries, every error status, mid-stream failure, and in-flight counters released."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httpx
import pytest

from kvgate.engines.sim.core.faults import FaultSpec
from kvgate.engines.sim.testing import RunningSim
from kvgate.middleware.app import KvgateApp, create_app
from kvgate.middleware.framework.composition.config import parse_config
from tests.integration.billing_helpers import sse_events
from tests.integration.conftest import gateway, gateway_config, sim_fleet

Gw = tuple[KvgateApp, httpx.AsyncClient]
CHAT: dict[str, Any] = {"model": "sim-model", "max_tokens": 5,
                        "messages": [{"role": "user", "content": "hello there"}]}


def _in_flight(app: KvgateApp) -> list[int]:
    return [ep.in_flight_requests for ep in app.pool.snapshot()]


async def test_chat_json(gw: Gw) -> None:
    app, client = gw
    resp = await client.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": "abc"})
    assert resp.status_code == 200
    body = resp.json()
    assert body["object"] == "chat.completion"
    assert body["usage"]["completion_tokens"] == 5
    assert resp.headers["x-request-id"] == "abc"
    assert resp.headers["x-kvgate-engine"] in {"sim-0", "sim-1"}
    assert _in_flight(app) == [0, 0]


@pytest.mark.parametrize("prompt", ["once upon a time", [1, 2, 3, 4, 5], ["a prompt"]])
async def test_completions_json(gw: Gw, prompt: Any) -> None:
    _, client = gw
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": 3}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize(("include_usage", "api"), [
    (True, "chat"), (False, "chat"), (True, "completions"), (False, "completions")])
async def test_streaming_usage_chunk(gw: Gw, include_usage: bool, api: str) -> None:
    app, client = gw
    body: dict[str, Any] = {**CHAT, "stream": True} if api == "chat" else {
        "model": "sim-model", "prompt": "hi there", "max_tokens": 5, "stream": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    resp = await client.post(f"/v1/{'chat/completions' if api == 'chat' else 'completions'}",
                             json=body)
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]"
    usage_chunks = [e for e in events[:-1] if e.get("usage")]
    assert len(usage_chunks) == (1 if include_usage else 0)
    assert all("usage" not in e or e["usage"] is None for e in events[:-1]) != include_usage
    # the gateway saw the usage either way (it always asks the engine for it)
    metrics = (await client.get("/metrics")).text
    assert 'kvgate_tokens_total{kind="completion",model="sim-model"} 5.0' in metrics
    assert _in_flight(app) == [0, 0]


async def test_repeated_long_prompt_reports_cached_tokens() -> None:
    async with sim_fleet(1) as sims, gateway(gateway_config([sims[0].url])) as (_, client):
        long = {**CHAT, "messages": [{"role": "user", "content": "lorem ipsum dolor " * 200}]}
        first = (await client.post("/v1/chat/completions", json=long)).json()["usage"]
        second = (await client.post("/v1/chat/completions", json=long)).json()["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0.8 * second["prompt_tokens"]
    assert cached % sims[0].config.block_size == 0


async def test_streamed_answers_read_to_the_end_keep_their_engine_connection() -> None:
    """A session's streamed turns ride one kept-alive engine connection (a new TCP connection
    per turn cost ~3 ms of TTFT on a quiet host); a broken stream still closes its own (the
    client-gone case: tests/unit/middleware/test_h1client.py)."""
    async with sim_fleet(1) as sims, gateway(gateway_config([sims[0].url])) as (_, client):
        for _ in range(4):
            resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
            assert sse_events(resp.text)[-1] == "[DONE]"
        metrics = (await client.get("/metrics")).text
        assert 'kvgate_engine_connections_opened_total{engine="sim-0"} 1.0' in metrics
        assert 'kvgate_engine_connections{engine="sim-0",state="idle"} 1.0' in metrics
        sims[0].faults.apply(FaultSpec(drop_after_chunks=2))  # this stream breaks: closed
        broken = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert sse_events(broken.text)[-1]["error"]["code"] == "upstream_error"
        await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        metrics = (await client.get("/metrics")).text
        assert 'kvgate_engine_connections_opened_total{engine="sim-0"} 2.0' in metrics


async def test_models_health_metrics(gw: Gw) -> None:
    _, client = gw
    models = (await client.get("/v1/models")).json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["sim-model"]
    health = (await client.get("/health")).json()
    assert health["engines_healthy"] == 2
    await client.post("/v1/chat/completions", json=CHAT)
    await asyncio.sleep(0.3)  # a metrics scrape
    text = (await client.get("/metrics")).text
    for needle in ('kvgate_requests_total{api="chat",model="sim-model",status="200"} 1.0',
                   'kvgate_engine_in_flight_requests{engine="sim-0"} 0.0',
                   'kvgate_engine_healthy{engine="sim-1"} 1.0',
                   'kvgate_engine_running{engine="sim-0"}',
                   "kvgate_request_duration_seconds_bucket"):
        assert needle in text


ERRORS = [
    ("malformed json", "POST", "/v1/chat/completions", b"{nope", {}, 400, "invalid_request_error"),
    ("not an object", "POST", "/v1/chat/completions", b"[1]", {}, 400, "invalid_request_error"),
    ("missing model", "POST", "/v1/chat/completions", json.dumps({"messages": CHAT["messages"]}),
     {}, 400, "invalid_request_error"),
    ("missing messages", "POST", "/v1/chat/completions", json.dumps({"model": "sim-model"}), {},
     400, "invalid_request_error"),
    ("bad request id", "POST", "/v1/chat/completions", json.dumps(CHAT), {"x-request-id": "a b"},
     400, "invalid_request_error"),
    ("oversize", "POST", "/v1/completions",
     json.dumps({"model": "sim-model", "prompt": "x" * 5000}), {}, 413, "invalid_request_error"),
    ("unknown model", "POST", "/v1/chat/completions", json.dumps({**CHAT, "model": "gpt-9"}), {},
     404, "invalid_request_error"),
    ("wrong method", "GET", "/v1/chat/completions", None, {}, 405, "invalid_request_error"),
    ("unknown path", "GET", "/v2/nothing", None, {}, 404, "invalid_request_error"),
]


@pytest.mark.parametrize(("case", "method", "path", "body", "headers", "status", "etype"),
                         ERRORS, ids=[e[0] for e in ERRORS])
async def test_error_statuses(fleet: list[RunningSim], case: str, method: str, path: str,
                              body: Any, headers: dict[str, str], status: int, etype: str) -> None:
    data = gateway_config([s.url for s in fleet], server={"max_body_bytes": 4096})
    async with gateway(data) as (app, client):
        resp = await client.request(method, path, content=body, headers=headers)
        assert resp.status_code == status
        error = resp.json()["error"]
        assert error["type"] == etype
        assert error["message"]
        # and the gateway keeps serving
        ok = await client.post("/v1/chat/completions", json=CHAT)
        assert ok.status_code == 200
        assert _in_flight(app) == [0, 0]


async def test_no_healthy_engine_is_503(fleet: list[RunningSim]) -> None:
    async with gateway(gateway_config([s.url for s in fleet])) as (_app, client):
        for sim in fleet:
            sim.faults.apply(FaultSpec(health=False))
        await asyncio.sleep(0.4)
        resp = await client.post("/v1/chat/completions", json=CHAT)
        assert resp.status_code == 503
        assert resp.json()["error"]["code"] == "no_healthy_engine"
        assert (await client.get("/health")).status_code == 503
        for sim in fleet:
            sim.faults.apply(FaultSpec(health=True))
        await asyncio.sleep(0.4)
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
async def test_upstream_5xx_retried_on_other_engine(fleet: list[RunningSim], stream: bool) -> None:
    # round robin (its counter advances on the retry too): every request tries sim-0 first,
    # fails there (its probes pass: it answers), and is retried on sim-1, until sim-0's circuit
    # breaker opens (3 failures in a row); then requests go to sim-1 at once. No probe runs
    # during the test (30 s interval), so the breaker stays open.
    data = gateway_config([s.url for s in fleet], picker="round-robin-picker",
                          pool={"health_interval_s": 30, "metrics_interval_s": 30})
    async with gateway(data) as (app, client):
        fleet[0].faults.apply(FaultSpec(fail_next=100, status=503))
        for _ in range(5):
            resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
            assert resp.status_code == 200
            assert resp.headers["x-kvgate-engine"] == "sim-1"
        text = (await client.get("/metrics")).text
        assert 'kvgate_upstream_retries_total{engine="sim-0"} 3.0' in text
        assert 'kvgate_engine_breaker_state{engine="sim-0"} 2.0' in text
        assert _in_flight(app) == [0, 0]


async def test_both_engines_failing_gives_502(fleet: list[RunningSim]) -> None:
    async with gateway(gateway_config([s.url for s in fleet])) as (app, client):
        for sim in fleet:
            sim.faults.apply(FaultSpec(fail_next=1, status=500))
        resp = await client.post("/v1/chat/completions", json=CHAT)
        assert resp.status_code == 502
        assert resp.json()["error"]["code"] == "upstream_error"
        assert _in_flight(app) == [0, 0]


async def test_engine_4xx_relayed_not_retried(fleet: list[RunningSim]) -> None:
    async with gateway(gateway_config([s.url for s in fleet])) as (_app, client):
        fleet[0].faults.apply(FaultSpec(fail_next=1, status=400))
        fleet[1].faults.apply(FaultSpec(fail_next=1, status=400))
        resp = await client.post("/v1/chat/completions", json=CHAT)
        assert resp.status_code == 400
        assert "error" in resp.json()
        assert "kvgate_upstream_retries_total{" not in (await client.get("/metrics")).text


async def test_dead_engine_connection_refused_retried_and_marked() -> None:
    async with sim_fleet(1) as sims:
        # no startup probe: the first request itself finds sim-0 dead (round robin tries it first)
        data = gateway_config(["http://127.0.0.1:9", sims[0].url], picker="round-robin-picker",
                              pool={"startup_probe_timeout_s": 0, "health_interval_s": 30})
        async with gateway(data) as (app, client):
            for _ in range(3):
                resp = await client.post("/v1/chat/completions", json=CHAT)
                assert resp.status_code == 200
                assert resp.headers["x-kvgate-engine"] == "sim-1"
            healthy = {ep.id: ep.healthy for ep in app.pool.snapshot()}
            assert healthy == {"sim-0": False, "sim-1": True}


async def test_engine_dies_mid_stream(fleet: list[RunningSim]) -> None:
    async with gateway(gateway_config([s.url for s in fleet])) as (app, client):
        for sim in fleet:
            sim.faults.apply(FaultSpec(drop_after_chunks=2))
        body = {**CHAT, "max_tokens": 20, "stream": True}
        resp = await client.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200
        events = sse_events(resp.text)
        assert "[DONE]" not in events
        assert events[-1]["error"]["code"] == "upstream_error"
        assert len(events) == 3
        ok = await client.post("/v1/chat/completions", json=body)
        assert sse_events(ok.text)[-1] == "[DONE]"
        assert 'stage="mid_stream"' in (await client.get("/metrics")).text
        assert _in_flight(app) == [0, 0]


async def test_authorization_never_logged(fleet: list[RunningSim],
                                          caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    secret = "sk-live-SECRET-1234"
    async with gateway(gateway_config([s.url for s in fleet])) as (_, client):
        for sim in fleet:
            sim.faults.apply(FaultSpec(fail_next=1, status=500))
        for body in (CHAT, {"model": "x"}, CHAT):
            await client.post("/v1/chat/completions", json=body,
                              headers={"authorization": f"Bearer {secret}"})
    assert "retrying" in caplog.text  # something was logged on the error path
    assert secret not in caplog.text


async def test_discovered_models_reach_the_model_set_and_the_snapshot() -> None:
    """Engines without configured models: ``/v1/models`` discovery fills the pool's model set
    (kept between requests, rebuilt when discovery changes it: it was read empty before) and
    the endpoint snapshot; each model is served by the engine that lists it, another is a 404."""
    async with sim_fleet(1, served_model_names=["model-a"]) as a, \
            sim_fleet(1, served_model_names=["model-b"]) as b:
        app = create_app(parse_config(gateway_config([a[0].url, b[0].url]), "test"))
        assert app.pool.models() == frozenset()  # nothing configured, nothing discovered yet
        async with app.running():
            assert app.pool.models() == {"model-a", "model-b"}
            assert {ep.id: ep.models for ep in app.pool.snapshot()} == {
                "sim-0": {"model-a"}, "sim-1": {"model-b"}}
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
                for model, engine in (("model-a", "sim-0"), ("model-b", "sim-1")):
                    r = await client.post("/v1/chat/completions", json={**CHAT, "model": model})
                    assert (r.status_code, r.headers["x-kvgate-engine"]) == (200, engine)
                r = await client.post("/v1/chat/completions", json={**CHAT, "model": "model-c"})
                assert r.status_code == 404
