"""Anthropic Messages request -> the OpenAI chat messages and tools vLLM renders.

A transcription of vLLM 0.32's ``AnthropicServingMessages.to_chat_completion_request``
(vllm/entrypoints/anthropic/serving.py:322-791) restricted to what reaches the chat template:
system (serving.py:351-403), messages and content blocks (405-595), tools (716-791). Prefix
routing matches what the engine renders only if this view is the engine's, so it follows the
source line by line, including its quirks (a tool_use id that is missing is the time of day in
vLLM; here it is ``call_0``; arguments are ``json.dumps`` with its default separators).

Pure: no I/O, no state.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

BILLING_HEADER = "x-anthropic-billing-header"
Message = dict[str, Any]


def _block_texts(blocks: Sequence[Any]) -> list[str]:
    """Text of ``text`` blocks, without Claude Code's per-request billing header."""
    return [b["text"] for b in blocks if isinstance(b, Mapping) and b.get("type") == "text"
            and isinstance(b.get("text"), str) and b["text"]
            and not b["text"].startswith(BILLING_HEADER)]


def _system_text(content: Any) -> str | None:
    if isinstance(content, str):
        return None if content.startswith(BILLING_HEADER) else content
    parts = _block_texts(content) if isinstance(content, list) else []
    return "".join(parts) if parts else None


def _system(system: Any, messages: Sequence[Mapping[str, Any]], merge: bool) -> list[Message]:
    parts: list[str] = []
    if isinstance(system, str) and system:
        parts.append(system)
    elif isinstance(system, list):
        parts.extend(_block_texts(system))
    if merge:
        for msg in messages:
            text = _system_text(msg.get("content")) if msg.get("role") == "system" else None
            if text:
                parts.append(text)
    return [{"role": "system", "content": "".join(parts)}] if parts else []


def _image_url(source: Any) -> str:
    if not isinstance(source, Mapping):
        source = {}  # vLLM fails on it; the engine's error to give
    if source.get("type") == "url":
        return str(source.get("url", ""))
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _tool_result_messages(block: Mapping[str, Any]) -> list[Message]:
    """A user's tool_result: a ``tool`` message, then its images and tool references."""
    content, texts = block.get("content"), []
    images: list[str] = []
    refs: list[dict[str, Any]] = []
    for item in content if isinstance(content, list) else []:
        if not isinstance(item, Mapping):
            continue
        if item.get("type") == "text" and isinstance(item.get("text", ""), str):
            texts.append(item.get("text", ""))
        elif item.get("type") == "image" and (url := _image_url(item.get("source", {}))):
            images.append(url)
        elif item.get("type") == "tool_reference" and (
                name := item.get("tool_name") or item.get("name")):
            refs.append({"type": "tool_reference", "name": name})
    text = content if isinstance(content, str) else "\n".join(texts)
    call_id = block.get("tool_use_id") or ""
    out: list[Message] = [{"role": "tool", "tool_call_id": call_id, "content": text or ""}]
    if images:
        out.append({"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": u}} for u in images]})
    if refs:
        out.append({"role": "tool", "tool_call_id": call_id, "content": refs})
    return out


def _tool_call(block: Mapping[str, Any]) -> dict[str, Any]:
    return {"id": block.get("id") or "call_0", "type": "function",
            "function": {"name": block.get("name") or "",
                         "arguments": json.dumps(block.get("input") or {})}}


class _Parts:
    """What the blocks of one message become (serving.py:438-505)."""

    def __init__(self) -> None:
        self.content: list[dict[str, Any]] = []
        self.tool_calls: list[dict[str, Any]] = []
        self.reasoning: list[str] = []
        self.before: list[Message] = []  # tool messages a user's tool_result emits first

    def add(self, block: Mapping[str, Any], role: str) -> None:
        kind = block.get("type")
        if kind == "text" and block.get("text"):
            self.content.append({"type": "text", "text": block["text"]})
        elif kind == "image" and block.get("source"):
            self.content.append({"type": "image_url",
                                 "image_url": {"url": _image_url(block["source"])}})
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            self.reasoning.append(block["thinking"])
        elif kind == "tool_use":
            self.tool_calls.append(_tool_call(block))
        elif kind == "tool_result" and role == "user":
            self.before.extend(_tool_result_messages(block))
        elif kind == "tool_result":
            result = str(block["content"]) if block.get("content") else ""
            self.content.append({"type": "text", "text": f"Tool result: {result}"})

    def fill(self, msg: Message) -> None:
        if self.reasoning:
            msg["reasoning"] = "".join(self.reasoning)
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        if len(self.content) == 1 and self.content[0]["type"] == "text":
            msg["content"] = self.content[0]["text"]
        elif self.content:
            msg["content"] = self.content


