"""The catalog through the gateway: /v1/models, aliases, allow-lists; third-party models through
the real ``litellm`` library against loopback stand-ins (tests/integration/fake_providers.py):
JSON and streams, tools and structured output passed through, cached tokens from each
provider's fields, the same ledger records as self-hosted models, error mapping, retries, and
the fallback from a saturated self-hosted pool to a provider."""

from __future__ import annotations

import asyncio
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from tests.integration.billing_helpers import ledger_rows, sse_events
from tests.integration.catalog_helpers import Stack, provider_stack

# LiteLLM's own pydantic models warn at import; not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning",
                                        "ignore::DeprecationWarning")
M = Decimal(1_000_000)
RATES = {"sim-model": ("0.60", "0.10", "3.00"), "gpt-x": ("2.50", "1.25", "10.00"),
         "claude-x": ("3.00", "0.30", "15.00")}
SYSTEM = "You answer questions about foxes. " * 12


def _cost(model: str, prompt: int, cached: int | None, completion: int,
          write: int = 0) -> Decimal:
    inp, cac, out = (Decimal(r) for r in RATES[model])
    hit = cached or 0
    written = write * Decimal("3.75")  # claude-x's cache-write price
    return ((prompt - hit - write) * inp + hit * cac + written + completion * out) / M


def _chat(model: str, *, stream: bool = False, usage: bool | None = None,
          cache: bool = False, **extra: Any) -> dict[str, Any]:
    system: Any = SYSTEM
    if cache:  # Anthropic prompt caching: the prefix up to this block is cacheable
        system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    body = {"model": model, "max_tokens": 8, "stream": stream,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": "where do foxes live"}], **extra}
    if usage is not None and stream:
        body["stream_options"] = {"include_usage": usage}
    return body


async def _post(s: Stack, body: dict[str, Any], role: str = "admin") -> Any:
    return await s.client.post("/v1/chat/completions", json=body, headers=s.keys.auth(role))


async def test_models_list_and_get(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with provider_stack(tmp_path, monkeypatch, ["sim", "claude"]) as s:
        assert (await s.client.get("/v1/models")).status_code == 401
        listing = (await s.client.get("/v1/models", headers=s.keys.auth("admin"))).json()
        assert listing["object"] == "list"
        ids = [m["id"] for m in listing["data"]]
        assert ids == ["sim-model", "gpt-x", "claude-x", "claude-once", "claude-missing"]
        for card in listing["data"]:
            assert {"id", "object", "created", "owned_by"} <= set(card)
            assert card["object"] == "model"
        narrow = (await s.client.get("/v1/models", headers=s.keys.auth("narrow"))).json()
        assert [m["id"] for m in narrow["data"]] == ["sim-model", "claude-x"]
        one = await s.client.get("/v1/models/claude", headers=s.keys.auth("admin"))
        assert one.status_code == 200
        assert one.json()["id"] == "claude-x"
        assert one.json()["owned_by"] == "anthropic"
        assert one.json()["modalities"] == ["text", "image"]
        assert one.json()["pricing"]["cached_input_per_mtok"] == "0.3"
        missing = await s.client.get("/v1/models/claude-y", headers=s.keys.auth("admin"))
        assert missing.status_code == 404
        error = missing.json()["error"]
        assert error["code"] == "model_not_found"
        assert "did you mean" in error["message"] and "'claude-x'" in error["message"]


CASES = [  # (case, model asked, key, status, engine, kvgate_requests_total's model label)
    ("alias to pool", "sim", "narrow", 200, "sim-0", "sim-model"),
    ("alias to provider", "claude", "narrow", 200, "litellm:anthropic/claude-x", "claude-x"),
    ("not on allow-list", "gpt", "narrow", 403, None, "gpt-x"),
    ("unknown", "gpt-y", "admin", 404, None, "other"),
]


@pytest.mark.parametrize(("case", "model", "role", "status", "engine", "label"), CASES,
                         ids=[c[0] for c in CASES])
async def test_alias_and_allow_list(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str,
                                    model: str, role: str, status: int,
                                    engine: str | None, label: str) -> None:
    async with provider_stack(tmp_path, monkeypatch, ["sim", "claude"]) as s:
        resp = await _post(s, _chat(model), role)
        assert resp.status_code == status, resp.text
        if engine is not None:
            assert resp.headers["x-kvgate-engine"] == engine
        if status == 404:
            assert "did you mean 'gpt-x'" in resp.json()["error"]["message"]
        metrics = (await s.client.get("/metrics", headers=s.keys.auth("admin"))).text
    assert f'kvgate_requests_total{{api="chat",model="{label}",status="{status}"}} 1.0' in metrics


@pytest.mark.parametrize("stream", [False, True])
async def test_openai_provider_usage_and_ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                stream: bool) -> None:
    async with provider_stack(tmp_path, monkeypatch) as s:
        resp = await _post(s, _chat("gpt", stream=stream, usage=True))
        assert resp.status_code == 200
        rid = resp.headers["x-request-id"]
        if stream:
            assert resp.headers["content-type"].startswith("text/event-stream")
            events = sse_events(resp.text)
            assert events[-1] == "[DONE]"
            text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]
                           if isinstance(e, dict) and e["choices"])
            assert text.split() == ["the", "quick", "brown", "fox", "jumps"]
            usage = events[-2]["usage"]
            assert events[-2]["choices"] == []
        else:
            body = resp.json()
            assert body["model"] == "gpt-x"
            assert body["choices"][0]["message"]["content"] == "the quick brown fox jumps"
            usage = body["usage"]
        prompt = len(SYSTEM.split()) + 4
        assert usage["prompt_tokens"] == prompt
        assert usage["prompt_tokens_details"] == {"cached_tokens": prompt - 2}
        sent = s.openai.requests[-1]
        assert sent["body"]["model"] == "gpt-x"
        assert sent["headers"]["authorization"] == "Bearer sk-test"
        row = (await ledger_rows(s.app))[rid]
        assert (row.model, row.engine, row.outcome) == ("gpt-x", "litellm:openai/gpt-x", "done")
        assert (row.prompt_tokens, row.cached_tokens, row.completion_tokens) == (
            prompt, prompt - 2, 5)
        assert row.cached_source == "reported"
        assert row.cost_total == _cost("gpt-x", prompt, prompt - 2, 5)


