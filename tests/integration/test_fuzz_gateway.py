"""Hypothesis over the gateway's own endpoints, which have no OpenAPI schema (docs/reliability.md):
generated bodies (valid ones mutated, arbitrary JSON, bytes that are not JSON), headers, by-id
paths, and SSE / JSON answers from a fake engine. Every answer must be kvgate's or the engine's,
never a crash of kvgate's own code (500 ``internal_error``); every error in the API's own shape
(OpenAI ``{"error": {...}}``, Anthropic ``{"type": "error", "error": {...}}``); every relayed
stream ends with ``data: [DONE]`` or the API's error event; and the gateway keeps serving. The
gateway is served on a loopback port by the HTTP front end ``kvgate serve`` runs
(middleware/transport/h1server.py), not uvicorn's protocol or ASGITransport.

Seeded (``derandomize=True``) and small in the suite; ``KVGATE_FUZZ_EXAMPLES`` raises the count
(``python -m bench.reliability --scenarios fuzz`` does)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import string
import threading
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgate.plugins.tenancy.auth import hash_key, new_key
from tests.integration.conftest import KVGATE_FRONT, gateway_config, serve_gateway, sim_fleet
from tests.servers import serve_asgi

T = TypeVar("T")
EXAMPLES = int(os.environ.get("KVGATE_FUZZ_EXAMPLES", "20"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")
#: 5xx codes kvgate gives for an engine's failure (its own failures would be internal_error).
ENGINE_5XX = {"upstream_error", "upstream_timeout", "no_healthy_engine"}

VALID: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": "sim-model", "max_tokens": 4,
                             "messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions": {"model": "sim-model", "max_tokens": 4, "prompt": "hi"},
    "/v1/messages": {"model": "sim-model", "max_tokens": 4,
                     "messages": [{"role": "user", "content": "hi"}]},
    "/v1/messages/count_tokens": {"model": "sim-model",
                                  "messages": [{"role": "user", "content": "hi"}]},
    "/v1/responses": {"model": "sim-model", "input": "hi", "max_output_tokens": 4},
    "/v1/embeddings": {"model": "sim-model", "input": "hi"},
    "/tokenize": {"model": "sim-model", "prompt": "hi"},
    "/detokenize": {"model": "sim-model", "tokens": [1, 2, 3]},
}
FIELDS = sorted({k for body in VALID.values() for k in body} | {
    "stream", "stream_options", "n", "tools", "tool_choice", "temperature", "system",
    "previous_response_id", "store", "background", "messages", "max_completion_tokens"})

scalars = st.none() | st.booleans() | st.integers(-2**63, 2**64) | \
    st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.sampled_from(FIELDS) | st.text(max_size=8), inner, max_size=4), max_leaves=12)


@st.composite
def mutated(draw: st.DrawFn, path: str) -> dict[str, Any]:
    """A valid body of ``path`` with some fields replaced, removed or added."""
    body = dict(VALID[path])
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(FIELDS))
        if draw(st.booleans()) and key in body:
            del body[key]
        else:
            body[key] = draw(json_values)
    if body.get("stream") is True and isinstance(body.get("max_tokens"), int):
        body["max_tokens"] = max(-1, min(body["max_tokens"], 64))
    return body


class Loop:
    """An event loop in a thread: the servers live there, hypothesis calls in from the test."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.stack = contextlib.AsyncExitStack()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def close(self) -> None:
        self.run(self.stack.aclose())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def loop() -> Iterator[Loop]:
    lp = Loop()
    try:
        yield lp
    finally:
        lp.close()


@dataclass(frozen=True)
class Served:
    gateway: str
    engine: str


@pytest.fixture(scope="module")
def gw(loop: Loop) -> Served:
    async def start() -> Served:
        sims = await loop.stack.enter_async_context(sim_fleet(1))
        _, url = await loop.stack.enter_async_context(serve_gateway(gateway_config(
            [sims[0].url], pool={"breaker_failures": 10**6}), KVGATE_FRONT))
        return Served(url, sims[0].url)
    return loop.run(start())


def check_answer(path: str, resp: httpx.Response) -> None:
    """kvgate's own code did not fail, and an error is in the API's shape (an engine's 4xx
    too: never relayed as the engine wrote it)."""
    ctype = resp.headers.get("content-type", "")
    if resp.status_code < 400:
        if "text/event-stream" in ctype:
            check_stream_end(path, resp.content)
        return
    payload = resp.json()
    if path in ANTHROPIC_PATHS:
        assert payload.get("type") == "error", payload
        err = payload["error"]
        assert isinstance(err["type"], str) and isinstance(err["message"], str), payload
        code = None
    else:
        err = payload["error"]
        assert isinstance(err["message"], str) and isinstance(err["type"], str), payload
        code = err.get("code")
    assert code != "internal_error" and err.get("type") != "internal_error", payload
    if resp.status_code >= 500:
        assert code in ENGINE_5XX or err.get("type") == "api_error", payload


