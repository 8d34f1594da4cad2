"""Request parsing (vLLM-like validation) and response shapes."""

from __future__ import annotations

from typing import Any

import pytest

from kvgate.engines.sim.core.config import SimConfig
from kvgate.engines.sim.core.scheduler import TokenOut
from kvgate.engines.sim.core.tokenizer import chat_token_ids, tokenize
from kvgate.engines.sim.http.protocol import Api, ApiError, Shaper, Usage, parse_request

CFG = SimConfig(capacity_blocks=64, served_model_names=["m1", "m2"])  # max_model_len 1024
MSGS = [{"role": "user", "content": "hello there"}]


@pytest.mark.parametrize(("api", "body", "ids"), [
    ("completions", {"prompt": "hello there"}, tokenize("hello there")),
    ("completions", {"prompt": ["hello there"]}, tokenize("hello there")),
    ("completions", {"prompt": [5, 6, 7]}, [5, 6, 7]),
    ("completions", {"prompt": [[5, 6, 7]]}, [5, 6, 7]),
    ("chat", {"messages": MSGS}, chat_token_ids(MSGS)),
    ("chat", {"messages": MSGS, "add_generation_prompt": False}, chat_token_ids(MSGS, False)),
])
def test_prompt_forms(api: Api, body: dict[str, Any], ids: list[int]) -> None:
    assert parse_request(api, {"model": "m2", **body}, CFG).prompt_ids == ids


@pytest.mark.parametrize(("api", "body", "expected"), [
    ("completions", {"prompt": [1, 2, 3]}, 1021),
    ("completions", {"prompt": [1, 2, 3], "max_tokens": 7}, 7),
    ("chat", {"messages": MSGS, "max_tokens": 7, "max_completion_tokens": 9}, 9),
    ("chat", {"messages": MSGS, "max_tokens": 7}, 7),
])
def test_max_tokens(api: Api, body: dict[str, Any], expected: int) -> None:
    assert parse_request(api, body, CFG).max_tokens == expected


@pytest.mark.parametrize(("body", "include_usage"), [
    ({"stream": True}, False),
    ({"stream": True, "stream_options": {"include_usage": True}}, True),
    ({"stream": True, "stream_options": {}}, False),
])
def test_stream_options(body: dict[str, Any], include_usage: bool) -> None:
    req = parse_request("completions", {"prompt": "x", **body}, CFG)
    assert req.stream and req.include_usage is include_usage


def test_passthrough_fields() -> None:
    req = parse_request("completions", {
        "prompt": "x", "cache_salt": "t", "ignore_eos": True, "seed": 3, "min_tokens": 2,
        "temperature": 0.7, "kv_transfer_params": {"do_remote_decode": True}, "foo": "ignored",
    }, CFG)
    assert (req.cache_salt, req.ignore_eos, req.seed, req.min_tokens) == ("t", True, 3, 2)
    assert req.kv_transfer_params == {"do_remote_decode": True}
    assert req.model == "m1"  # defaulted to the first served name


@pytest.mark.parametrize(("api", "body", "status", "param"), [
    ("completions", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("completions", [], 400, None),
    ("completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("completions", {"prompt": [[1], [2]]}, 400, "prompt"),
    ("completions", {"prompt": []}, 400, "prompt"),
    ("completions", {"prompt": ""}, 400, "prompt"),
    ("completions", {"prompt": [1, -1]}, 400, "prompt"),
    ("completions", {"prompt": [1, 10**9]}, 400, "prompt"),
    ("completions", {"prompt": 5}, 400, "prompt"),
    ("completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": True}, 400, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": 2000}, 400, "max_tokens"),
    ("completions", {"prompt": [1] * 1024}, 400, "prompt"),
    ("chat", {"messages": [{"role": "user", "content": "a " * 1100}]}, 400, "messages"),
    ("completions", {"prompt": "x", "n": 2}, 400, "n"),
    ("completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("completions", {"prompt": "x", "cache_salt": ""}, 400, "cache_salt"),
    # vLLM 0.32 validate_cache_salt: <= 128 characters, no '@', '/', '\\' or NUL
    ("completions", {"prompt": "x", "cache_salt": "s" * 129}, 400, "cache_salt"),
    ("chat", {"messages": MSGS, "cache_salt": "tenant/a"}, 400, "cache_salt"),
    ("chat", {"messages": MSGS, "cache_salt": "a@b"}, 400, "cache_salt"),
    ("chat", {"messages": MSGS, "cache_salt": "a\\b"}, 400, "cache_salt"),
    ("chat", {"messages": MSGS, "cache_salt": "a\x00b"}, 400, "cache_salt"),
    ("chat", {"messages": MSGS, "cache_salt": 7}, 400, "cache_salt"),
    ("completions", {"prompt": "x", "kv_transfer_params": [1]}, 400, "kv_transfer_params"),
    ("completions", {"prompt": "x", "max_tokens": 2, "min_tokens": 3}, 400, "min_tokens"),
    ("chat", {"messages": "hi"}, 400, "messages"),
    ("chat", {"messages": []}, 400, "messages"),
    ("chat", {"messages": [{"role": "bot", "content": "x"}]}, 400, "messages"),
    ("chat", {"messages": MSGS, "add_generation_prompt": 1}, 400, "add_generation_prompt"),
])
def test_rejections(api: Api, body: Any, status: int, param: str | None) -> None:
    with pytest.raises(ApiError) as info:
        parse_request(api, body, CFG)
    assert (info.value.status, info.value.param) == (status, param)
    error = info.value.body()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status


@pytest.mark.parametrize(("api", "details", "obj", "chunk_obj"), [
    ("chat", True, "chat.completion", "chat.completion.chunk"),
    ("completions", False, "text_completion", "text_completion"),
])
def test_shapes(api: Api, details: bool, obj: str, chunk_obj: str) -> None:
    body: dict[str, Any] = {"prompt": "x"} if api == "completions" else {"messages": MSGS}
    shaper = Shaper(parse_request(api, body, CFG), "id-1", 100, details)
    toks = [TokenOut(7, " ka"), TokenOut(8, " mo", "length")]
    usage = Usage(10, 2, 8)
    full = shaper.full(toks, usage, "length")
    assert (full["id"], full["object"], full["model"]) == ("id-1", obj, "m1")
    choice = full["choices"][0]
    text = choice["message"]["content"] if api == "chat" else choice["text"]
    assert text == " ka mo" and choice["finish_reason"] == "length"
    expected_usage: dict[str, Any] = {"prompt_tokens": 10, "total_tokens": 12,
                                      "completion_tokens": 2}
    if details:
        expected_usage["prompt_tokens_details"] = {"cached_tokens": 8}
    assert full["usage"] == expected_usage
    last = shaper.token_chunk(toks[1])
    assert last["object"] == chunk_obj and last["choices"][0]["finish_reason"] == "length"
    assert shaper.usage_chunk(usage) == {**shaper.head, "choices": [], "usage": expected_usage}


@pytest.mark.parametrize("salt", ["s" * 128, "kvg1.Zm9vYmFy-_x", "tenant:a b"])
def test_cache_salts_vllm_accepts(salt: str) -> None:
    assert parse_request("chat", {"messages": MSGS, "cache_salt": salt}, CFG).cache_salt == salt
