"""Responses adapter: validation, routing view, usage and state ids over recorded vLLM 0.32
answers, P/D cached-token rewrite, errors as the real openai SDK parses them."""

from __future__ import annotations

import copy
import json
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import ResponseErrorEvent

from kvgate.apis.responses import MARKERS, ResponsesAdapter, ResponsesTap
from kvgate.middleware.framework.api import ApiAdapter, ChatPrompt, SseEvent, UsageTap
from kvgate.middleware.framework.errors import BadRequest, ModelNotFound, NotFound, UpstreamError
from kvgate.middleware.framework.types import Usage
from tests.unit.apis.samples import load_json, load_sse, parse_sse, raw

VALID: dict[str, Any] = {"model": "m", "input": "hi"}
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


def test_adapter_implements_the_contract() -> None:
    adapter = ResponsesAdapter()
    assert isinstance(adapter, ApiAdapter) and isinstance(adapter.new_tap(False), UsageTap)
    assert not adapter.disaggregable
    assert adapter.routes == (("POST", "/v1/responses"), ("GET", "/v1/responses/{id}"),
                              ("POST", "/v1/responses/{id}/cancel"))


BAD = [
    (_with(model=...), "model"), (_with(model=""), "model"),
    (_with(input=...), "input"), (_with(input=5), "input"),
    (_with(input=["x"]), "input[0]"), (_with(input=[{"content": "x"}]), "input[0]"),
    (_with(instructions=["x"]), "instructions"), (_with(stream=1), "stream"),
    (_with(tools={}), "tools"), (_with(tools=[{"name": "f"}]), "tools[0].type"),
    (_with(previous_response_id=3), "previous_response_id"),
    (_with(max_output_tokens=-1), "max_output_tokens"),
    (_with(background=True), "background"), (_with(background="no"), "background"),
]