def check_stream_end(path: str, raw: bytes) -> None:
    """The last event is the end marker or the API's error event, whole."""
    assert raw.endswith(b"\n\n"), raw[-200:]
    last = raw.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
    if path in ANTHROPIC_PATHS or path == "/v1/responses":
        assert last.startswith(b"event: "), last
        return
    data = last.removeprefix(b"data: ")
    assert data == b"[DONE]" or "error" in json.loads(data), last


def serving(client: httpx.Client) -> None:
    resp = client.get("/health")
    assert resp.status_code == 200, resp.text


@given(data=st.data())
@FUZZ
def test_mutated_bodies(gw: Served, data: st.DataObject) -> None:
    path = data.draw(st.sampled_from(sorted(VALID)))
    raw = json.dumps(data.draw(mutated(path))).encode()
    with httpx.Client(base_url=gw.gateway, timeout=30) as client:
        resp = client.post(path, content=raw, headers={"content-type": "application/json"})
        check_answer(path, resp)
        serving(client)


@given(path=st.sampled_from(sorted(VALID)), raw=st.binary(max_size=64) | json_values.map(
    lambda v: json.dumps(v).encode()))
@FUZZ
def test_arbitrary_bodies(gw: Served, path: str, raw: bytes) -> None:
    with httpx.Client(base_url=gw.gateway, timeout=30) as client:
        check_answer(path, client.post(path, content=raw))
        serving(client)


HEADER_TEXT = st.text(string.printable.strip("\r\n\x0b\x0c"), max_size=40).map(str.strip)
HEADER_NAMES = st.sampled_from([
    "authorization", "x-api-key", "content-type", "x-request-id", "traceparent", "tracestate",
    "anthropic-version", "x-kvgate-session", "accept", "accept-encoding", "user",
]) | st.text(string.ascii_lowercase + "-", min_size=1, max_size=12)


@given(path=st.sampled_from(sorted(VALID)),
       headers=st.dictionaries(HEADER_NAMES, HEADER_TEXT, max_size=4))
@FUZZ
def test_headers(gw: Served, path: str, headers: dict[str, str]) -> None:
    raw = json.dumps(VALID[path]).encode()
    with httpx.Client(base_url=gw.gateway, timeout=30) as client:
        check_answer(path, client.post(path, content=raw, headers=headers))
        serving(client)


@pytest.fixture(scope="module")
def keyed(loop: Loop, tmp_path_factory: pytest.TempPathFactory) -> tuple[Served, str]:
    """A gateway with API keys on (the api-keys plugin) and one valid admin key."""
    key = new_key()
    path = tmp_path_factory.mktemp("keys") / "keys.yaml"
    path.write_text(yaml.safe_dump({"keys": [
        {"id": "k1", "tenant": "acme", "sha256": hash_key(key), "admin": True}]}))

    async def start() -> Served:
        sims = await loop.stack.enter_async_context(sim_fleet(1))
        data = gateway_config([sims[0].url], pool={"breaker_failures": 10**6})
        data["plugins"] = [{"type": "api-keys", "params": {"file": str(path)}}, *data["plugins"]]
        _, url = await loop.stack.enter_async_context(serve_gateway(data, KVGATE_FRONT))
        return Served(url, sims[0].url)
    return loop.run(start()), key


@given(path=st.sampled_from([*sorted(VALID), "/health", "/v1/models"]), data=st.data(),
       headers=st.dictionaries(HEADER_NAMES, HEADER_TEXT, max_size=3))
@FUZZ
def test_auth_headers(keyed: tuple[Served, str], path: str, data: st.DataObject,
                      headers: dict[str, str]) -> None:
    served, key = keyed
    name = data.draw(st.sampled_from(["authorization", "x-api-key"]))
    value = data.draw(st.sampled_from([f"Bearer {key}", key, f"Bearer {key[:-1]}", "Bearer",
                                       f"bearer  {key}", f"Basic {key}"]) | HEADER_TEXT)
    headers = {**headers, name: value}
    with httpx.Client(base_url=served.gateway, timeout=30) as client:
        raw = json.dumps(VALID[path]).encode() if path in VALID else b""
        if path in VALID:
            resp = client.post(path, content=raw, headers=headers)
        else:
            resp = client.get(path, headers=headers)
        if path == "/health":  # the full report for the admin key, else only the status
            assert resp.status_code == 200 and resp.json()["status"] == "ok"
        else:
            check_answer(path, resp)
        assert client.get("/health").status_code == 200


@given(method=st.sampled_from(["GET", "POST", "DELETE", "PUT", "PATCH"]),
       path=st.sampled_from(["/v1/responses/", "/v1/models/", "/v1/responses/x/", "/v1/",
                             "/health/", "/metrics/"]),
       tail=st.text(string.ascii_letters + string.digits + "-_.%~", max_size=20))
@FUZZ
def test_paths_and_methods(gw: Served, method: str, path: str, tail: str) -> None:
    with httpx.Client(base_url=gw.gateway, timeout=30) as client:
        check_answer(path, client.request(method, path + tail))
        serving(client)


