"""Messages and count_tokens adapters: validation, usage taps over recorded vLLM 0.32 answers,
P/D cached-token rewrite, error shapes as the real anthropic SDK parses them."""

from __future__ import annotations

import copy
import json
from typing import Any

import anthropic as sdk
import httpx2
import pytest

from kvgate.apis.anthropic import (
    CountTokensAdapter,
    MessagesAdapter,
    MessagesTap,
    error_type,
)
from kvgate.middleware.framework.api import ApiAdapter, SseEvent, UsageTap
from kvgate.middleware.framework.errors import (
    BadRequest,
    ModelNotFound,
    NoEndpointAvailable,
    Overloaded,
    PayloadTooLarge,
    RateLimited,
    Unauthorized,
    UpstreamError,
    UpstreamHTTPError,
)
from kvgate.middleware.framework.types import Usage
from tests.unit.apis.samples import load_json, load_sse, parse_sse, raw

VALID: dict[str, Any] = {"model": "m", "max_tokens": 16,
                         "messages": [{"role": "user", "content": "hi"}]}
VLLM_USAGE = Usage(prompt_tokens=1200, completion_tokens=7, cached_tokens=1024,
                   cache_write_tokens=160)


def _with(**fields: Any) -> dict[str, Any]:
    body = copy.deepcopy(VALID)
    for key, value in fields.items():
        if value is ...:
            body.pop(key, None)
        else:
            body[key] = value
    return body


def test_adapters_implement_the_contract() -> None:
    for adapter in (MessagesAdapter(), CountTokensAdapter()):
        assert isinstance(adapter, ApiAdapter)
        assert isinstance(adapter.new_tap(True), UsageTap)


BAD = [
    (_with(model=...), "model"), (_with(model=""), "model"), (_with(model=3), "model"),
    (_with(max_tokens=...), "max_tokens"), (_with(max_tokens=0), "max_tokens"),
    (_with(max_tokens=True), "max_tokens"), (_with(max_tokens="9"), "max_tokens"),
    (_with(messages=...), "messages"), (_with(messages=[]), "messages"),
    (_with(messages="hi"), "messages"), (_with(messages=["hi"]), "messages.0"),
    (_with(messages=[{"role": "tool", "content": "x"}]), "messages.0.role"),
    (_with(messages=[{"role": "user"}]), "messages.0.content"),
    (_with(messages=[{"role": "user", "content": 5}]), "messages.0.content"),
    (_with(messages=[{"role": "user", "content": [{"text": "x"}]}]), "messages.0.content.0.type"),
    (_with(stream="yes"), "stream"), (_with(system=7), "system"),
    (_with(system=[{"text": "x"}]), "system.0.type"), (_with(tools={}), "tools"),
    (_with(tools=[{"input_schema": {}}]), "tools.0.name"),
    (_with(tools=[{"name": "t"}]), "tools.0.input_schema"),
    (_with(chat_template_kwargs=[]), "chat_template_kwargs"),
]


