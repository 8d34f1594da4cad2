"""Request parsing: every 400 case, token-id prompts, request ids."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvgate.middleware.framework.errors import BadRequest
from kvgate.middleware.framework.types import Api
from kvgate.middleware.serving.requests import RequestIds, client_request_id, parse_request

CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _parse(api: Api, body: Any, headers: dict[str, str] | None = None) -> Any:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return parse_request(api, raw, headers or {}, "rid")


BAD: list[tuple[Api, Any, str, str | None]] = [
    (Api.CHAT, b"", "empty", None),
    (Api.CHAT, b"{not json", "not valid JSON", None),
    (Api.CHAT, b"\xff\xfe", "not valid JSON", None),
    (Api.CHAT, [1, 2], "JSON object", None),
    (Api.CHAT, {"messages": CHAT["messages"]}, "model is required", "model"),
    (Api.CHAT, {**CHAT, "model": ""}, "model is required", "model"),
    (Api.CHAT, {**CHAT, "model": 3}, "model is required", "model"),
    (Api.CHAT, {"model": "m"}, "messages", "messages"),
    (Api.CHAT, {"model": "m", "messages": []}, "messages", "messages"),
    (Api.CHAT, {"model": "m", "messages": ["hi"]}, "messages[0]", "messages"),
    (Api.CHAT, {**CHAT, "stream": "yes"}, "stream must be a boolean", "stream"),
    (Api.CHAT, {**CHAT, "stream_options": 1}, "stream_options", "stream_options"),
    (Api.CHAT, {**CHAT, "max_tokens": -1}, "max_tokens", "max_tokens"),
    (Api.CHAT, {**CHAT, "max_tokens": True}, "max_tokens", "max_tokens"),
    (Api.COMPLETIONS, {"model": "m"}, "prompt is required", "prompt"),
    (Api.COMPLETIONS, {"model": "m", "prompt": 5}, "prompt must be", "prompt"),
    (Api.COMPLETIONS, {"model": "m", "prompt": [1, -2]}, "prompt must be", "prompt"),
    (Api.COMPLETIONS, {"model": "m", "prompt": [1, "a"]}, "prompt must be", "prompt"),
    (Api.COMPLETIONS, {"model": "m", "prompt": []}, "prompt must be", "prompt"),
]


@pytest.mark.parametrize(("api", "body", "needle", "param"), BAD)
def test_bad_requests(api: Api, body: Any, needle: str, param: str | None) -> None:
    with pytest.raises(BadRequest) as info:
        _parse(api, body)
    assert needle in info.value.message
    assert info.value.param == param
    assert info.value.status == 400


@pytest.mark.parametrize(("prompt", "estimate"), [
    ([1, 2, 3], 3),
    ([[1, 2], [3]], 3),
    ("abcdefgh", 3),
    (["abcd", "efgh"], 3),
])
def test_prompts(prompt: Any, estimate: int) -> None:
    req = _parse(Api.COMPLETIONS, {"model": "m", "prompt": prompt})
    assert req.prompt_token_estimate == estimate


def test_chat_request_fields() -> None:
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    req = _parse(Api.CHAT, body, {"authorization": "Bearer sk-secret", "x-session-affinity": "s"})
    assert req.stream and req.client_wants_usage
    assert "authorization" not in req.headers
    assert req.headers["x-session-affinity"] == "s"
    assert req.raw_body is not None
    req.update_body(cache_salt="t")
    assert req.raw_body is None and req.body["cache_salt"] == "t"


@pytest.mark.parametrize(("given", "ok"), [
    ("abc-123", True), ("a" * 128, True), ("a" * 129, False), ("bad id", False), ("x\n", False),
])
def test_client_request_id(given: str, ok: bool) -> None:
    if ok:
        assert client_request_id({"x-request-id": given}) == given
    else:
        with pytest.raises(BadRequest):
            client_request_id({"x-request-id": given})


def test_request_ids() -> None:
    assert client_request_id({}) is None
    new_id = RequestIds()
    count = 2 * RequestIds.BATCH + 7  # across two refills of the random bytes
    ids = {new_id() for _ in range(count)}
    assert len(ids) == count
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)
    assert {RequestIds()() for _ in range(50)}.isdisjoint(ids)  # another gateway's ids
