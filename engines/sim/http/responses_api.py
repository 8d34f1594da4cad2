"""OpenAI Responses (``POST /v1/responses``, ``GET /v1/responses/{id}``, ``POST
/v1/responses/{id}/cancel``) as vLLM 0.32 serves it for a non-Harmony model.

The conversation (vLLM's ``construct_input_messages``, mirrored by :func:`input_messages`):
``instructions`` as a system message, then — with ``previous_response_id`` — the stored
conversation of that response without its system messages and its output text as an assistant
message, then the new ``input`` (a string: one user message; items: messages,
``function_call`` → assistant ``tool_calls``, ``function_call_output`` → ``tool``). So a
continued conversation's prompt starts with the previous prompt and answer: the prefix cache
hits it, provided the instructions are sent again (vLLM does not carry them over). The prompt
starts with a second ``<|begin_of_text|>`` (:data:`BOS_ID`), as vLLM's does.

Usage: ``input_tokens`` (the whole prompt), ``input_tokens_details.cached_tokens`` (the hit),
``cache_write_tokens`` (full blocks written), ``output_tokens``, ``total_tokens``, and vLLM's
empty per-turn lists. A response that hit ``max_output_tokens`` has ``status: "incomplete"``
(its stream still ends with ``response.completed``). The store is per engine and bounded
(:class:`ResponseStore`); vLLM's errors for unknown ids are 404 ``invalid_request_error``
with ``param: "response_id"``.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvgate.engines.sim.core.config import SimConfig
from kvgate.engines.sim.core.tokenizer import SPECIAL_TOKENS, TemplateError, chat_token_ids
from kvgate.engines.sim.http.agent_common import (
    Field,
    cache_write_tokens,
    check_fields,
    named_sse,
    output_limit,
    resolve_model,
)
from kvgate.engines.sim.http.protocol import ApiError, ParsedRequest, Usage, check_cache_salt

_FIELDS = (
    Field("model", "str"), Field("input", "str|list", True), Field("instructions", "str"),
    Field("max_output_tokens", "int"), Field("stream", "bool"), Field("store", "bool"),
    Field("previous_response_id", "str"), Field("background", "bool"), Field("tools", "list"),
    Field("tool_choice", "str|dict"), Field("temperature", "number"), Field("top_p", "number"),
    Field("metadata", "dict"), Field("user", "str"), Field("cache_salt", "str"),
    Field("kv_transfer_params", "dict"), Field("request_id", "str"),
)
#: vLLM 0.32 tokenizes a rendered Responses conversation with special tokens on, so a template
#: that writes ``<|begin_of_text|>`` itself gets it twice (observed: ``[0, 0, 2, ...]`` from
#: ``/v1/responses/render``, 17 input tokens where Messages reports 16).
BOS_ID = SPECIAL_TOKENS["<|begin_of_text|>"]
_TEXT_PARTS = frozenset({"text", "input_text", "output_text"})
_NO_BACKGROUND = ("This vLLM engine does not support `store=True` and therefore does not "
                  "support the background mode. To enable these features, set the environment "
                  "variable `VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server.")


def not_found(response_id: str) -> ApiError:
    return ResponsesError(404, f"Response with id '{response_id}' not found.", "response_id")


class ResponsesError(ApiError):
    """An error vLLM's Responses handler raises itself: ``type: invalid_request_error``."""

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": "invalid_request_error",
                          "param": self.param, "code": self.status}}


@dataclass(slots=True)
class StoredResponse:
    """A response kept for retrieval and continuation."""

    body: dict[str, Any]
    #: The conversation its prompt was rendered from (system messages included).
    messages: list[dict[str, Any]]
    #: Aborts the engine request while a background response runs.
    abort: Callable[[], None] | None = None


@dataclass(slots=True)
class ResponseStore:
    """Responses by id, oldest forgotten past ``limit`` (one per app: no global state)."""

    limit: int
    items: OrderedDict[str, StoredResponse] = field(default_factory=OrderedDict)

    def get(self, response_id: str) -> StoredResponse:
        item = self.items.get(response_id)
        if item is None:
            raise not_found(response_id)
        return item

    def put(self, response_id: str, item: StoredResponse) -> None:
        self.items[response_id] = item
        self.items.move_to_end(response_id)
        while len(self.items) > self.limit:
            self.items.popitem(last=False)


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content must be a string or a list of parts", "input")
    texts: list[str] = []
    for part in content:
        if not isinstance(part, Mapping) or part.get("type") not in _TEXT_PARTS:
            raise ApiError(400, f"{where}: only text parts are supported by the simulator",
                           "input")
        texts.append(str(part.get("text", "")))
    return "".join(texts)


