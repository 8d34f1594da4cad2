"""Pure parts of the simulator's agent APIs: vLLM's validation messages, the conversions of
Messages and Responses bodies to the conversation vLLM renders, usage, the response store."""

from __future__ import annotations

from typing import Any

import pytest

from kvgate.engines.sim.core.config import SimConfig
from kvgate.engines.sim.http.agent_common import (
    Field,
    ValidationFailed,
    cache_write_tokens,
    check_fields,
    output_limit,
)
from kvgate.engines.sim.http.messages_api import MessagesShaper, parse_messages, to_chat_messages
from kvgate.engines.sim.http.protocol import ApiError, Usage
from kvgate.engines.sim.http.responses_api import (
    ResponseStore,
    StoredResponse,
    input_messages,
    parse_responses,
)
from kvgate.engines.sim.http.tokens_api import embeddings_body

FIELDS = (Field("model", "str", True), Field("max_tokens", "int", True), Field("stream", "bool"))


@pytest.mark.parametrize(("body", "message", "param"), [
    ({"model": "m"}, "1 validation error:\n  {'type': 'missing', 'loc': 'body.max_tokens', "
     "'msg': 'Field required', 'input': '<dict of 1 items>'}", "body.max_tokens"),
    ({"model": 3, "max_tokens": True}, "2 validation errors:\n  {'type': 'string_type', "
     "'loc': 'body.model', 'msg': 'Input should be a valid string', 'input': '3'}\n  "
     "{'type': 'int_type', 'loc': 'body.max_tokens', 'msg': 'Input should be a valid integer', "
     "'input': 'True'}", "body.model"),
    ([1, 2], "1 validation error:\n  {'type': 'model_attributes_type', 'loc': 'body', 'msg': "
     "'Input should be a valid dictionary or object to extract fields from', 'input': "
     "'<list of 2 items>'}", "body"),
])
def test_validation_errors_read_like_vllm(body: Any, message: str, param: str) -> None:
    with pytest.raises(ValidationFailed) as caught:
        check_fields(body, FIELDS)
    assert caught.value.body() == {"error": {"message": message, "type": "Bad Request",
                                             "param": param, "code": 400}}


@pytest.mark.parametrize(("prompt", "cached", "block", "written"), [
    (1406, 0, 128, 1280), (1406, 1280, 128, 0), (1408, 1280, 128, 128), (100, 0, 128, 0),
    (33, 16, 16, 16),
])
def test_cache_write_tokens(prompt: int, cached: int, block: int, written: int) -> None:
    assert cache_write_tokens(prompt, cached, block) == written


@pytest.mark.parametrize(("requested", "prompt", "fragment"), [
    (10**5, 10, "max_completion_tokens=100000 cannot be greater than max_model_len=4096"),
    (100, 4090, "maximum context length is 4096 tokens"),
    (0, 10, "must be at least 1"),
])
def test_output_limit_errors(requested: int, prompt: int, fragment: str) -> None:
    with pytest.raises(ApiError, match=fragment):
        output_limit("max_completion_tokens", requested, prompt, 4096)
    assert output_limit("max_completion_tokens", None, 96, 4096) == 4000


@pytest.mark.parametrize(("details", "usage"), [
    (True, {"input_tokens": 126, "output_tokens": 8, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 1280}),
    (False, {"input_tokens": 1406, "output_tokens": 8}),
])
def test_messages_usage_as_vllm_reports_it(details: bool, usage: dict[str, int]) -> None:
    """The real engine's second 1,406-token turn at block size 128 (docs/simulator.md)."""
    assert MessagesShaper("id", "m", 128, details).usage(Usage(1406, 8, 1280)) == usage


MESSAGES: list[tuple[str, dict[str, Any], list[dict[str, Any]]]] = [
    ("system blocks, billing header dropped",
     {"system": [{"type": "text", "text": "x-anthropic-billing-header: cc=1"},
                 {"type": "text", "text": "Be terse."}],
      "messages": [{"role": "user", "content": "hi"}]},
     [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"}]),
    ("text blocks joined as one text",
     {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]},
     [{"role": "user", "content": "a"}]),
    ("tool result of the assistant's message",
     {"messages": [{"role": "assistant", "content": [{"type": "text", "text": "ok"}, {
         "type": "tool_result", "tool_use_id": "t", "content": "v"}]}]},
     [{"role": "assistant", "content": [{"type": "text", "text": "ok"},
                                        {"type": "text", "text": "Tool result: v"}]}]),
]


@pytest.mark.parametrize(("name", "body", "expected"), MESSAGES, ids=[m[0] for m in MESSAGES])
def test_messages_conversion(name: str, body: dict[str, Any],
                             expected: list[dict[str, Any]]) -> None:
    assert to_chat_messages(body) == expected


def test_responses_continuation_drops_old_system_and_appends_output() -> None:
    prev = StoredResponse(
        body={"output": [{"type": "message", "content": [{"type": "output_text",
                                                          "text": " hi"}]}]},
        messages=[{"role": "system", "content": "old"}, {"role": "user", "content": "q1"}])
    body = {"instructions": "new", "input": [
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": "42"},
        {"role": "user", "content": [{"type": "input_text", "text": "q2"}]}]}
    assert input_messages(body, prev) == [
        {"role": "system", "content": "new"}, {"role": "user", "content": "q1"},
        {"role": "assistant", "content": " hi"},  # new items merge among themselves only
        {"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c"},
        {"role": "user", "content": "q2"}]


def test_response_store_forgets_the_oldest() -> None:
    store = ResponseStore(limit=2)
    for i in range(3):
        store.put(f"r{i}", StoredResponse({"id": f"r{i}"}, []))
    assert list(store.items) == ["r1", "r2"]
    with pytest.raises(ApiError) as caught:
        store.get("r0")
    assert caught.value.status == 404
    assert caught.value.body()["error"] == {"message": "Response with id 'r0' not found.",
                                            "type": "invalid_request_error",
                                            "param": "response_id", "code": 404}


def _salted(api: str, salt: str) -> object:
    if api == "messages":
        return parse_messages({"model": "m1", "max_tokens": 4, "cache_salt": salt,
                               "messages": [{"role": "user", "content": "hi"}]}, SALT_CFG)
    if api == "responses":
        return parse_responses({"model": "m1", "input": "hi", "cache_salt": salt}, SALT_CFG,
                               ResponseStore(4))
    return embeddings_body({"model": "m1", "input": "hi", "cache_salt": salt}, SALT_CFG)


SALT_CFG = SimConfig(served_model_names=["m1"])


@pytest.mark.parametrize("api", ["messages", "responses", "embeddings"])
@pytest.mark.parametrize(("salt", "ok"), [("kvg1.abc", True), ("a/b", False), ("", False),
                                          ("s" * 129, False)])
def test_cache_salt_rule_on_every_api_vllm_salts(api: str, salt: str, ok: bool) -> None:
    """vLLM 0.32 applies validate_cache_salt to Messages (through the chat request it converts
    to), Responses and pooling requests as to chat and completions."""
    if ok:
        _salted(api, salt)
        return
    with pytest.raises(ApiError) as caught:
        _salted(api, salt)
    assert (caught.value.status, caught.value.param) == (400, "cache_salt")
