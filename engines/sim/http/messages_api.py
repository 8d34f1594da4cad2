"""Anthropic Messages (``POST /v1/messages``, ``/v1/messages/count_tokens``) as vLLM 0.32
serves it: the request becomes a chat conversation (vLLM's ``to_chat_completion_request``,
mirrored by :func:`to_chat_messages`), rendered with the simulator's chat template, and the
answer is shaped as vLLM's ``anthropic/serving.py`` shapes it.

Usage (vLLM's ``_build_anthropic_usage``): ``input_tokens`` = prompt - cache read - cache
write, ``cache_read_input_tokens`` = prefix-cache hit, ``cache_creation_input_tokens`` = full
blocks written (:func:`kvgate.engines.sim.http.agent_common.cache_write_tokens`); both cache keys
absent without prompt-token details. A stream's ``message_start`` carries ``{"input_tokens": <whole
prompt>, "output_tokens": 0}`` (no cache keys: vLLM builds it from the first chunk's running
usage), its ``message_delta`` the split above. Errors from the handler are Anthropic-shaped
``{"type": "error", "error": {"type": <OpenAI error class name>, "message"}}``; validation
errors stay OpenAI-shaped (:mod:`kvgate.engines.sim.http.agent_common`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvgate.engines.sim.core.config import SimConfig
from kvgate.engines.sim.core.tokenizer import TemplateError, chat_token_ids
from kvgate.engines.sim.http.agent_common import (
    Field,
    ValidationFailed,
    cache_write_tokens,
    check_fields,
    named_sse,
    output_limit,
    resolve_model,
)
from kvgate.engines.sim.http.protocol import ApiError, ParsedRequest, Usage, check_cache_salt

_MESSAGE_FIELDS = (
    Field("model", "str", True), Field("messages", "list", True), Field("max_tokens", "int", True),
    Field("stream", "bool"), Field("system", "str|list"), Field("temperature", "number"),
    Field("top_p", "number"), Field("top_k", "int"), Field("tools", "list"),
    Field("tool_choice", "dict"), Field("stop_sequences", "list"), Field("metadata", "dict"),
    Field("cache_salt", "str"), Field("kv_transfer_params", "dict"),
)
_COUNT_FIELDS = (
    Field("model", "str", True), Field("messages", "list", True), Field("system", "str|list"),
    Field("tools", "list"), Field("tool_choice", "dict"),
)
_BILLING_HEADER = "x-anthropic-billing-header"
_AUTO_TOOLS = ('"auto" tool choice requires --enable-auto-tool-choice and '
               "--tool-call-parser to be set")
_STOP_REASONS = {"length": "max_tokens", "stop": "end_turn"}


def anthropic_error(exc: ApiError) -> dict[str, Any]:
    """vLLM's Anthropic error body; a validation error keeps the OpenAI shape."""
    if isinstance(exc, ValidationFailed):
        return exc.body()
    kind = exc.body()["error"]["type"]
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


def _system_text(system: Any) -> str:
    if isinstance(system, str):
        return system
    parts = [b.get("text") for b in system if isinstance(b, Mapping) and b.get("type") == "text"]
    return "".join(t for t in parts if isinstance(t, str) and t
                   and not t.startswith(_BILLING_HEADER))


def _tool_result_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(i.get("text", "")) for i in content
                         if isinstance(i, Mapping) and i.get("type") == "text")
    return ""


def _convert_blocks(role: str, blocks: Sequence[Any], out: list[dict[str, Any]]) -> None:
    """One message's content blocks (vLLM's ``_convert_message_content``); tool results of a
    user message become ``tool`` messages ahead of it."""
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for i, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind == "text" and block.get("text"):
            parts.append({"type": "text", "text": str(block["text"])})
        elif kind == "tool_use":
            args = json.dumps(block.get("input") or {})
            calls.append({"id": block.get("id") or "call_0", "type": "function",
                          "function": {"name": block.get("name") or "", "arguments": args}})
        elif kind == "tool_result" and role == "user":
            out.append({"role": "tool", "tool_call_id": block.get("tool_use_id") or "",
                        "content": _tool_result_text(block.get("content"))})
        elif kind == "tool_result":
            parts.append({"type": "text", "text": f"Tool result: {block.get('content') or ''}"})
        elif kind not in ("text", "thinking", "redacted_thinking", "tool_reference"):
            raise ApiError(400, f"messages: content block {i} of type {kind!r} is not supported "
                           "by the simulator (text, tool_use, tool_result, thinking)", "messages")
    msg: dict[str, Any] = {"role": role}
    if calls:
        msg["tool_calls"] = calls
    if len(parts) == 1:
        msg["content"] = parts[0]["text"]
    elif parts:
        msg["content"] = parts
    if not (role == "user" and "content" not in msg):
        out.append(msg)


