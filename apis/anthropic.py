"""Anthropic Messages API: ``POST /v1/messages`` (JSON and SSE) and ``/v1/messages/count_tokens``.

What vLLM 0.32 does (vllm/entrypoints/anthropic/, docs/apis.md has the full list):

* it converts the request to a chat completion (serving.py:322) and renders that with the chat
  template, so routing matches :func:`kvgate.apis._anthropic_prompt.chat_view` of the body;
* usage follows Anthropic's convention: ``input_tokens = prompt - cache_read - cache_creation``
  (serving.py:63-99), cache fields only when ``--enable-prompt-tokens-details`` is on;
* streaming: ``message_start`` carries ``input_tokens`` = the WHOLE prompt and no cache fields
  (the first chat chunk's continuous usage has no details, serving.py:1012-1033), then
  ``message_delta`` carries the final usage with ``input_tokens`` excluding cache reads and the
  cache fields (serving.py:1036-1061). The tap merges the two field by field, as the anthropic
  SDK does, so ``message_delta``'s numbers win: adding start's input to delta's cache reads
  would count the cached prompt twice.

Pure: no I/O, no state outside a tap.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import orjson
from pydantic import BaseModel, ConfigDict

from kvgate.apis._anthropic_prompt import chat_view
from kvgate.apis._common import (
    error_message,
    estimate_tokens,
    optional_bool,
    optional_list,
    require_model,
    sse,
    template_kwargs,
    to_usage,
)
from kvgate.middleware.framework.api import ChatPrompt, ParsedRequest, SseEvent
from kvgate.middleware.framework.errors import BadRequest, HTTPError
from kvgate.middleware.framework.types import Usage
from kvgate.pricing.usage_conventions import count, from_anthropic

ROLES = ("user", "assistant", "system")
#: Bytes of the stream events the tap reads: message_start / message_delta carry ``usage``.
MARKERS = (b'"usage"', b'"message_stop"')
#: Anthropic's error ``type`` per HTTP status (docs.anthropic.com errors; the SDK's
#: ``types/shared/*_error_object.py``; 504 is ``timeout_error`` there).
ERROR_TYPES: Mapping[int, str] = {
    400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
    403: "permission_error", 404: "not_found_error", 413: "request_too_large",
    429: "rate_limit_error", 500: "api_error", 502: "api_error", 503: "overloaded_error",
    504: "timeout_error", 529: "overloaded_error",
}


def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status (other 4xx: invalid request; 5xx: api)."""
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def _check_content(content: Any, where: str) -> None:
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise BadRequest(f"{where}: must be a string or an array of content blocks", param=where)
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise BadRequest(f"{where}.{j}: a content block needs a string type",
                             param=f"{where}.{j}.type")


def _check_messages(data: Mapping[str, Any]) -> list[Any]:
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages: a non-empty array is required", param="messages")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise BadRequest(f"messages.{i}: must be an object", param=f"messages.{i}")
        if msg.get("role") not in ROLES:
            raise BadRequest(f"messages.{i}.role: must be one of {', '.join(ROLES)}",
                             param=f"messages.{i}.role")
        if "content" not in msg:
            raise BadRequest(f"messages.{i}.content: field required",
                             param=f"messages.{i}.content")
        _check_content(msg["content"], f"messages.{i}.content")
    return messages


def _check_tools(data: Mapping[str, Any]) -> None:
    for i, tool in enumerate(optional_list(data, "tools") or []):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise BadRequest(f"tools.{i}.name: a string is required", param=f"tools.{i}.name")
        if not isinstance(tool.get("input_schema"), dict):
            raise BadRequest(f"tools.{i}.input_schema: an object is required",
                             param=f"tools.{i}.input_schema")


def _check_common(data: Mapping[str, Any]) -> str:
    """Fields Messages and count_tokens share; returns the model."""
    model = require_model(data)
    _check_messages(data)
    system = data.get("system")
    if system is not None:
        _check_content(system, "system")
    _check_tools(data)
    kwargs = data.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise BadRequest("chat_template_kwargs: must be an object", param="chat_template_kwargs")
    return model


def _max_tokens(data: Mapping[str, Any]) -> int:
    value = count(data.get("max_tokens"))
    if not value:
        raise BadRequest("max_tokens: a positive integer is required", param="max_tokens")
    return value


