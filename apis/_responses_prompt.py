"""OpenAI Responses request -> the OpenAI chat messages and tools vLLM renders (non-Harmony).

A transcription of vLLM 0.32's ``construct_input_messages`` /
``construct_chat_messages_with_tool_call`` (vllm/entrypoints/openai/responses/utils.py:248-442)
and ``construct_tool_dicts`` (utils.py:474-499, tool_parsers/utils.py:212-284), called by
``OnlineRenderer.render_responses`` (renderers/online_renderer.py:319-382).

Two differences, both rendering-neutral: a user/system/developer item is passed on as
``{"role", "content"}`` (vLLM passes the whole item, whose ``type``/``id`` keys no chat template
reads), and its ``input_text`` / ``output_text`` parts become ``text`` parts (vLLM's content
parser treats the three alike, renderers/chat_utils.py:1653-1654).

``previous_response_id``: the engine prepends the stored conversation (its messages, then the
previous output's assistant text, utils.py:264-281) to what is built here, so this view is only
the new turn; see :mod:`kvgate.apis.responses` for what routing does with it.

Pure: no I/O, no state.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

Message = dict[str, Any]
NAMESPACE_SEPARATOR = "__"  # tool_parsers/utils.py:199
CUSTOM_INPUT_KEY = "input"  # tool_parsers/utils.py:42
_TEXT_PARTS = ("input_text", "output_text")


def _text_part(part: Any) -> Any:
    if isinstance(part, Mapping) and part.get("type") in _TEXT_PARTS:
        return {"type": "text", "text": part.get("text")}
    return part


def _role_message(item: Mapping[str, Any]) -> Message:
    content = item.get("content")
    if isinstance(content, list):
        content = [_text_part(p) for p in content]
    return {"role": item["role"], "content": content}


def _call(item: Mapping[str, Any]) -> dict[str, Any]:
    name, arguments = item.get("name"), item.get("arguments")
    if item.get("type") == "custom_tool_call":
        arguments = json.dumps({CUSTOM_INPUT_KEY: item.get("input") or ""}, ensure_ascii=False)
    elif item.get("namespace"):
        name = f"{item['namespace']}{NAMESPACE_SEPARATOR}{name}"
    return {"id": item.get("call_id"), "function": {"name": name, "arguments": arguments},
            "type": "function"}


def _reasoning(item: Mapping[str, Any]) -> str:
    for key in ("content", "summary"):
        parts = item.get(key)
        if isinstance(parts, list) and parts and isinstance(parts[0], Mapping):
            return str(parts[0].get("text", ""))
    return ""


def _assistant_text(item: Mapping[str, Any]) -> str | None:
    content = item.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and isinstance(content[0], Mapping):
        text = content[0].get("text")
        return text if isinstance(text, str) else None
    return None


def _merge(prev: Message | None, key: str, value: Any) -> bool:
    """Fold ``value`` into the previous assistant message when that slot is free."""
    if prev is None or prev.get("role") != "assistant":
        return False
    if key == "tool_calls":
        prev.setdefault("tool_calls", []).append(value)
        return True
    if prev.get(key) is None:
        prev[key] = value
        return True
    return False


def _item(item: Mapping[str, Any], prev: Message | None) -> Message | None:
    """One input item (utils.py:311-442); None when folded into ``prev`` or not renderable."""
    kind = item.get("type")
    if kind in ("function_call", "custom_tool_call"):
        call = _call(item)
        return None if _merge(prev, "tool_calls", call) else {
            "role": "assistant", "tool_calls": [call]}
    if kind == "reasoning":
        reasoning = _reasoning(item)
        return None if _merge(prev, "reasoning", reasoning) else {"role": "assistant",
                                                                  "reasoning": reasoning}
    if kind in ("function_call_output", "custom_tool_call_output"):
        return {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
    if item.get("role") == "assistant":
        text = _assistant_text(item)
        if text is None:
            return None
        return None if _merge(prev, "content", text) else {"role": "assistant", "content": text}
    return _role_message(item) if "role" in item else None


def input_messages(instructions: str | None, items: str | Sequence[Any]) -> list[Message]:
    """The chat messages of ``instructions`` and ``input`` (no previous response)."""
    out: list[Message] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        out.append({"role": "user", "content": items})
        return out
    new: list[Message] = []
    for item in items:
        if isinstance(item, Mapping):
            message = _item(item, new[-1] if new else None)
            if message is not None:
                new.append(message)
    return out + new


def _function(tool: Mapping[str, Any], name: Any = None) -> dict[str, Any]:
    """``ChatCompletionToolsParam.model_dump()`` of a function tool (strict / defer_loading
    only when set, generate/base/protocol.py:298-315)."""
    function: dict[str, Any] = {"name": name or tool.get("name"),
                                "description": tool.get("description"),
                                "parameters": tool.get("parameters")}
    for key in ("strict", "defer_loading"):
        if tool.get(key) is not None:
            function[key] = tool[key]
    return {"type": "function", "function": function}


def _custom_parameters() -> dict[str, Any]:
    return {"type": "object", "properties": {CUSTOM_INPUT_KEY: {
        "type": "string", "description": "The freeform text payload for this tool."}},
        "required": [CUSTOM_INPUT_KEY], "additionalProperties": False}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def tool_dicts(tools: Sequence[Any]) -> list[dict[str, Any]] | None:
    """The tools the chat template sees: function tools, namespace functions flattened to
    ``<namespace>__<name>``, custom tools as a one-string function; the rest never rendered."""
    if not tools:
        return None
    out: list[dict[str, Any]] = []
    for tool in tools:
        kind = tool.get("type") if isinstance(tool, Mapping) else None
        if kind == "function":
            out.append(_function(tool))
        elif kind == "custom":
            out.append(_function({**tool, "parameters": _custom_parameters()}))
        elif kind == "namespace":
            out.extend(_function(t, f"{tool.get('name')}{NAMESPACE_SEPARATOR}{t.get('name')}")
                       for t in _list(tool.get("tools")) if isinstance(t, Mapping)
                       and t.get("type") == "function")
    return out


__all__ = ["input_messages", "tool_dicts"]