def to_chat_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The chat conversation vLLM renders for a Messages body (``system`` first, billing
    headers stripped, ``tool_use`` → ``tool_calls``, user ``tool_result`` → ``tool``)."""
    out: list[dict[str, Any]] = []
    system = _system_text(body["system"]) if body.get("system") else ""
    if system:
        out.append({"role": "system", "content": system})
    for i, msg in enumerate(body["messages"]):
        if not isinstance(msg, Mapping) or msg.get("role") not in ("user", "assistant", "system"):
            raise ValidationFailed([{"type": "literal_error", "loc": f"body.messages.{i}.role",
                                     "msg": "Input should be 'user', 'assistant' or 'system'",
                                     "input": str(msg.get("role") if isinstance(msg, Mapping)
                                                  else msg)}])
        role, content = str(msg["role"]), msg.get("content")
        if role == "system":
            text = _system_text(content) if content else ""
            if text and not text.startswith(_BILLING_HEADER):
                out.append({"role": "system", "content": text})
        elif isinstance(content, str):
            out.append({"role": role, "content": content})
        else:
            _convert_blocks(role, content if isinstance(content, list) else [], out)
    return out


def _check_tools(body: Mapping[str, Any], config: SimConfig) -> None:
    choice = body.get("tool_choice") or {}
    if body.get("tools") and choice.get("type", "auto") == "auto" \
            and not config.enable_auto_tool_choice:
        raise ApiError(400, _AUTO_TOOLS)


def prompt_ids(body: Mapping[str, Any], config: SimConfig) -> list[int]:
    """The token ids the engine prefills for a Messages (or count_tokens) body."""
    _check_tools(body, config)
    try:
        return chat_token_ids(to_chat_messages(body))
    except TemplateError as exc:
        raise ApiError(400, str(exc), "messages") from None


def parse_messages(body: Any, config: SimConfig) -> ParsedRequest:
    """Validate a ``/v1/messages`` body into the engine request."""
    body = check_fields(body, _MESSAGE_FIELDS)
    check_cache_salt(body.get("cache_salt"))
    model = resolve_model(body["model"], config.served_model_names)
    ids = prompt_ids(body, config)
    max_tokens = output_limit("max_completion_tokens", body["max_tokens"], len(ids),
                              config.effective_max_model_len)
    return ParsedRequest(api="chat", model=model, prompt_ids=ids, max_tokens=max_tokens,
                         stream=bool(body.get("stream")), include_usage=True,
                         cache_salt=body.get("cache_salt"),
                         kv_transfer_params=body.get("kv_transfer_params"))


def count_tokens(body: Any, config: SimConfig) -> dict[str, Any]:
    """``/v1/messages/count_tokens``: the rendered prompt's length."""
    body = check_fields(body, _COUNT_FIELDS)
    resolve_model(body["model"], config.served_model_names)
    n = len(prompt_ids(body, config))
    return {"input_tokens": n, "context_management": {"original_input_tokens": n}}


@dataclass(frozen=True, slots=True)
class MessagesShaper:
    """One Messages request's answer objects in vLLM's shape."""

    message_id: str
    model: str
    block_size: int
    prompt_details: bool

    def usage(self, u: Usage) -> dict[str, Any]:
        out: dict[str, Any] = {"input_tokens": u.prompt_tokens, "output_tokens":
                               u.completion_tokens}
        if self.prompt_details:
            written = cache_write_tokens(u.prompt_tokens, u.cached_tokens, self.block_size)
            out["input_tokens"] = max(0, u.prompt_tokens - u.cached_tokens - written)
            out["cache_creation_input_tokens"] = written
            out["cache_read_input_tokens"] = u.cached_tokens
        return out

    def full(self, text: str, u: Usage, finish_reason: str | None) -> dict[str, Any]:
        """The JSON answer (``stop_sequence`` left out when null, as vLLM's
        ``exclude_none`` dump does)."""
        return {"id": self.message_id, "type": "message", "role": "assistant",
                "content": [{"type": "text", "text": text}], "model": self.model,
                "stop_reason": _STOP_REASONS.get(finish_reason or "", "end_turn"),
                "usage": self.usage(u)}

    def start(self, prompt_tokens: int) -> list[bytes]:
        """``message_start`` then the text block's ``content_block_start``."""
        message: dict[str, Any] = {"id": self.message_id, "type": "message", "role": "assistant",
                   "content": [], "model": self.model, "stop_reason": None,
                   "stop_sequence": None,
                   "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}
        return [named_sse("message_start", {"type": "message_start", "message": message}),
                named_sse("content_block_start", {"type": "content_block_start",
                                                  "content_block": {"type": "text", "text": ""},
                                                  "index": 0})]

    @staticmethod
    def delta(text: str) -> bytes:
        return named_sse("content_block_delta", {"type": "content_block_delta", "delta": {
            "type": "text_delta", "text": text}, "index": 0})

    def end(self, u: Usage, finish_reason: str | None) -> list[bytes]:
        """``content_block_stop``, ``message_delta`` (stop reason, usage), ``message_stop``."""
        delta = {"stop_reason": _STOP_REASONS.get(finish_reason or "", "end_turn"),
                 "stop_sequence": None}
        return [named_sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
                named_sse("message_delta", {"type": "message_delta", "delta": delta,
                                            "usage": self.usage(u)}),
                named_sse("message_stop", {"type": "message_stop"})]
