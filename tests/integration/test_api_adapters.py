"""One request path for every API, through the real app (in-process ASGI) and simulated engines:
the pooling passthroughs, errors in each adapter's shape, state-id routing with by-id routes
(a stub Responses-like adapter), and the client's bytes forwarded unchanged."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import httpx
import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvgate.apis.openai import ChatCompletions, check_common
from kvgate.engines.sim.testing import RunningSim
from kvgate.middleware.app import KvgateApp, create_app
from kvgate.middleware.framework.api import ParsedRequest, SseEvent
from kvgate.middleware.framework.composition.config import parse_config
from kvgate.middleware.framework.composition.registry import Registry, load_apis
from kvgate.middleware.framework.errors import HTTPError
from kvgate.middleware.framework.plugin import CompletionHook, Plugin, UsageHook
from kvgate.middleware.framework.types import (
    CycleState,
    Endpoint,
    InferenceRequest,
    Outcome,
    TextPrompt,
    Usage,
)
from tests.integration.billing_helpers import billing_config, ledger_list, write_keys
from tests.integration.conftest import gateway, gateway_config, serve_gateway, sim_fleet
from tests.servers import serve_asgi

CHAT = {"model": "sim-model", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


class Recorder(Plugin, UsageHook, CompletionHook):
    """Records what the dispatcher hands the hooks, per request."""

    type_name = "recorder"
    seen: ClassVar[list[tuple[str, bool, Usage | None, int]]] = []

    async def on_usage(self, req: InferenceRequest, state: CycleState, target: Endpoint,
                       usage: Usage) -> None:
        self.seen.append((req.api_name, req.billed, usage, -1))

    async def on_complete(self, req: InferenceRequest, state: CycleState, target: Endpoint,
                          outcome: Outcome) -> None:
        self.seen.append((req.api_name, req.billed, outcome.usage, outcome.status))


class StubTap:
    """A Responses-shaped tap: usage from ``input_tokens``/``output_tokens``, the answer's id."""

    markers: ClassVar[tuple[bytes, ...]] = (b'"usage"',)

    def __init__(self) -> None:
        self.usage: Usage | None = None
        self.final = False
        self.state_ids: list[str] = []

    def on_json(self, payload: dict[str, Any]) -> None:
        usage = payload.get("usage") or {}
        cached = (usage.get("input_tokens_details") or {}).get("cached_tokens")
        self.usage = Usage(usage.get("input_tokens", 0), usage.get("output_tokens", 0), cached)
        self.final = True
        if isinstance(payload.get("id"), str):
            self.state_ids.append(payload["id"])

    def on_event(self, event: SseEvent) -> bool:
        return True


class StubResponses(ChatCompletions):
    """A Responses-like API with an Anthropic-like error shape (``stub`` errors)."""

    name: ClassVar[str] = "stub-responses"
    routes: ClassVar[tuple[tuple[str, str], ...]] = (
        ("POST", "/v1/responses"), ("GET", "/v1/responses/{id}"),
        ("POST", "/v1/responses/{id}/cancel"))
    disaggregable: ClassVar[bool] = False

    def parse(self, data: dict[str, Any], headers: Mapping[str, str]) -> ParsedRequest:
        model, stream, _ = check_common(data)
        prev = data.get("previous_response_id")
        return ParsedRequest(model, stream, TextPrompt(str(data.get("input"))), 10,
                             requires_state=prev if isinstance(prev, str) else None)

    def prepare_body(self, body: dict[str, Any], stream: bool) -> dict[str, Any] | None:
        return None

    def new_tap(self, client_wants_usage: bool) -> StubTap:  # type: ignore[override]
        return StubTap()

    def error_body(self, err: HTTPError) -> bytes:
        return orjson.dumps({"type": "error", "error": {"type": err.type, "message": err.message}})

    def stream_error(self, message: str) -> bytes:
        return b"event: error\ndata: " + orjson.dumps({"type": "error", "message": message}) + b"\n\n"