def reasoning_effort(data: Mapping[str, Any]) -> object:
    """``output_config.effort``, overridden by ``thinking.type == "disabled"`` (serving.py:
    629-670). vLLM renders a disabled thinking as effort ``none``, or ``low`` when its startup
    probe finds the template ignores ``none`` (serving.py:196-219): ``none`` is assumed here."""
    thinking, config = data.get("thinking"), data.get("output_config")
    if isinstance(thinking, Mapping) and thinking.get("type") == "disabled":
        return "none"
    return config.get("effort") if isinstance(config, Mapping) else None


def chat_prompt(data: Mapping[str, Any], merge_inline_system: bool = False) -> ChatPrompt:
    """The prompt the engine renders for a validated Messages (or count_tokens) body."""
    messages, tools = chat_view(data, merge_inline_system)
    return ChatPrompt(messages=messages, tools=tools, template_kwargs=template_kwargs(
        data.get("chat_template_kwargs"), reasoning_effort(data)))


def _merge_usage(into: dict[str, Any], usage: object) -> bool:
    """Field-wise merge, as the anthropic SDK accumulates ``message_delta`` usage."""
    if not isinstance(usage, Mapping):
        return False
    into.update({k: v for k, v in usage.items() if v is not None})
    return True


class MessagesTap:
    """Usage of one Messages answer: the JSON ``usage``, or ``message_start`` merged with
    ``message_delta`` (final there, or at ``message_stop``)."""

    markers: ClassVar[tuple[bytes, ...]] = MARKERS
    sse_done: ClassVar[bool] = False

    def __init__(self) -> None:
        self.usage: Usage | None = None
        self.final = False
        self.state_ids: list[str] = []
        self._fields: dict[str, Any] = {}

    def on_json(self, payload: dict[str, Any]) -> None:
        self.usage = to_usage(from_anthropic(payload.get("usage") or {}))
        self.final = True

    def on_event(self, event: SseEvent) -> bool:
        kind = event.data.get("type", event.name)
        if kind == "message_start":
            message = event.data.get("message")
            if isinstance(message, Mapping) and _merge_usage(self._fields, message.get("usage")):
                self.usage = to_usage(from_anthropic(self._fields))
        elif kind == "message_delta":
            if _merge_usage(self._fields, event.data.get("usage")):
                self.usage = to_usage(from_anthropic(self._fields))
                self.final = True
        elif kind == "message_stop":
            self.final = True
        return True


class NoUsageTap:
    """count_tokens: the answer is ``{"input_tokens": n}``, a count, not usage; nothing to bill."""

    def __init__(self) -> None:
        self.usage: Usage | None = None
        self.final = False
        self.state_ids: list[str] = []

    def on_json(self, payload: dict[str, Any]) -> None:
        self.final = True

    def on_event(self, event: SseEvent) -> bool:
        return True


def _usage_dict(payload: dict[str, Any]) -> dict[str, Any] | None:
    """The usage object of an answer / ``message_delta`` or of ``message_start``'s message."""
    usage = payload.get("usage")
    message = payload.get("message")
    if not isinstance(usage, dict) and isinstance(message, dict):
        usage = message.get("usage")
    return usage if isinstance(usage, dict) else None


def set_cached(payload: dict[str, Any], cached: int | None) -> bool:
    """Make the usage in ``payload`` report ``cached`` cache reads, keeping the total prompt:
    ``input_tokens`` shrinks by what moves into ``cache_read_input_tokens``; None (unknown):
    no ``cache_read_input_tokens``, all of it in ``input_tokens``, as vLLM reports without
    prompt-token details. Drops vLLM's ``kv_transfer_params`` (a plain Anthropic object)."""
    changed = payload.pop("kv_transfer_params", None) is not None
    message = payload.get("message")
    if isinstance(message, dict):
        changed = message.pop("kv_transfer_params", None) is not None or changed
    usage = _usage_dict(payload)
    counts = from_anthropic(usage) if usage is not None else None
    if usage is None or counts is None:
        return changed
    if cached is None:
        uncached = counts.prompt - counts.cache_write
        if usage.get("input_tokens") == uncached and "cache_read_input_tokens" not in usage:
            return changed
        usage["input_tokens"] = uncached
        usage.pop("cache_read_input_tokens", None)
        return True
    cached = min(max(cached, 0), counts.prompt - counts.cache_write)
    uncached = counts.prompt - cached - counts.cache_write
    if usage.get("input_tokens") == uncached and usage.get("cache_read_input_tokens") == cached:
        return changed
    usage["input_tokens"], usage["cache_read_input_tokens"] = uncached, cached
    return True


