"""OpenAI Responses API: ``POST /v1/responses`` (JSON and SSE), ``GET /v1/responses/{id}`` and
``POST /v1/responses/{id}/cancel``.

What vLLM 0.32 does (vllm/entrypoints/openai/responses/, docs/apis.md has the full list):

* usage follows OpenAI: ``input_tokens`` is the whole prompt and includes
  ``input_tokens_details.cached_tokens`` and ``.cache_write_tokens`` (serving.py:866-897); in a
  stream it arrives once, in ``response.completed`` (serving.py:1402-1424), which vLLM sends
  for incomplete answers too (``status: "incomplete"``); OpenAI also ends streams with
  ``response.failed`` / ``response.incomplete``, read the same way;
* the response id is the request's ``request_id`` (``resp_<uuid>`` unless the client set it,
  protocol.py:298, 911); ``store`` is honoured only when the engine runs with
  ``VLLM_ENABLE_RESPONSES_API_STORE=1``, else silently off (serving.py:160-171, 352-359);
  stored responses and their conversations live in that engine process's memory
  (serving.py:180-189), so ``previous_response_id``, ``GET /v1/responses/{id}`` and ``/cancel``
  only work on the engine that answered: ``requires_state``;
* with ``previous_response_id`` the engine prepends the stored conversation to the new input
  (utils.py:248-290): the gateway cannot render that prompt, so such a request carries no
  prompt for prefix routing (the state's engine is the only one that can serve it anyway, and
  it holds the conversation's prefix) and its token estimate covers the new input only.

Pure: no I/O, no state outside a tap.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from kvgate.apis._common import (
    estimate_tokens,
    openai_error_body,
    optional_bool,
    optional_list,
    optional_str,
    require_model,
    sse,
    template_kwargs,
    to_usage,
)
from kvgate.apis._responses_prompt import input_messages, tool_dicts
from kvgate.middleware.framework.api import ChatPrompt, ParsedRequest, SseEvent
from kvgate.middleware.framework.errors import BadRequest, HTTPError
from kvgate.middleware.framework.types import Usage
from kvgate.pricing.usage_conventions import count, from_openai_responses

#: Stream events whose ``response`` carries the final usage.
FINAL_EVENTS = frozenset({"response.completed", "response.failed", "response.incomplete"})
#: Stream events whose ``response`` names the response id (``response.in_progress`` repeats
#: ``response.created``'s object, instructions and tools included: not parsed twice).
ID_EVENTS = FINAL_EVENTS | {"response.created", "response.queued"}
#: Bytes of the events the tap reads (the core parses only events containing one).
MARKERS = tuple(f'"{kind}"'.encode() for kind in sorted(ID_EVENTS))


def _check_input(data: Mapping[str, Any]) -> str | list[Any]:
    items = data.get("input")
    if isinstance(items, str):
        return items
    if not isinstance(items, list):
        raise BadRequest("input: a string or an array of input items is required", param="input")
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise BadRequest(f"input[{i}]: must be an object", param=f"input[{i}]")
        if "role" not in item and not isinstance(item.get("type"), str):
            raise BadRequest(f"input[{i}]: an item needs a type or a role", param=f"input[{i}]")
    return items


def _check_tools(data: Mapping[str, Any]) -> list[Any]:
    tools = optional_list(data, "tools") or []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
            raise BadRequest(f"tools[{i}].type: a string is required", param=f"tools[{i}].type")
    return tools


def continues_final_message(items: object) -> bool:
    """A last input item that is an assistant message (or reasoning) still ``in_progress`` /
    ``incomplete`` is continued, not answered (utils.py:201-245, protocol.py:427-437)."""
    last = items[-1] if isinstance(items, list) and items else None
    if not isinstance(last, Mapping) or last.get("type", "message") not in ("message",
                                                                            "reasoning"):
        return False
    return last.get("status") in ("in_progress", "incomplete")


def chat_prompt(data: Mapping[str, Any]) -> ChatPrompt:
    """What the engine renders for a validated body without ``previous_response_id``."""
    items = data.get("input")
    messages = input_messages(data.get("instructions"), items if items is not None else [])
    reasoning = data.get("reasoning")
    effort = reasoning.get("effort") if isinstance(reasoning, Mapping) else None
    cont = continues_final_message(items)
    # add_special_tokens: vLLM 0.32's Responses leaves TokenizeParams' default (True,
    # renderers/params.py) where chat passes the request's False: the engine tokenizes the
    # rendered template with the BOS added again, and routing must hash the same ids.
    return ChatPrompt(messages=messages, tools=tool_dicts(data.get("tools") or []),
                      add_generation_prompt=not cont, continue_final_message=cont,
                      add_special_tokens=True,
                      template_kwargs=template_kwargs(data.get("chat_template_kwargs"), effort))


class ResponsesTap:
    """Usage of one Responses answer, and the id of the response the engine may have stored.

    ``store`` False: the client asked the engine not to store it (no state id recorded)."""

    markers: ClassVar[tuple[bytes, ...]] = MARKERS
    sse_done: ClassVar[bool] = False

    def __init__(self, store: bool = True) -> None:
        self.usage: Usage | None = None
        self.final = False
        self.state_ids: list[str] = []
        self._store = store

    def _record(self, response: Mapping[str, Any]) -> None:
        rid = response.get("id")
        if self._store and isinstance(rid, str) and rid and rid not in self.state_ids:
            self.state_ids.append(rid)

    def on_json(self, payload: dict[str, Any]) -> None:
        self._record(payload)
        self.usage = to_usage(from_openai_responses(payload.get("usage") or {}))
        self.final = True

    def on_event(self, event: SseEvent) -> bool:
        kind = event.data.get("type", event.name)
        response = event.data.get("response")
        if kind in ID_EVENTS and isinstance(response, Mapping):
            self._record(response)
            if kind in FINAL_EVENTS:
                self.usage = to_usage(from_openai_responses(response.get("usage") or {}))
                self.final = True
        return True


def set_cached(payload: dict[str, Any], cached: int | None) -> bool:
    """Make the usage of an answer (or of a final event's ``response``) report ``cached``
    cached input tokens (None: unknown, ``cached_tokens: null`` as chat does);
    ``input_tokens`` is the whole prompt and stays. Drops vLLM's ``kv_transfer_params``."""
    response = payload.get("response")
    target = response if isinstance(response, dict) else payload
    changed = target.pop("kv_transfer_params", None) is not None
    usage = target.get("usage")
    counts = from_openai_responses(usage) if isinstance(usage, dict) else None
    if not isinstance(usage, dict) or counts is None:
        return changed
    if cached is not None:
        cached = min(max(cached, 0), counts.prompt - counts.cache_write)
    details = usage.get("input_tokens_details")
    if not isinstance(details, dict):
        details = usage["input_tokens_details"] = {}
    if "cached_tokens" in details and details["cached_tokens"] == cached:
        return changed
    details["cached_tokens"] = cached
    if isinstance(details.get("cached_tokens_per_turn"), list) and len(
            details["cached_tokens_per_turn"]) == 1:
        details["cached_tokens_per_turn"] = [] if cached is None else [cached]
    return True


class _ResponsesShape:
    """Paths and errors shared by the Responses routes (OpenAI error shape)."""

    disaggregable: ClassVar[bool] = False

    def upstream_path(self, path: str) -> str:
        return path

    def prepare_body(self, body: dict[str, Any], stream: bool) -> dict[str, Any] | None:
        return None

    def error_body(self, err: HTTPError) -> bytes:
        return openai_error_body(err)

    def stream_error(self, message: str) -> bytes:
        """A Responses ``error`` event (the SDK's ``ResponseErrorEvent``); the adapter does not
        see the stream, so ``sequence_number`` is 0 (contract gap, docs/apis.md)."""
        return sse("error", {"type": "error", "code": "upstream_error", "message": message,
                             "param": None, "sequence_number": 0})

    def set_cached_tokens(self, payload: dict[str, Any], cached: int | None) -> bool:
        return set_cached(payload, cached)


class ResponsesAdapter(_ResponsesShape):
    """``POST /v1/responses``, and the by-id routes ``GET /v1/responses/{id}`` (also
    ``?stream=true``, replaying a background response's events) and
    ``POST /v1/responses/{id}/cancel``, which the core forwards to the engine that stored the
    response without parsing (middleware/framework/api.py, "By-id routes"); their errors are
    rendered by :meth:`error_body`. Not disaggregated: the prefill engine would lack the stored
    conversation a ``previous_response_id`` names, and the output cap is
    ``max_output_tokens``, not the ``max_tokens`` a prefill hop sets."""

    name: ClassVar[str] = "responses"
    routes: ClassVar[tuple[tuple[str, str], ...]] = (
        ("POST", "/v1/responses"), ("GET", "/v1/responses/{id}"),
        ("POST", "/v1/responses/{id}/cancel"))

    class Params(BaseModel):
        """Options from the config's ``apis.responses`` section (docs/config.md)."""

        model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
        #: Accept ``background: true`` (its usage is never seen: not billed, not load).
        allow_background: bool = False

    def __init__(self, allow_background: bool = False) -> None:
        #: ``background: true`` responses are generated after the answer (``status:
        #: "queued"``), outside any tap: their usage is never seen, so they could not be billed
        #: or counted as load. Refused (400) unless allowed (deployments without billing).
        self.allow_background = allow_background

    def parse(self, data: dict[str, Any], headers: Mapping[str, str]) -> ParsedRequest:
        model = require_model(data)
        items = _check_input(data)
        instructions = optional_str(data, "instructions")
        tools = _check_tools(data)
        stream = optional_bool(data, "stream")
        previous = optional_str(data, "previous_response_id") or None
        if optional_bool(data, "background") and not self.allow_background:
            raise BadRequest("background: background responses are not served through this "
                             "gateway (their usage could not be billed)", param="background")
        if count(data.get("max_output_tokens")) is None and data.get(
                "max_output_tokens") is not None:
            raise BadRequest("max_output_tokens: must be a non-negative integer",
                             param="max_output_tokens")
        return ParsedRequest(
            model=model, stream=stream,
            prompt=None if previous else chat_prompt(data),
            prompt_token_estimate=estimate_tokens(instructions, items, tools or None),
            client_wants_usage=True, requires_state=previous)

    def new_tap(self, client_wants_usage: bool) -> ResponsesTap:
        return ResponsesTap()


__all__ = ["FINAL_EVENTS", "MARKERS", "ResponsesAdapter", "ResponsesTap", "chat_prompt",
           "continues_final_message", "set_cached"]