class StubChat(StubResponses):
    """Chat completions under another path, with the stub's error shape."""

    name: ClassVar[str] = "stub-chat"
    routes: ClassVar[tuple[tuple[str, str], ...]] = (("POST", "/v1/stub"),)

    def parse(self, data: dict[str, Any], headers: Mapping[str, str]) -> ParsedRequest:
        return ChatCompletions.parse(self, data, headers)

    def upstream_path(self, path: str) -> str:
        return "/v1/chat/completions"


def _registry() -> Registry:
    base = Registry.from_entry_points()
    apis = {k: v for k, v in load_apis().items() if k in ("chat", "completions", "embeddings",
                                                          "tokenize", "detokenize")}
    return Registry({**base.plugins, "recorder": Recorder}, base.engines, base.connectors,
                    apis={**apis, "stub-responses": StubResponses, "stub-chat": StubChat})


@contextlib.asynccontextmanager
async def _gateway(urls: list[str], **sections: Any) -> AsyncIterator[tuple[KvgateApp,
                                                                             httpx.AsyncClient]]:
    data = gateway_config(urls, **sections)
    data["plugins"].append({"type": "recorder"})
    app = create_app(parse_config(data, "test"), _registry())
    async with app.running():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=30) as c:
            yield app, c


@pytest.fixture
async def pooling() -> AsyncIterator[list[RunningSim]]:
    async with sim_fleet(1, runner="pooling") as sims:
        yield sims


POOLING = [
    # case, path, body, expected answer key, billed, usage kept
    ("embeddings", "/v1/embeddings", {"model": "sim-model", "input": ["a b c", "d"]},
     "data", True, True),
    ("tokenize", "/tokenize", {"model": "sim-model", "prompt": "hello there"}, "tokens",
     False, False),
    ("detokenize", "/detokenize", {"model": "sim-model", "tokens": [1, 2, 3]}, "prompt",
     False, False),
]


@pytest.mark.parametrize(("case", "path", "body", "key", "billed", "usage"), POOLING,
                         ids=[c[0] for c in POOLING])
async def test_pooling_apis_through_the_gateway(
    pooling: list[RunningSim], case: str, path: str, body: dict[str, Any], key: str,
    billed: bool, usage: bool,
) -> None:
    Recorder.seen.clear()
    async with _gateway([pooling[0].url]) as (_, client):
        resp = await client.post(path, json=body)
        assert resp.status_code == 200, resp.text
        assert key in resp.json() and resp.headers["x-kvgate-engine"] == "sim-0"
        metrics = (await client.get("/metrics")).text
    assert f'kvgate_requests_total{{api="{case}",model="sim-model",status="200"}} 1.0' in metrics
    done = [s for s in Recorder.seen if s[3] != -1]
    assert len(done) == 1 and done[0][:2] == (case, billed) and done[0][3] == 200
    got = done[0][2]
    if usage:
        assert got is not None and got.prompt_tokens == resp.json()["usage"]["prompt_tokens"] > 0
        assert got.completion_tokens == 0 and got.cached_tokens is None
    else:
        assert got is None


OPENAI = ("error", "message")
STUB = ("type", "error")
BIG = b'{"model": "sim-model", "messages": [{"role": "user", "content": "' + b"x" * 5000 + b'"}]}'
ERRORS = [
    # case, path, raw body, status, shape (top-level keys), param
    ("chat malformed", "/v1/chat/completions", b"{nope", 400, OPENAI, None),
    ("chat non-object", "/v1/chat/completions", b"[1]", 400, OPENAI, None),
    ("chat no model", "/v1/chat/completions", b'{"messages": []}', 400, OPENAI, "model"),
    ("chat unknown model", "/v1/chat/completions", b'{"model": "nope", "messages": '
     b'[{"role": "user", "content": "x"}]}', 404, OPENAI, "model"),
    ("chat oversized", "/v1/chat/completions", BIG, 413, OPENAI, None),
    ("embeddings no input", "/v1/embeddings", b'{"model": "sim-model"}', 400, OPENAI, "input"),
    ("tokenize stream", "/tokenize", b'{"model": "sim-model", "prompt": "a", "stream": true}',
     400, OPENAI, "stream"),
    ("detokenize bad tokens", "/detokenize", b'{"model": "sim-model", "tokens": ["a"]}', 400,
     OPENAI, "tokens"),
    ("stub malformed", "/v1/stub", b"{nope", 400, STUB, None),
    ("stub no model", "/v1/stub", b'{"messages": []}', 400, STUB, None),
    ("stub unknown model", "/v1/stub", b'{"model": "nope", "messages": '
     b'[{"role": "user", "content": "x"}]}', 404, STUB, None),
    ("stub oversized", "/v1/stub", BIG, 413, STUB, None),
    ("stub unknown id", "/v1/responses/resp_nope", b"", 404, STUB, None),
    ("no route", "/v1/nothing", b"{}", 404, OPENAI, None),
]