def anthropic_error(err: HTTPError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(err.status),
                                       "message": error_message(err)}}


class _AnthropicShape:
    """What both Anthropic endpoints share: paths, errors (an engine's 4xx too: vLLM answers
    validation errors on the Messages routes in OpenAI's shape; :meth:`error_body` gives
    Anthropic's, with the engine's status and message)."""

    def upstream_path(self, path: str) -> str:
        return path

    def prepare_body(self, body: dict[str, Any], stream: bool) -> dict[str, Any] | None:
        return None  # vLLM's Messages streams always carry usage (serving.py:683)

    def error_body(self, err: HTTPError) -> bytes:
        return orjson.dumps(anthropic_error(err))

    def stream_error(self, message: str) -> bytes:
        return sse("error", {"type": "error", "error": {"type": "api_error",
                                                        "message": message}})


class MessagesAdapter(_AnthropicShape):
    """``POST /v1/messages``. ``merge_inline_system``: render system messages found inside
    ``messages`` into the leading system prompt, as vLLM does when the model's chat template
    requires system-first ordering (serving.py:239-299, e.g. Qwen); default off."""

    name: ClassVar[str] = "messages"
    routes: ClassVar[tuple[tuple[str, str], ...]] = (("POST", "/v1/messages"),)
    #: vLLM's Messages request takes kv_transfer_params and answers them (protocol.py:276,395).
    disaggregable: ClassVar[bool] = True

    class Params(BaseModel):
        """Options from the config's ``apis.messages`` section (docs/config.md)."""

        model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
        #: Merge inline system messages into the leading system prompt (Qwen-like templates).
        merge_inline_system: bool = False

    def __init__(self, merge_inline_system: bool = False) -> None:
        self.merge_inline_system = merge_inline_system

    def parse(self, data: dict[str, Any], headers: Mapping[str, str]) -> ParsedRequest:
        model = _check_common(data)
        _max_tokens(data)
        stream = optional_bool(data, "stream")
        prompt = chat_prompt(data, self.merge_inline_system)
        return ParsedRequest(model=model, stream=stream, prompt=prompt,
                             prompt_token_estimate=estimate_tokens(
                                 data.get("system"), data.get("messages"), data.get("tools")),
                             client_wants_usage=True)

    def new_tap(self, client_wants_usage: bool) -> MessagesTap:
        return MessagesTap()

    def set_cached_tokens(self, payload: dict[str, Any], cached: int | None) -> bool:
        return set_cached(payload, cached)


class CountTokensAdapter(_AnthropicShape):
    """``POST /v1/messages/count_tokens``: the engine renders and counts, no inference. Not
    routed on the prompt (any engine renders it equally; tokenizing a 500 KB agent prompt in the
    gateway to pick one would cost more than it saves), no token load, never billed."""

    name: ClassVar[str] = "count_tokens"
    routes: ClassVar[tuple[tuple[str, str], ...]] = (("POST", "/v1/messages/count_tokens"),)
    disaggregable: ClassVar[bool] = False
    billed: ClassVar[bool] = False

    def parse(self, data: dict[str, Any], headers: Mapping[str, str]) -> ParsedRequest:
        model = _check_common(data)
        if data.get("stream"):
            raise BadRequest("stream: count_tokens does not stream", param="stream")
        return ParsedRequest(model=model, stream=False, prompt=None, prompt_token_estimate=0)

    def new_tap(self, client_wants_usage: bool) -> NoUsageTap:
        return NoUsageTap()

    def set_cached_tokens(self, payload: dict[str, Any], cached: int | None) -> bool:
        return False


__all__ = ["ERROR_TYPES", "CountTokensAdapter", "MessagesAdapter", "MessagesTap", "NoUsageTap",
           "anthropic_error", "chat_prompt", "error_type", "set_cached"]