async def test_openai_provider_without_cached_field(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    async with provider_stack(tmp_path, monkeypatch) as s:
        s.openai.report_cached = False
        for stream in (False, True):
            resp = await _post(s, _chat("gpt-x", stream=stream, usage=True))
            row = (await ledger_rows(s.app))[resp.headers["x-request-id"]]
            assert row.cached_tokens is None
            assert row.cached_source == "unknown"


@pytest.mark.parametrize("stream", [False, True])
async def test_anthropic_cache_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     stream: bool) -> None:
    async with provider_stack(tmp_path, monkeypatch) as s:
        first = await _post(s, _chat("claude", stream=stream, cache=True))
        second = await _post(s, _chat("claude", stream=stream, cache=True))
        assert first.status_code == second.status_code == 200
        if stream:  # the client did not ask for usage: the usage chunk is not relayed
            assert all("usage" not in e for e in sse_events(second.text) if isinstance(e, dict))
        else:
            assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == len(
                SYSTEM.split())
        sent = s.anthropic.requests[-1]
        assert sent["body"]["system"][0]["cache_control"] == {"type": "ephemeral"}
        assert sent["headers"]["x-api-key"] == "sk-test"
        rows = await ledger_rows(s.app)
        prefix, prompt = len(SYSTEM.split()), len(SYSTEM.split()) + 4
        r1, r2 = rows[first.headers["x-request-id"]], rows[second.headers["x-request-id"]]
        assert (r1.prompt_tokens, r1.cached_tokens, r1.cache_write_tokens) == (prompt, 0, prefix)
        assert r1.cost_total == _cost("claude-x", prompt, 0, 5, write=prefix)  # cache write
        assert (r2.prompt_tokens, r2.cached_tokens, r2.cache_write_tokens) == (prompt, prefix, 0)
        assert r2.cost_total == _cost("claude-x", prompt, prefix, 5)
        assert r2.engine == "litellm:anthropic/claude-x"