@pytest.mark.parametrize(("case", "path", "raw", "status", "shape", "param"), ERRORS,
                         ids=[c[0] for c in ERRORS])
async def test_errors_in_each_apis_shape(
    fleet: list[RunningSim], case: str, path: str, raw: bytes, status: int,
    shape: tuple[str, str], param: str | None,
) -> None:
    async with _gateway([s.url for s in fleet], server={"max_body_bytes": 4096}) as (_, client):
        method = "GET" if path.startswith("/v1/responses/") else "POST"
        resp = await client.request(method, path, content=raw or None,
                                    headers={"content-type": "application/json"})
    assert resp.status_code == status, resp.text
    body = resp.json()
    if shape == OPENAI:
        assert set(body) == {"error"} and body["error"]["message"]
        assert body["error"]["param"] == param
    else:
        assert body["type"] == "error" and body["error"]["message"] and body["error"]["type"]
    if path != "/v1/nothing":  # every API request's answer names its request id
        assert resp.headers["x-request-id"]


#: (case, path, fields added to a valid body the gateway passes, status, anthropic SDK exception
#: name, words of the engine's message the answer keeps). The simulator rejects them as vLLM
#: does: field types in OpenAI's validation shape, limits in its own.
ENGINE_4XX: list[tuple[str, str, dict[str, Any], int, str, str]] = [
    ("messages temperature type", "/v1/messages", {"temperature": "hot"}, 400,
     "BadRequestError", "body.temperature"),
    ("messages top_k type", "/v1/messages", {"top_k": "many"}, 400, "BadRequestError",
     "body.top_k"),
    ("messages tool_choice type", "/v1/messages", {"tool_choice": "auto"}, 400,
     "BadRequestError", "body.tool_choice"),
    ("messages max_tokens over the context", "/v1/messages", {"max_tokens": 10**6}, 400,
     "BadRequestError", "cannot be greater than max_model_len"),
    ("count_tokens tool_choice type", "/v1/messages/count_tokens", {"tool_choice": "auto"},
     400, "BadRequestError", "body.tool_choice"),
    ("chat temperature type", "/v1/chat/completions", {"temperature": "hot"}, 400, "",
     "temperature must be a number"),
    ("responses temperature type", "/v1/responses", {"temperature": "hot"}, 400, "",
     "body.temperature"),
]
_VALID: dict[str, dict[str, Any]] = {
    "/v1/messages": {"model": "sim-model", "max_tokens": 4,
                     "messages": [{"role": "user", "content": "hi"}]},
    "/v1/messages/count_tokens": {"model": "sim-model",
                                  "messages": [{"role": "user", "content": "hi"}]},
    "/v1/chat/completions": CHAT,
    "/v1/responses": {"model": "sim-model", "input": "hi", "max_output_tokens": 4},
}


@pytest.mark.parametrize(("case", "path", "extra", "status", "exc", "words"), ENGINE_4XX,
                         ids=[c[0] for c in ENGINE_4XX])