@pytest.mark.parametrize(("body", "param"), BAD, ids=[p for _, p in BAD])
def test_messages_parse_rejects_with_param(body: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as info:
        MessagesAdapter().parse(body, {})
    assert info.value.status == 400 and info.value.param == param


def test_messages_parse() -> None:
    parsed = MessagesAdapter().parse(_with(stream=True, system="S" * 400), {})
    assert parsed.model == "m" and parsed.stream and parsed.client_wants_usage
    assert parsed.requires_state is None
    assert 100 < parsed.prompt_token_estimate < 120  # bytes / 4
    assert MessagesAdapter().parse(VALID, {}).stream is False


def test_count_tokens_parse() -> None:
    body = _with(max_tokens=...)
    assert CountTokensAdapter().parse(body, {}).stream is False
    with pytest.raises(BadRequest) as info:
        CountTokensAdapter().parse(_with(stream=True), {})
    assert info.value.param == "stream"
    assert CountTokensAdapter.billed is False and not CountTokensAdapter.disaggregable


def _tap_stream(name: str) -> tuple[MessagesTap, list[bool]]:
    tap = MessagesAdapter().new_tap(True)
    finals = []
    for event in load_sse(name):
        assert tap.on_event(event) is True  # never dropped
        finals.append(tap.final)
    return tap, finals


def test_tap_json() -> None:
    tap = MessagesAdapter().new_tap(True)
    tap.on_json(load_json("vllm_messages.json"))
    assert tap.final and tap.usage == VLLM_USAGE and tap.state_ids == []
    tap = MessagesAdapter().new_tap(True)
    tap.on_json(load_json("vllm_messages_no_details.json"))
    assert tap.usage == Usage(1200, 7, None, 0)


@pytest.mark.parametrize("name", ["vllm_messages_text.sse", "vllm_messages_tool.sse"])
def test_tap_stream_message_delta_wins_over_message_start(name: str) -> None:
    """vLLM's message_start says input_tokens=1200 (the whole prompt, no cache fields);
    message_delta says 16 + 1024 cache reads + 160 cache writes: 1200 in all, not 2384."""
    events = load_sse(name)
    start = next(e for e in events if e.name == "message_start")
    assert start.data["message"]["usage"] == {"input_tokens": 1200, "output_tokens": 0}
    tap, finals = _tap_stream(name)
    assert tap.usage == VLLM_USAGE
    delta_at = [e.name for e in events].index("message_delta")
    assert finals == [i >= delta_at for i in range(len(events))]


def test_tap_stream_without_details() -> None:
    tap, _ = _tap_stream("vllm_messages_no_details.sse")
    assert tap.usage == Usage(1200, 7, None, 0)


def test_tap_usage_is_what_the_sdk_shows_the_client() -> None:
    """The anthropic SDK accumulates the same stream into the message the client sees."""
    client = _client(lambda _: httpx2.Response(
        200, content=raw("vllm_messages_text.sse"),
        headers={"content-type": "text/event-stream"}))
    with client.messages.stream(model="m", max_tokens=16,
                                messages=[{"role": "user", "content": "hi"}]) as stream:
        usage = stream.get_final_message().usage
    tap, _ = _tap_stream("vllm_messages_text.sse")
    assert tap.usage is not None
    assert (usage.input_tokens + (usage.cache_read_input_tokens or 0)
            + (usage.cache_creation_input_tokens or 0)) == tap.usage.prompt_tokens
    assert usage.cache_read_input_tokens == tap.usage.cached_tokens
    assert usage.output_tokens == tap.usage.completion_tokens


def test_tap_final_at_message_stop_without_delta_usage() -> None:
    tap = MessagesTap()
    tap.on_event(SseEvent("message_start", {"type": "message_start", "message": {
        "usage": {"input_tokens": 5, "cache_read_input_tokens": 0, "output_tokens": 1}}}))
    tap.on_event(SseEvent("message_delta", {"type": "message_delta", "delta": {}}))
    assert not tap.final and tap.usage == Usage(5, 1, 0, 0)
    tap.on_event(SseEvent("message_stop", {"type": "message_stop"}))
    assert tap.final


def test_tap_markers_select_the_usage_events() -> None:
    text = raw("vllm_messages_text.sse").decode().split("\n\n")
    picked = [b for b in text if any(m.decode() in b for m in MessagesTap.markers)]
    assert [b.split("\n")[0] for b in picked] == [
        "event: message_start", "event: message_delta", "event: message_stop"]
    assert MessagesTap.sse_done is False


# -- prefill/decode ---------------------------------------------------------------------------

def _usage_of(payload: dict[str, Any]) -> dict[str, Any]:
    usage = payload.get("usage") or payload["message"]["usage"]
    assert isinstance(usage, dict)
    return usage


@pytest.mark.parametrize(("cached", "want"), [
    (1100, {"input_tokens": 0, "cache_read_input_tokens": 1040}),  # clamped: 1200 - 160 written
    (600, {"input_tokens": 440, "cache_read_input_tokens": 600}),
    (0, {"input_tokens": 1040, "cache_read_input_tokens": 0}),
    (None, {"input_tokens": 1040}),
])
def test_set_cached_tokens_json(cached: int | None, want: dict[str, int]) -> None:
    payload = load_json("vllm_messages.json")
    payload["kv_transfer_params"] = {"remote_engine_id": "x"}
    assert MessagesAdapter().set_cached_tokens(payload, cached)
    usage = _usage_of(payload)
    assert "kv_transfer_params" not in payload
    assert {k: usage[k] for k in want} == want
    assert ("cache_read_input_tokens" in usage) is (cached is not None)
    tap = MessagesTap()
    tap.on_json(payload)
    assert tap.usage is not None and tap.usage.prompt_tokens == 1200  # total kept
    assert tap.usage.cached_tokens == (None if cached is None else min(cached, 1040))


def test_set_cached_tokens_stream_events() -> None:
    """message_start (whole prompt, no cache fields) and message_delta both get the prefill
    hit, each keeping input_tokens + cache reads + cache writes = the prompt."""
    events = load_sse("vllm_messages_text.sse")
    adapter, tap = MessagesAdapter(), MessagesTap()
    for event in events:
        if event.name in ("message_start", "message_delta"):
            assert adapter.set_cached_tokens(event.data, 900)
        tap.on_event(event)
    start = next(e for e in events if e.name == "message_start").data["message"]["usage"]
    assert start == {"input_tokens": 300, "output_tokens": 0, "cache_read_input_tokens": 900}
    assert tap.usage == Usage(1200, 7, 900, 160)
    delta = next(e for e in events if e.name == "message_delta")
    assert adapter.set_cached_tokens(delta.data, 900) is False  # already so


def test_set_cached_tokens_without_usage() -> None:
    assert MessagesAdapter().set_cached_tokens({"type": "ping"}, 5) is False
    assert CountTokensAdapter().set_cached_tokens({"input_tokens": 5}, 5) is False


# -- errors -----------------------------------------------------------------------------------

def _client(handler: Any) -> sdk.Anthropic:
    return sdk.Anthropic(api_key="k", base_url="http://kvgate.test", max_retries=0,
                         http_client=httpx2.Client(transport=httpx2.MockTransport(handler)))


ERRORS = [
    (BadRequest("messages: required", param="messages"), sdk.BadRequestError,
     "invalid_request_error"),
    (Unauthorized("bad key"), sdk.AuthenticationError, "authentication_error"),
    (ModelNotFound("no such model", param="model"), sdk.NotFoundError, "not_found_error"),
    (PayloadTooLarge("too big"), sdk.APIStatusError, "request_too_large"),
    (RateLimited("slow down"), sdk.RateLimitError, "rate_limit_error"),
    (NoEndpointAvailable("no healthy engine"), sdk.InternalServerError, "overloaded_error"),
    (Overloaded("busy"), sdk.InternalServerError, "overloaded_error"),
    (UpstreamError("engine failed"), sdk.InternalServerError, "api_error"),
    (UpstreamError("engine timed out", status=504), sdk.InternalServerError, "timeout_error"),
]


@pytest.mark.parametrize(("err", "cls", "kind"), ERRORS, ids=[e[2] + str(e[0].status)
                                                             for e in ERRORS])
def test_error_body_as_the_sdk_parses_it(err: Any, cls: type[Exception], kind: str) -> None:
    body = MessagesAdapter().error_body(err)
    client = _client(lambda _: httpx2.Response(err.status, content=body,
                                               headers={"content-type": "application/json"}))
    with pytest.raises(cls) as info:
        client.messages.create(model="m", max_tokens=1, messages=[{"role": "user", "content": "x"}])
    assert isinstance(info.value, sdk.APIStatusError)
    assert info.value.status_code == err.status
    assert info.value.body == {"type": "error", "error": {"type": kind, "message": err.message}}
    assert error_type(err.status) == kind


def test_error_body_of_an_engine_error_keeps_the_engine_message() -> None:
    engine = json.dumps({"type": "error", "error": {"type": "BadRequestError",
                                                    "message": "prompt too long"}}).encode()
    err = UpstreamHTTPError(400, engine)
    assert json.loads(CountTokensAdapter().error_body(err)) == {
        "type": "error", "error": {"type": "invalid_request_error",
                                   "message": "prompt too long"}}


def test_stream_error_raises_in_the_sdk() -> None:
    events = raw("vllm_messages_text.sse").split(b"\n\n")
    broken = b"\n\n".join(events[:3]) + b"\n\n" + MessagesAdapter().stream_error("engine died")
    assert parse_sse(MessagesAdapter().stream_error("x"))[0].data == {
        "type": "error", "error": {"type": "api_error", "message": "x"}}
    client = _client(lambda _: httpx2.Response(200, content=broken,
                                               headers={"content-type": "text/event-stream"}))
    with pytest.raises(sdk.APIStatusError) as info:
        for _ in client.messages.create(model="m", max_tokens=1, stream=True,
                                        messages=[{"role": "user", "content": "x"}]):
            pass
    assert "engine died" in str(info.value)