@pytest.mark.parametrize(("body", "param"), BAD, ids=[p for _, p in BAD])
def test_parse_rejects_with_param(body: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as info:
        ResponsesAdapter().parse(body, {})
    assert info.value.status == 400 and info.value.param == param


def test_parse() -> None:
    parsed = ResponsesAdapter().parse(_with(stream=True, instructions="I" * 40), {})
    assert parsed.model == "m" and parsed.stream and parsed.client_wants_usage
    assert parsed.prompt is not None and parsed.requires_state is None
    assert parsed.prompt_token_estimate == 10  # (40 + 2) bytes / 4
    # vLLM 0.32 tokenizes a rendered Responses prompt with special tokens (a second BOS;
    # renderers/params.py TokenizeParams default): routing must hash the same ids
    assert isinstance(parsed.prompt, ChatPrompt) and parsed.prompt.add_special_tokens


def test_background_only_when_allowed() -> None:
    assert ResponsesAdapter(allow_background=True).parse(_with(background=True), {}).model == "m"
    assert ResponsesAdapter().parse(_with(background=False), {}).model == "m"


def test_previous_response_id_pins_and_skips_prefix_routing() -> None:
    """The engine prepends the stored conversation: the gateway cannot render that prompt."""
    parsed = ResponsesAdapter().parse(_with(previous_response_id="resp_abc"), {})
    assert parsed.requires_state == "resp_abc" and parsed.prompt is None
    assert ResponsesAdapter().parse(_with(previous_response_id=None), {}).requires_state is None


def test_tap_json() -> None:
    tap = ResponsesAdapter().new_tap(True)
    tap.on_json(load_json("vllm_responses.json"))
    assert tap.final and tap.usage == VLLM_USAGE and tap.state_ids == ["resp_abc123"]


def test_tap_json_store_false_records_no_state() -> None:
    tap = ResponsesTap(store=False)
    tap.on_json(load_json("vllm_responses.json"))
    assert tap.usage == VLLM_USAGE and tap.state_ids == []


def test_tap_stream() -> None:
    tap = ResponsesAdapter().new_tap(True)
    finals = []
    for event in load_sse("vllm_responses.sse"):
        assert tap.on_event(event)
        finals.append(tap.final)
    assert finals == [False, False, True]
    assert tap.usage == VLLM_USAGE and tap.state_ids == ["resp_abc123"]


@pytest.mark.parametrize("kind", ["response.failed", "response.incomplete"])
def test_tap_other_final_events(kind: str) -> None:
    response = load_json("vllm_responses.json")
    tap = ResponsesTap()
    tap.on_event(SseEvent(kind, {"type": kind, "sequence_number": 9, "response": response}))
    assert tap.final and tap.usage == VLLM_USAGE


def test_tap_final_without_usage() -> None:
    tap = ResponsesTap()
    tap.on_event(SseEvent("response.failed", {"type": "response.failed",
                                              "response": {"id": "r", "usage": None}}))
    assert tap.final and tap.usage is None and tap.state_ids == ["r"]


def test_markers_select_id_and_usage_events_only() -> None:
    blocks = raw("vllm_responses.sse").decode().split("\n\n")
    picked = [b.split("\n")[0] for b in blocks if any(m.decode() in b for m in MARKERS)]
    assert picked == ["event: response.created", "event: response.completed"]
    delta = ('{"type":"response.output_text.delta","delta":"Hi","item_id":"m","output_index":0,'
             '"content_index":0,"sequence_number":3}')
    assert not any(m.decode() in delta for m in MARKERS)


def test_sdk_sees_what_the_tap_reads() -> None:
    client = openai.OpenAI(api_key="k", base_url="http://kvgate.test/v1", max_retries=0,
                           http_client=httpx.Client(transport=httpx.MockTransport(
                               lambda _: httpx.Response(200, content=raw("vllm_responses.json"),
                                                        headers={"content-type":
                                                                 "application/json"}))))
    usage = client.responses.create(model="m", input="hi").usage
    assert usage is not None
    assert (usage.input_tokens, usage.input_tokens_details.cached_tokens,
            usage.output_tokens) == (1200, 1024, 7)


@pytest.mark.parametrize(("cached", "want"), [(900, 900), (5000, 1040), (None, None)])
def test_set_cached_tokens(cached: int | None, want: int | None) -> None:
    adapter = ResponsesAdapter()
    answer = load_json("vllm_responses.json")
    answer["kv_transfer_params"] = {"x": 1}
    assert adapter.set_cached_tokens(answer, cached)
    assert "kv_transfer_params" not in answer
    details = answer["usage"]["input_tokens_details"]
    assert details["cached_tokens"] == want and answer["usage"]["input_tokens"] == 1200
    event = load_sse("vllm_responses.sse")[-1]
    assert adapter.set_cached_tokens(event.data, cached)
    tap = ResponsesTap()
    tap.on_event(event)
    assert tap.usage == Usage(1200, 7, want, 160)
    assert not adapter.set_cached_tokens(event.data, cached)
    assert not adapter.set_cached_tokens({"type": "response.output_text.delta"}, 5)


ERRORS = [
    (BadRequest("input: required", param="input"), openai.BadRequestError),
    (ModelNotFound("no model m", param="model"), openai.NotFoundError),
    (NotFound("no response resp_x"), openai.NotFoundError),
    (UpstreamError("engine failed"), openai.InternalServerError),
]


@pytest.mark.parametrize(("err", "cls"), ERRORS, ids=[type(e).__name__ for e, _ in ERRORS])
def test_error_body_as_the_sdk_parses_it(err: Any, cls: type[Exception]) -> None:
    body = ResponsesAdapter().error_body(err)
    client = openai.OpenAI(api_key="k", base_url="http://kvgate.test/v1", max_retries=0,
                           http_client=httpx.Client(transport=httpx.MockTransport(
                               lambda _: httpx.Response(err.status, content=body))))
    with pytest.raises(cls) as info:
        client.responses.create(model="m", input="hi")
    assert isinstance(info.value, openai.APIStatusError)
    assert info.value.code == err.code and info.value.param == err.param
    assert json.loads(body)["error"]["message"] == err.message


def test_stream_error_is_a_response_error_event() -> None:
    (event,) = parse_sse(ResponsesAdapter().stream_error("engine died"))
    assert event.name == "error"
    parsed = ResponseErrorEvent.model_validate(event.data)
    assert parsed.type == "error" and parsed.message == "engine died"
