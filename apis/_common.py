"""Helpers shared by the Messages and Responses adapters: field validation, estimates, SSE bytes.

Pure: no I/O, no state.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from kvgate.middleware.framework.errors import BadRequest, HTTPError
from kvgate.middleware.framework.types import Usage
from kvgate.pricing.cost import TokenCounts


def require_model(data: Mapping[str, Any]) -> str:
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("model: a non-empty string is required", param="model")
    return model


def optional_bool(data: Mapping[str, Any], key: str, default: bool = False) -> bool:
    value = data.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"{key}: must be a boolean", param=key)
    return value


def optional_str(data: Mapping[str, Any], key: str) -> str | None:
    value = data.get(key)
    if value is not None and not isinstance(value, str):
        raise BadRequest(f"{key}: must be a string", param=key)
    return value


def optional_list(data: Mapping[str, Any], key: str) -> list[Any] | None:
    value = data.get(key)
    if value is not None and not isinstance(value, list):
        raise BadRequest(f"{key}: must be an array", param=key)
    return value


def estimate_tokens(*parts: object) -> int:
    """Prompt tokens before any tokenizer: serialised bytes / 4 (the project's estimate)."""
    size = 0
    for part in parts:
        if isinstance(part, str):
            size += len(part.encode())
        elif part is not None:
            size += len(orjson.dumps(part))
    return size // 4


def template_kwargs(user: object, effort: object) -> dict[str, Any]:
    """The chat-template variables vLLM renders with (``build_chat_params``,
    openai/chat_completion/protocol.py:621-655, responses/protocol.py:420-458): the client's
    ``chat_template_kwargs``, then ``reasoning_effort`` and, unless the client set it,
    ``enable_thinking`` (``effort != "none"``) when an effort is given."""
    kwargs = dict(user) if isinstance(user, Mapping) else {}
    if isinstance(effort, str):
        if "enable_thinking" not in kwargs:
            kwargs["enable_thinking"] = effort != "none"
        if effort != "auto":  # merge_kwargs drops "auto" (renderers/params.py:36-48)
            kwargs["reasoning_effort"] = effort
    return kwargs


def to_usage(counts: TokenCounts | None) -> Usage | None:
    """The core's :class:`Usage` for normalised counts (same semantics, gateway type)."""
    if counts is None:
        return None
    return Usage(prompt_tokens=counts.prompt, completion_tokens=counts.completion,
                 cached_tokens=counts.cached, cache_write_tokens=counts.cache_write)


def sse(name: str | None, data: Mapping[str, Any]) -> bytes:
    """One server-sent event."""
    head = b"event: " + name.encode() + b"\n" if name else b""
    return head + b"data: " + orjson.dumps(data) + b"\n\n"


def error_message(err: HTTPError) -> str:
    """The message to show (an engine's 4xx: its own, already cleaned; see
    middleware/framework/errors.py)."""
    return err.message


def openai_error_body(err: HTTPError) -> bytes:
    """``{"error": {"message", "type", "param", "code"}}`` (an engine's 4xx: its message)."""
    return orjson.dumps(err.body())


__all__ = ["error_message", "estimate_tokens", "openai_error_body", "optional_bool",
           "optional_list", "optional_str", "require_model", "sse", "template_kwargs", "to_usage"]