def _messages(messages: Sequence[Mapping[str, Any]], merge: bool) -> list[Message]:
    out: list[Message] = []
    for msg in messages:
        role, content = msg.get("role"), msg.get("content")
        if role == "system":
            text = None if merge else _system_text(content)
            if text:
                out.append({"role": "system", "content": text})
            continue
        converted: Message = {"role": role}
        if isinstance(content, str):
            converted["content"] = content
        elif isinstance(content, list):
            parts = _Parts()
            for block in content:
                if isinstance(block, Mapping):
                    parts.add(block, str(role))
            out.extend(parts.before)
            parts.fill(converted)
        if not (role == "user" and "content" not in converted):
            out.append(converted)
    return out


def _tool_changes(messages: Sequence[Mapping[str, Any]]) -> list[tuple[str, Mapping[str, Any]]]:
    """The ``(kind, tool)`` of every tool_addition / tool_removal block, in order."""
    out: list[tuple[str, Mapping[str, Any]]] = []
    for msg in messages:
        content = msg.get("content")
        for block in content if isinstance(content, list) else []:
            kind = block.get("type") if isinstance(block, Mapping) else None
            change = block.get("tool") if kind in ("tool_addition", "tool_removal") else None
            if isinstance(change, Mapping):
                out.append((str(kind), change))
    return out


def _resolve_tools(tools: Sequence[Any], changes: list[tuple[str, Mapping[str, Any]]]) -> list[
        Any]:
    """The tools in effect after the changes (serving.py:716-759); a change naming an unknown
    tool is the engine's 400 to give, so it is skipped here."""
    by_name = {t["name"]: t for t in tools if isinstance(t, Mapping)
               and isinstance(t.get("name"), str)}
    removed: set[str] = set()
    for kind, change in changes:
        definition = change.get("definition")
        if change.get("type") == "tool_definition" and isinstance(definition, Mapping):
            name = definition.get("name")
            if not isinstance(name, str):
                continue
            by_name[name] = definition
        else:
            name = change.get("name")
            if not isinstance(name, str) or name not in by_name:
                continue
            if kind == "tool_addition":
                by_name[name] = {**by_name[name], "defer_loading": None}
        if kind == "tool_removal":
            removed.add(name)
        else:
            removed.discard(name)
    return [t for n, t in by_name.items() if n not in removed]


def _tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    """``ChatCompletionToolsParam(...).model_dump()`` of an Anthropic tool: description always
    present (None when absent), strict / defer_loading only when set (protocol.py:108-124)."""
    schema = tool.get("input_schema")
    params = dict(schema) if isinstance(schema, Mapping) else schema
    if isinstance(params, dict) and "type" not in params:
        params["type"] = "object"
    function: dict[str, Any] = {"name": tool.get("name"), "description": tool.get("description"),
                                "parameters": params}
    for key in ("strict", "defer_loading"):
        if tool.get(key) is not None:
            function[key] = tool[key]
    return {"type": "function", "function": function}


def chat_view(data: Mapping[str, Any], merge_inline_system: bool = False) -> tuple[
        list[Message], list[dict[str, Any]] | None]:
    """The chat messages and tools vLLM renders for a validated Messages body."""
    messages: Sequence[Mapping[str, Any]] = data.get("messages") or []
    out = _system(data.get("system"), messages, merge_inline_system)
    out.extend(_messages(messages, merge_inline_system))
    tools = data.get("tools")
    listed = tools if isinstance(tools, list) else None
    changes = _tool_changes(messages)
    resolved = _resolve_tools(listed or [], changes) if changes else listed
    return out, None if resolved is None else [_tool(t) for t in resolved if isinstance(t, Mapping)]


__all__ = ["BILLING_HEADER", "chat_view"]