async def test_engine_4xx_in_the_apis_shape(
    fleet: list[RunningSim], case: str, path: str, extra: dict[str, Any], status: int,
    exc: str, words: str,
) -> None:
    """An engine's 4xx answer reaches the client in its API's shape, status and the engine's
    message kept: Anthropic's (the SDK raises the status's class), or OpenAI's, whose ``type``
    follows the status (vLLM's ``BadRequestError`` and integer ``code`` are no OpenAI values)
    and whose ``param`` is the engine's."""
    import anthropic

    def engine_message(answer: dict[str, Any]) -> str:
        return str(answer["error"]["message"])

    body = {**_VALID[path], **extra}
    async with httpx.AsyncClient(base_url=fleet[0].url) as direct:
        engine = await direct.post(path, json=body)
    assert engine.status_code == status, engine.text
    data = gateway_config([fleet[0].url])
    async with serve_gateway(data) as (_, url), httpx.AsyncClient(base_url=url) as http:
        resp = await http.post(path, json=body)
        assert resp.status_code == status, resp.text
        assert resp.headers["x-request-id"]
        payload = resp.json()
        if not exc:
            inner = engine.json()["error"]
            assert payload == {"error": {"message": inner["message"], "param": inner["param"],
                                         "type": "invalid_request_error", "code": None}}
            assert words in payload["error"]["message"]
            return
        assert payload["type"] == "error" and set(payload) == {"type", "error"}
        assert payload["error"]["type"] == "invalid_request_error"
        assert words in payload["error"]["message"]
        assert payload["error"]["message"] == engine_message(engine.json())
        client = anthropic.AsyncAnthropic(base_url=url, api_key="x", max_retries=0)
        call = (client.messages.count_tokens if path.endswith("count_tokens")
                else client.messages.create)
        with pytest.raises(getattr(anthropic, exc)) as caught:
            await call(**_VALID[path], extra_body=extra)
        assert words in str(caught.value)
        assert caught.value.body["type"] == "error"


async def test_no_healthy_engine_and_405_shapes() -> None:
    data_url = "http://127.0.0.1:9"
    async with _gateway([data_url], pool={"unhealthy_after": 1}) as (app, client):
        for _ in range(100):
            if not any(ep.healthy for ep in app.pool.snapshot()):
                break
            await asyncio.sleep(0.02)
        resp = await client.post("/v1/stub", json=CHAT)
        assert resp.status_code == 503 and resp.json()["type"] == "error"
        resp = await client.post("/v1/chat/completions", json=CHAT)
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "no_healthy_engine"
        resp = await client.get("/v1/embeddings")
        assert resp.status_code == 405 and resp.json()["error"]["code"] == "method_not_allowed"


async def test_engine_dying_mid_stream_ends_in_the_apis_shape(fleet: list[RunningSim]) -> None:
    async with _gateway([fleet[0].url]) as (_, client):
        for path, marker in (("/v1/stub", b"event: error"), ("/v1/chat/completions",
                                                             b'data: {"error"')):
            async with httpx.AsyncClient() as direct:
                await direct.post(f"{fleet[0].url}/sim/faults",
                                  json={"drop_after_chunks": 2, "drop_streams": 1})
            body = {**CHAT, "max_tokens": 20, "stream": True}
            resp = await client.post(path, json=body)
            assert resp.status_code == 200
            assert resp.content.rstrip().split(b"\n\n")[-1].startswith(marker), resp.content


async def test_state_ids_pin_requests_and_serve_by_id_routes(fleet: list[RunningSim]) -> None:
    urls = [s.url for s in fleet]
    async with _gateway(urls, picker="round-robin-picker") as (app, client):
        first = await client.post("/v1/responses", json={"model": "sim-model", "input": "hi",
                                                         "max_output_tokens": 4})
        assert first.status_code == 200, first.text
        rid, home = first.json()["id"], first.headers["x-kvgate-engine"]
        for turn in range(4):
            resp = await client.post("/v1/responses", json={
                "model": "sim-model", "input": f"turn {turn}", "previous_response_id": rid,
                "max_output_tokens": 4})
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-kvgate-engine"] == home
        got = await client.get(f"/v1/responses/{rid}")
        assert got.status_code == 200 and got.json()["id"] == rid
        assert got.headers["x-kvgate-engine"] == home
        cancel = await client.post(f"/v1/responses/{rid}/cancel")
        assert cancel.status_code == 400  # the engine's own answer, relayed
        assert "synchronous" in cancel.text
        metrics = (await client.get("/metrics")).text
        assert len(app.gateway.states) == 5
    assert 'kvgate_state_lookups_total{result="hit"} 6.0' in metrics
    assert "kvgate_state_ids 5.0" in metrics


