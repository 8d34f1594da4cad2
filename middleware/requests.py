"""Parsing and validating OpenAI request bodies into :class:`InferenceRequest`.

Validation is deliberately shallow: the fields the gateway itself relies on are checked with
clear 400s; everything else is passed through for the engine to judge (it knows its limits).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Mapping
from typing import Any

from middleware.errors import BadRequest
from middleware.types import Api, InferenceRequest

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
#: Rough bytes per prompt token for text, used only to size in-flight token estimates before a
#: tokenizer (a plugin) refines them; ~4 bytes/token holds for English BPE vocabularies.
BYTES_PER_TOKEN = 4


def client_request_id(headers: Mapping[str, str]) -> str | None:
    """The client's ``x-request-id`` if given and well-formed (400 if malformed), else None.

    It is echoed on the response and kept in the ledger as ``client_request_id``, but it never
    identifies the request inside kvgate: clients reuse ids (retries, bugs, malice), and each
    request that reaches an engine is billed once on its own (see :func:`new_request_id`)."""
    given = headers.get("x-request-id")
    if given is None:
        return None
    if not _REQUEST_ID.fullmatch(given):
        raise BadRequest(
            "x-request-id must be 1-128 characters of [A-Za-z0-9._:-]", param="x-request-id"
        )
    return given


def new_request_id() -> str:
    """kvgate's own id for one request: the ledger key and the engines' ``X-Request-Id``,
    unique per request whatever the client sends."""
    return uuid.uuid4().hex


def _load(body: bytes) -> dict[str, Any]:
    if not body:
        raise BadRequest("request body is empty; expected a JSON object")
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BadRequest("request body must be a JSON object")
    return data


def _is_token_ids(value: object) -> bool:
    """A non-empty list of non-negative ints (not bools). The type test runs in C
    (``set(map(type, ...))``): a 15k-token prompt is checked in ~0.2 ms instead of ~2 ms of
    Python-level ``isinstance`` calls, which profiled as 15 % of the gateway's CPU at
    80 req/s of Mooncake-trace prompts."""
    return (isinstance(value, list) and bool(value) and set(map(type, value)) == {int}
            and min(value) >= 0)


def _check_prompt(prompt: object) -> int:
    """Validates a completions prompt; returns its estimated token count."""
    if isinstance(prompt, str):
        return len(prompt) // BYTES_PER_TOKEN + 1
    if _is_token_ids(prompt):
        assert isinstance(prompt, list)
        return len(prompt)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return sum(len(p) for p in prompt) // BYTES_PER_TOKEN + 1
        if all(_is_token_ids(p) for p in prompt):
            return sum(len(p) for p in prompt)
    raise BadRequest(
        "prompt must be a string, a list of strings, a list of token ids, or a list of "
        "token-id lists",
        param="prompt",
    )


def _check_messages(messages: object, body_size: int) -> int:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty array", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(
                f"messages[{i}] must be an object with a string role", param="messages"
            )
    return body_size // BYTES_PER_TOKEN + 1


def _check_common(data: Mapping[str, Any]) -> tuple[str, bool, bool]:
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("model is required and must be a non-empty string", param="model")
    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream must be a boolean", param="stream")
    opts = data.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise BadRequest("stream_options must be an object", param="stream_options")
    wants_usage = bool(opts.get("include_usage")) if isinstance(opts, dict) else False
    for key in ("max_tokens", "max_completion_tokens", "n"):
        value = data.get(key)
        bad = not isinstance(value, int) or isinstance(value, bool) or value < 0
        if value is not None and bad:
            raise BadRequest(f"{key} must be a non-negative integer", param=key)
    return model, stream, wants_usage


def parse_request(
    api: Api, body: bytes, headers: Mapping[str, str], rid: str, client_rid: str | None = None
) -> InferenceRequest:
    """Validate the body of a chat or completions request (400 with ``param`` on problems)."""
    data = _load(body)
    model, stream, wants_usage = _check_common(data)
    if api is Api.CHAT:
        estimate = _check_messages(data.get("messages"), len(body))
    else:
        if "prompt" not in data:
            raise BadRequest("prompt is required", param="prompt")
        estimate = _check_prompt(data["prompt"])
    forwarded = {k: v for k, v in headers.items() if k != "authorization"}
    return InferenceRequest(
        request_id=rid, api=api, model=model, body=data, headers=forwarded, stream=stream,
        client_wants_usage=wants_usage, prompt_token_estimate=estimate,
        received_at=time.monotonic(), raw_body=body, client_request_id=client_rid,
    )