def _item_message(item: Any, i: int, prev: dict[str, Any] | None) -> dict[str, Any] | None:
    """One input item as a chat message; None when merged into ``prev`` (an assistant)."""
    kind = item.get("type") if isinstance(item, Mapping) else None
    if kind == "function_call":
        call = {"id": item.get("call_id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
        if prev is not None:
            prev.setdefault("tool_calls", []).append(call)
            return None
        return {"role": "assistant", "tool_calls": [call]}
    if kind == "function_call_output":
        return {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
    if kind == "reasoning":
        return {"role": "assistant", "content": None}
    if isinstance(item, Mapping) and item.get("role") in ("user", "system", "developer",
                                                          "assistant"):
        text = _text(item.get("content"), f"input[{i}]")
        if item["role"] == "assistant" and prev is not None and prev.get("content") is None:
            prev["content"] = text
            return None
        return {"role": str(item["role"]), "content": text}
    raise ApiError(400, f"Unsupported input item type: {kind}", "input")


def _input_messages(items: Sequence[Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        prev = out[-1] if out and out[-1].get("role") == "assistant" else None
        msg = _item_message(item, i, prev)
        if msg is not None:
            out.append(msg)
    return out


def input_messages(body: Mapping[str, Any], prev: StoredResponse | None) -> list[dict[str, Any]]:
    """The conversation vLLM renders for a Responses body (see the module docstring)."""
    out: list[dict[str, Any]] = []
    if body.get("instructions"):
        out.append({"role": "system", "content": body["instructions"]})
    if prev is not None:
        out.extend(m for m in prev.messages if m.get("role") != "system")
        out.extend({"role": "assistant", "content": part.get("text", "")}
                   for item in prev.body.get("output", []) if item.get("type") == "message"
                   for part in item.get("content", []))
    raw = body["input"]
    out.extend([{"role": "user", "content": raw}] if isinstance(raw, str) else
               _input_messages(raw))
    return out


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    """A validated Responses request: the engine request and what the answer echoes."""

    req: ParsedRequest
    body: Mapping[str, Any]
    messages: list[dict[str, Any]]
    store: bool
    background: bool


def _store_flags(body: Mapping[str, Any], config: SimConfig) -> tuple[bool, bool]:
    store, background = body.get("store") is not False, bool(body.get("background"))
    if store and background and not config.responses_store:
        raise ResponsesError(400, _NO_BACKGROUND, "background")
    if background and body.get("stream"):
        raise ApiError(400, "background streaming is not supported by the simulator",
                       "background")
    return store and config.responses_store, background


def parse_responses(body: Any, config: SimConfig, store: ResponseStore) -> ResponsesRequest:
    """Validate a ``POST /v1/responses`` body (resolving ``previous_response_id``)."""
    body = check_fields(body, _FIELDS)
    check_cache_salt(body.get("cache_salt"))
    model = resolve_model(body.get("model"), config.served_model_names)
    keep, background = _store_flags(body, config)
    prev_id = body.get("previous_response_id")
    prev = None if prev_id is None else store.get(prev_id)
    messages = input_messages(body, prev)
    try:
        ids = [BOS_ID, *chat_token_ids(messages)]
    except TemplateError as exc:
        raise ApiError(400, str(exc), "input") from None
    limit = output_limit("max_output_tokens", body.get("max_output_tokens"), len(ids),
                         config.effective_max_model_len)
    req = ParsedRequest(api="chat", model=model, prompt_ids=ids, max_tokens=limit,
                        stream=bool(body.get("stream")), include_usage=True,
                        cache_salt=body.get("cache_salt"),
                        kv_transfer_params=body.get("kv_transfer_params"))
    return ResponsesRequest(req, body, messages, keep, background)


def echo_tool(tool: Any) -> Any:
    """A function tool as vLLM echoes it (its optional fields spelled out as null)."""
    if not isinstance(tool, Mapping) or tool.get("type") != "function":
        return tool
    return {"name": tool.get("name"), "parameters": tool.get("parameters"),
            "strict": tool.get("strict"), "type": "function", "allowed_callers": None,
            "async": None, "defer_loading": None, "description": tool.get("description"),
            "output_schema": None}


def new_response_id(body: Mapping[str, Any] | None = None) -> str:
    """The caller's ``request_id`` (a vLLM extra parameter: the response's id), else a new
    one."""
    given = None if body is None else body.get("request_id")
    return given if isinstance(given, str) and given else "resp_" + secrets.token_hex(8)


@dataclass(slots=True)
class ResponsesShaper:
    """One response's objects in vLLM's shape; counts stream sequence numbers."""

    rr: ResponsesRequest
    response_id: str
    created: int
    block_size: int
    message_id: str = field(default_factory=lambda: "msg_" + secrets.token_hex(8))
    seq: int = 0

    def usage(self, u: Usage) -> dict[str, Any]:
        written = cache_write_tokens(u.prompt_tokens, u.cached_tokens, self.block_size)
        return {"input_tokens": u.prompt_tokens, "input_tokens_details": {
                    "cached_tokens": u.cached_tokens, "cache_write_tokens": written,
                    "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
                "output_tokens": u.completion_tokens, "output_tokens_details": {
                    "reasoning_tokens": 0, "tool_output_tokens": 0,
                    "output_tokens_per_turn": [], "tool_output_tokens_per_turn": []},
                "total_tokens": u.prompt_tokens + u.completion_tokens}

    def response(self, status: str, output: list[dict[str, Any]],
                 usage: dict[str, Any] | None, incomplete: bool = False) -> dict[str, Any]:
        """The response object (vLLM's key order)."""
        b = self.rr.body
        tools = [echo_tool(t) for t in b.get("tools") or []]
        return {
            "id": self.response_id, "created_at": self.created,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": b.get("instructions"), "metadata": b.get("metadata"),
            "model": self.rr.req.model, "object": "response", "output": output,
            "parallel_tool_calls": b.get("parallel_tool_calls", True),
            "temperature": float(b.get("temperature", 1.0)),
            "tool_choice": b.get("tool_choice") or ("auto" if tools else "none"),
            "tools": tools, "top_p": float(b.get("top_p", 1.0)),
            "background": self.rr.background, "max_output_tokens": b.get("max_output_tokens"),
            "max_tool_calls": None, "previous_response_id": b.get("previous_response_id"),
            "prompt": None, "reasoning": None, "service_tier": "auto", "status": status,
            "text": None, "top_logprobs": None, "truncation": "disabled", "usage": usage,
            "user": b.get("user"), "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "kv_transfer_params": None, "ec_transfer_params": None, "input_messages": None,
            "output_messages": None,
        }

    def message(self, text: str, done: bool) -> dict[str, Any]:
        content = [self.part(text, None)] if done else []
        return {"id": self.message_id, "content": content, "role": "assistant",
                "status": "completed" if done else "in_progress", "type": "message",
                "phase": None}

    @staticmethod
    def part(text: str, logprobs: list[Any] | None) -> dict[str, Any]:
        return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}

    def full(self, text: str, u: Usage | None, finish_reason: str | None) -> dict[str, Any]:
        """The finished response (``u`` None: cancelled before it finished)."""
        if u is None or finish_reason == "abort":
            return self.response("cancelled", [], None)
        length = finish_reason == "length"
        return self.response("incomplete" if length else "completed",
                             [self.message(text, True)], self.usage(u), incomplete=length)

    def event(self, kind: str, payload: dict[str, Any]) -> bytes:
        """One named SSE event carrying the next sequence number."""
        data = {**payload, "sequence_number": self.seq, "type": kind}
        self.seq += 1
        return named_sse(kind, data)

    def opening(self) -> list[bytes]:
        """``response.created``, ``response.in_progress``, the message item and its part."""
        running = self.response("in_progress", [], None)
        base = {"item_id": self.message_id, "output_index": 0}
        return [self.event("response.created", {"response": running}),
                self.event("response.in_progress", {"response": running}),
                self.event("response.output_item.added",
                           {"item": self.message("", False), "output_index": 0}),
                self.event("response.content_part.added", {
                    "content_index": 0, **base, "part": self.part("", [])})]

    def delta(self, text: str) -> bytes:
        return self.event("response.output_text.delta", {
            "content_index": 0, "delta": text, "item_id": self.message_id, "logprobs": [],
            "output_index": 0})

    def closing(self, final: dict[str, Any]) -> list[bytes]:
        """The text, part and item ``done`` events, then ``response.completed``."""
        text = "".join(p["text"] for item in final["output"] for p in item["content"])
        base = {"item_id": self.message_id, "output_index": 0}
        return [self.event("response.output_text.done", {
                    "content_index": 0, **base, "logprobs": [], "text": text}),
                self.event("response.content_part.done", {
                    "content_index": 0, **base, "part": self.part(text, None)}),
                self.event("response.output_item.done",
                           {"item": self.message(text, True), "output_index": 0}),
                self.event("response.completed", {"response": final})]