async def test_tools_and_response_format_pass_through(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    tool = {"type": "function", "function": {
        "name": "weather", "description": "weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "object", "properties": {"answer": {"type": "string"}}}}}
    async with provider_stack(tmp_path, monkeypatch) as s:
        for model in ("gpt-x", "claude-x"):
            resp = await _post(s, _chat(model, tools=[tool], tool_choice="auto"))
            call = resp.json()["choices"][0]["message"]["tool_calls"][0]
            assert call["function"]["name"] == "weather"
            assert call["type"] == "function"
            assert '"Paris"' in call["function"]["arguments"]
            assert resp.json()["choices"][0]["finish_reason"] == "tool_calls"
        assert s.anthropic.requests[-1]["body"]["tools"][0]["name"] == "weather"
        assert s.openai.requests[-1]["body"]["tools"] == [tool]
        resp = await _post(s, _chat("gpt-x", response_format=schema))
        assert s.openai.requests[-1]["body"]["response_format"] == schema
        assert resp.json()["choices"][0]["message"]["content"] == (
            '{"answer": "the quick brown fox jumps"}')
        streamed = await _post(s, _chat("gpt-x", stream=True, tools=[tool]))
        calls = [c for e in sse_events(streamed.text) if isinstance(e, dict) and e["choices"]
                 for c in e["choices"][0]["delta"].get("tool_calls", [])]
        assert calls[0]["function"]["name"] == "weather"


ERRORS = [("bad request", "claude-once", 400, 400, "invalid_request_error"),
          ("provider auth", "claude-once", 401, 401, "authentication_error"),
          ("rate limited", "claude-once", 429, 429, "rate_limit_error"),
          ("server error", "claude-once", 500, 502, "server_error"),
          ("overloaded", "claude-once", 529, 502, "server_error"),
          ("unknown model", "claude-missing", None, 404, "invalid_request_error")]


@pytest.mark.parametrize(("case", "model", "injected", "status", "kind"), ERRORS,
                         ids=[e[0] for e in ERRORS])
async def test_provider_errors_mapped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str,
                                      model: str, injected: int | None, status: int,
                                      kind: str) -> None:
    async with provider_stack(tmp_path, monkeypatch) as s:
        if injected is not None:
            s.anthropic.fail(1, injected)
        resp = await _post(s, _chat(model))
        assert resp.status_code == status, resp.text
        assert resp.json()["error"]["type"] == kind
        assert "sk-test" not in resp.text
        row = (await ledger_rows(s.app))[resp.headers["x-request-id"]]
        assert (row.outcome, row.status, row.prompt_tokens) == ("upstream_error", status, 0)


@pytest.mark.parametrize("stream", [False, True])
async def test_retries_on_the_same_provider(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            stream: bool) -> None:
    async with provider_stack(tmp_path, monkeypatch) as s:
        s.anthropic.fail(1, 529)  # claude-x has retries: 1
        resp = await _post(s, _chat("claude-x", stream=stream))
        assert resp.status_code == 200
        assert len(s.anthropic.requests) == 2
        s.anthropic.fail(2, 429)
        resp = await _post(s, _chat("claude-x", stream=stream))
        assert resp.status_code == 429
        assert len(s.anthropic.requests) == 4


@pytest.mark.parametrize("stream", [False, True])
async def test_fallback_from_saturated_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            stream: bool) -> None:
    async with provider_stack(tmp_path, monkeypatch) as s:
        ok = await _post(s, _chat("sim", stream=stream, usage=True))
        assert ok.headers["x-kvgate-engine"] == "sim-0"
        s.sim.faults.fail_next, s.sim.faults.status = 5, 429  # the pool is saturated
        resp = await _post(s, _chat("sim", stream=stream, usage=True))
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-kvgate-engine"] == "litellm:openai/gpt-x"
        assert s.openai.requests[-1]["body"]["model"] == "gpt-x"
        rows = await ledger_rows(s.app)
        row = rows[resp.headers["x-request-id"]]
        assert (row.model, row.engine, row.outcome) == ("gpt-x", "litellm:openai/gpt-x", "done")
        assert row.cost_total == _cost("gpt-x", row.prompt_tokens, row.cached_tokens, 5)
        assert rows[ok.headers["x-request-id"]].model == "sim-model"


async def test_provider_stream_broken_midway(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    async with provider_stack(tmp_path, monkeypatch) as s:
        s.openai.drop_after = 2
        resp = await _post(s, _chat("gpt-x", stream=True))
        assert resp.status_code == 200
        events = sse_events(resp.text)
        assert "[DONE]" not in events
        assert "provider stream broke" in events[-1]["error"]["message"]
        row = (await ledger_rows(s.app))[resp.headers["x-request-id"]]
        assert (row.outcome, row.engine) == ("upstream_error", "litellm:openai/gpt-x")
        assert row.completion_tokens == 2  # the events relayed before the break


async def test_fallback_when_pool_is_down(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with provider_stack(tmp_path, monkeypatch) as s:
        s.sim.faults.health = False  # the probe takes the only engine out of rotation
        for _ in range(100):
            if not any(ep.healthy for ep in s.app.pool.snapshot()):
                break
            await asyncio.sleep(0.02)
        resp = await _post(s, _chat("sim"))
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-kvgate-engine"] == "litellm:openai/gpt-x"


async def test_no_fallback_on_client_errors(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    async with provider_stack(tmp_path, monkeypatch) as s:
        s.sim.faults.fail_next, s.sim.faults.status = 1, 400  # the engine refuses the request
        resp = await _post(s, _chat("sim"))
        assert resp.status_code == 400
        assert s.openai.requests == []  # 400 is not in fallback_on: the provider is not tried


async def test_client_gone_closes_provider_stream(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    async with provider_stack(tmp_path, monkeypatch, served=True) as s:
        s.openai.chunk_delay_s = 0.5  # ~3 s of answer: still streaming when the client leaves
        body = _chat("gpt-x", stream=True)
        async with s.client.stream("POST", "/v1/chat/completions", json=body,
                                   headers=s.keys.auth("admin")) as resp:
            rid = resp.headers["x-request-id"]
            async for part in resp.aiter_bytes():
                assert part.startswith(b"data: ")
                break
            assert s.openai.streams_open == 1
        for _ in range(50):  # the client is gone: kvgate closes the provider stream at once
            if s.openai.streams_open == 0:
                break
            await asyncio.sleep(0.02)
        assert s.openai.streams_open == 0
        row = (await ledger_rows(s.app))[rid]
        assert (row.outcome, row.engine) == ("client_disconnect", "litellm:openai/gpt-x")
        assert 'status="499"' in s.app.metrics.render().decode()


async def test_provider_models_in_metrics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with provider_stack(tmp_path, monkeypatch) as s:
        await _post(s, _chat("claude-x", stream=True, usage=True))
        metrics = (await s.client.get("/metrics", headers=s.keys.auth("admin"))).text
        assert 'kvgate_requests_total{api="chat",model="claude-x",status="200"} 1.0' in metrics
        assert 'kvgate_tokens_total{kind="cached",model="claude-x"}' in metrics


@pytest.mark.parametrize(("path", "body", "shape"), [
    ("/v1/messages", {"model": "claude-x", "max_tokens": 8,
                      "messages": [{"role": "user", "content": "hi"}]}, "anthropic"),
    ("/v1/responses", {"model": "gpt-x", "input": "hi"}, "openai"),
    ("/v1/completions", {"model": "gpt-x", "prompt": "hi", "max_tokens": 8}, "openai"),
])
async def test_provider_models_name_the_api_they_lack(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str, body: dict[str, Any],
        shape: str) -> None:
    """A provider model asked through an API its LiteLLM bridge does not speak: a 400 in that
    API's own shape naming the model and what is supported."""
    async with provider_stack(tmp_path, monkeypatch) as s:
        resp = await s.client.post(path, json=body, headers=s.keys.auth("admin"))
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert body["model"] in err["message"] and "/v1/chat/completions" in err["message"]
        assert (resp.json().get("type") == "error") is (shape == "anthropic")