# -- the client's bytes, forwarded unchanged ------------------------------------------------


def _stub_engine(received: list[bytes]) -> Starlette:
    """An engine that records each body it gets and answers a chat completion."""
    usage = {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}

    async def chat(request: Request) -> Response:
        raw = await request.body()
        received.append(raw)
        answer = {"id": "x", "object": "chat.completion", "choices": [], "usage": usage}
        if not json.loads(raw).get("stream"):
            return JSONResponse(answer)
        events = [b"data: " + json.dumps({"choices": [{"delta": {"content": "a"}}]}).encode(),
                  b"data: " + json.dumps({"choices": [], "usage": usage}).encode(),
                  b"data: [DONE]"]
        return StreamingResponse(iter([e + b"\n\n" for e in events]),
                                 media_type="text/event-stream")

    async def health(request: Request) -> Response:
        return Response("ok")

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "sim-model"}]})

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                             Route("/health", health), Route("/v1/models", models)])


ODD = b'{ "messages":[{"content":"caf\\u00e9  ", "role":"user"}],\n "model" : "sim-model" }'
BYTES = [
    # case, body sent, forwarded unchanged
    ("odd formatting", ODD, True),
    ("stream asking for usage",
     b'{"model":"sim-model","stream":true,"stream_options":{"include_usage":true},'
     b'"messages":[{"role":"user","content":"x"}]}', True),
    ("stream not asking for usage: the gateway asks",
     b'{"model":"sim-model","stream":true,"messages":[{"role":"user","content":"x"}]}', False),
]


@pytest.mark.parametrize(("case", "sent", "unchanged"), BYTES, ids=[c[0] for c in BYTES])
async def test_client_bytes_forwarded_unchanged(case: str, sent: bytes, unchanged: bool) -> None:
    received: list[bytes] = []
    async with serve_asgi(_stub_engine(received)) as url, _gateway([url]) as (_, client):
        resp = await client.post("/v1/chat/completions", content=sent,
                                 headers={"content-type": "application/json"})
        assert resp.status_code == 200, resp.text
    assert len(received) == 1
    if unchanged:
        assert received[0] == sent
    else:
        body = json.loads(received[0])
        assert body["stream_options"] == {"include_usage": True}
        assert {k: v for k, v in body.items() if k != "stream_options"} == json.loads(sent)
        assert b"usage" not in resp.content  # read by the gateway, not shown to the client



async def test_tokenize_leaves_no_ledger_record_chat_does(tmp_path: Path) -> None:
    """Through the real billing plugin: a tokenize request is authenticated and allowed but
    not billed (no ledger row); a chat request next to it is."""
    keys = write_keys(tmp_path)
    async with sim_fleet(1) as sims, \
            gateway(billing_config([sims[0].url], tmp_path, keys)) as (app, client):
        resp = await client.post("/tokenize", json={"model": "sim-model", "prompt": "hi"})
        assert resp.status_code == 401  # auth applies to every API
        resp = await client.post("/tokenize", json={"model": "sim-model", "prompt": "hi"},
                                 headers=keys.auth("user"))
        assert resp.status_code == 200 and resp.json()["tokens"]
        resp = await client.post("/tokenize", json={"model": "sim-model", "prompt": "hi"},
                                 headers=keys.auth("narrow"))
        assert resp.status_code == 403  # the key's model allow-list applies too
        resp = await client.post("/v1/chat/completions", json=CHAT, headers=keys.auth("user"))
        assert resp.status_code == 200
        rows = await ledger_list(app)
    assert [r.request_id for r in rows] == [resp.headers["x-request-id"]]