# -- what the engine answers ----------------------------------------------------------------

@dataclass
class Script:
    """What the fake engine answers the next inference request with."""

    status: int = 200
    content_type: str = "text/event-stream"
    parts: list[bytes] = field(default_factory=list)


def fake_engine(script: Script) -> Callable[..., Coroutine[Any, Any, None]]:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        path = scope["path"]
        while (await receive()).get("more_body"):
            pass
        if scope["method"] != "POST":
            body = b'{"data": [{"id": "sim-model", "object": "model"}]}' \
                if path == "/v1/models" else b"{}"
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": body})
            return
        await send({"type": "http.response.start", "status": script.status,
                    "headers": [(b"content-type", script.content_type.encode())]})
        for part in script.parts:
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
    return app


@pytest.fixture(scope="module")
def faked(loop: Loop) -> tuple[str, Script]:
    script = Script()

    async def start() -> str:
        engine = await loop.stack.enter_async_context(serve_asgi(fake_engine(script), "off"))
        data = gateway_config([engine], pool={"breaker_failures": 10**6})
        data["server"] = {"retries": 0}
        _, url = await loop.stack.enter_async_context(serve_gateway(data, KVGATE_FRONT))
        return url
    return loop.run(start()), script


CHUNK = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "sim-model",
         "choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}]}
MESSAGE_EVENTS = [b'event: message_start\ndata: {"type": "message_start", "message": {"id": "m", '
                  b'"type": "message", "role": "assistant", "content": [], "model": "sim-model", '
                  b'"usage": {"input_tokens": 1, "output_tokens": 0}}}\n\n',
                  b'event: message_delta\ndata: {"type": "message_delta", "delta": {"stop_reason": '
                  b'"end_turn"}, "usage": {"output_tokens": 1}}\n\n',
                  b'event: message_stop\ndata: {"type": "message_stop"}\n\n']
RESPONSE_EVENTS = [b'event: response.completed\ndata: {"type": "response.completed", "response": '
                   b'{"id": "r", "object": "response", "status": "completed", "output": [], '
                   b'"usage": {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2}}}\n\n']
sse_events = st.one_of(
    st.just(b"data: " + json.dumps(CHUNK).encode() + b"\n\n"),
    st.sampled_from(MESSAGE_EVENTS + RESPONSE_EVENTS),
    st.just(b"data: [DONE]\n\n"),
    json_values.map(lambda v: b"data: " + json.dumps(v).encode() + b"\n\n"),
    st.binary(max_size=40),
    st.sampled_from([b"\n\n", b": keep-alive\n\n", b"event: error\n", b"data: {", b"\r\n\r\n"]),
)


@given(path=st.sampled_from(["/v1/chat/completions", "/v1/messages", "/v1/responses"]),
       status=st.sampled_from([200, 200, 200, 400, 404, 429, 500, 503]),
       content_type=st.sampled_from(["text/event-stream", "application/json", "text/plain"]),
       parts=st.lists(sse_events, max_size=6), stream=st.booleans())
@FUZZ
def test_engine_answers(faked: tuple[str, Script], path: str, status: int, content_type: str,
                        parts: list[bytes], stream: bool) -> None:
    url, script = faked
    script.status, script.content_type, script.parts = status, content_type, parts
    body = {**VALID[path], "stream": stream}
    with httpx.Client(base_url=url, timeout=30) as client:
        resp = client.post(path, json=body)  # an engine's 4xx too: in the API's shape
        if path == "/v1/chat/completions" or "text/event-stream" not in \
                resp.headers.get("content-type", "") or resp.status_code >= 400:
            check_answer(path, resp)
        else:
            check_named_stream_end(resp.content, b"".join(parts))
        script.parts = []
        serving(client)


def check_named_stream_end(raw: bytes, sent: bytes) -> None:
    """A stream of named events (Anthropic, Responses) ends on an event boundary, with the
    API's error event or with an event the engine sent."""
    assert raw.endswith(b"\n\n"), raw[-200:]
    last = raw.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
    if last.startswith(b"event: error\n"):
        payload = json.loads(last.split(b"\ndata: ", 1)[1])
        assert payload["type"] == "error", payload
        return
    sent_events = {_norm(e) for e in sent.split(b"\n\n") if e.strip()}
    assert _norm(last) in sent_events, (last, sent[-300:])


def _norm(event: bytes) -> tuple[bytes, str]:
    """An event's non-data lines and its data (JSON re-dumped with sorted keys when it is JSON:
    the relay rewrites usage-carrying events compactly)."""
    lines = event.strip(b"\n").split(b"\n")
    head = b"\n".join(ln for ln in lines if not ln.startswith(b"data:"))
    data = b"\n".join(ln[5:].strip() for ln in lines if ln.startswith(b"data:"))
    try:
        return head, json.dumps(json.loads(data), sort_keys=True)
    except ValueError:
        return head, data.decode("latin-1")
