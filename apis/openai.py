"""OpenAI chat completions and completions (``kvgate.apis`` entries ``chat``, ``completions``).

Validation is deliberately shallow: the fields the gateway relies on are checked with clear
400s (``param`` names the field); everything else is the engine's to judge. Streams always ask
the engine for the final usage chunk (``stream_options.include_usage``); when the client did
not ask for it, the tap reads it and drops it from the client's stream.

Usage conventions (vLLM, SGLang, OpenAI): ``usage.prompt_tokens`` includes cached tokens,
``usage.prompt_tokens_details.cached_tokens`` is the cached part (absent: unknown, None),
``.created_cache_tokens`` (vLLM) the cache writes, ``completion_tokens`` is absent for pooling
answers (0); read by pricing/usage_conventions.py's ``openai-chat`` normaliser, the one
implementation every adapter uses.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import orjson

from kvgate.apis._common import to_usage
from kvgate.middleware.framework.api import ParsedRequest, SseEvent
from kvgate.middleware.framework.connector import rewrite_usage
from kvgate.middleware.framework.errors import BadRequest, HTTPError
from kvgate.middleware.framework.types import ChatPrompt, Prompt, TextPrompt, TokenPrompt, Usage
from kvgate.middleware.serving.sse import error_event
from kvgate.pricing.usage_conventions import Convention, normalise

#: Rough bytes per prompt token for text, used only to size in-flight token estimates before a
#: tokenizer (a plugin) refines them; ~4 bytes/token holds for English BPE vocabularies.
BYTES_PER_TOKEN = 4
#: What a usage-carrying event's bytes contain (only those are parsed on the stream path).
USAGE_MARKERS = (b'"usage":{', b'"usage": {')


def openai_usage(payload: Mapping[str, Any]) -> Usage | None:
    """Usage of an OpenAI-shaped answer or chunk (``openai-chat`` convention of
    pricing/usage_conventions.py: cache reads and vLLM's ``created_cache_tokens`` cache
    writes); None when it carries none."""
    return to_usage(normalise(Convention.OPENAI_CHAT, payload.get("usage")))


def is_token_ids(value: object) -> bool:
    """A non-empty list of non-negative ints (not bools). The type test runs in C
    (``set(map(type, ...))``): a 15k-token prompt is checked in ~0.2 ms instead of ~2 ms of
    Python-level ``isinstance`` calls."""
    return (isinstance(value, list) and bool(value) and set(map(type, value)) == {int}
            and min(value) >= 0)


def text_estimate(size: int) -> int:
    return size // BYTES_PER_TOKEN + 1


def check_model(data: Mapping[str, Any]) -> str:
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("model is required and must be a non-empty string", param="model")
    return model


def check_common(data: Mapping[str, Any]) -> tuple[str, bool, bool]:
    """``model``, ``stream``, whether the client's stream asked for usage; checks limits."""
    model = check_model(data)
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


def _check_messages(messages: object) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty array", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(
                f"messages[{i}] must be an object with a string role", param="messages"
            )
    return messages


def text_prompt(prompt: object, param: str, add_special: bool) -> tuple[Prompt, int]:
    """A completions-style prompt (string, strings, token ids, token-id lists): the prompt
    routing matches (the first of several) and the estimated token count of all."""
    if isinstance(prompt, str):
        return TextPrompt(prompt, add_special), text_estimate(len(prompt))
    if is_token_ids(prompt):
        assert isinstance(prompt, list)
        return TokenPrompt(prompt), len(prompt)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            size = sum(len(p) for p in prompt)
            return TextPrompt(prompt[0], add_special), text_estimate(size)
        if all(is_token_ids(p) for p in prompt):
            return TokenPrompt(prompt[0]), sum(len(p) for p in prompt)
    raise BadRequest(
        f"{param} must be a string, a list of strings, a list of token ids, or a list of "
        "token-id lists",
        param=param,
    )


def chat_prompt(data: Mapping[str, Any], messages: list[dict[str, Any]]) -> ChatPrompt:
    """The chat template's inputs, as vLLM's chat endpoint takes them."""
    kwargs: dict[str, Any] = {}
    if data.get("documents") is not None:
        kwargs["documents"] = data["documents"]
    extra = data.get("chat_template_kwargs")
    if isinstance(extra, dict):
        kwargs.update({k: v for k, v in extra.items() if isinstance(k, str)})
    tools = data.get("tools")
    return ChatPrompt(
        messages=messages, tools=tools if isinstance(tools, list) else None,
        add_generation_prompt=bool(data.get("add_generation_prompt", True)),
        continue_final_message=bool(data.get("continue_final_message", False)),
        add_special_tokens=bool(data.get("add_special_tokens", False)),
        template_kwargs=kwargs,
    )


class OpenAIErrors:
    """Error rendering in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``;
    a broken stream ends with ``data: {"error": ...}`` (the ``openai`` client raises it)."""

    def error_body(self, err: HTTPError) -> bytes:
        return orjson.dumps(err.body())

    def stream_error(self, message: str) -> bytes:
        return error_event(message)

    def upstream_path(self, path: str) -> str:
        return path

    def set_cached_tokens(self, payload: dict[str, Any], cached: int | None) -> bool:
        return rewrite_usage(payload, cached)


class UsageOnlyTap:
    """A whole JSON answer's OpenAI usage (``prompt_tokens`` only for pooling answers)."""

    __slots__ = ("final", "state_ids", "usage")
    markers: ClassVar[tuple[bytes, ...]] = (b'"usage"',)

    def __init__(self) -> None:
        self.usage: Usage | None = None
        self.final = False
        self.state_ids: list[str] = []

    def on_json(self, payload: dict[str, Any]) -> None:
        self.usage = openai_usage(payload)
        self.final = True

    def on_event(self, event: SseEvent) -> bool:
        return True


class OpenAITap(UsageOnlyTap):
    """Usage of an OpenAI answer or stream; drops the usage the client did not ask for."""

    __slots__ = ("_wants",)
    markers: ClassVar[tuple[bytes, ...]] = USAGE_MARKERS
    #: The stream ends with ``data: [DONE]`` (a stream without it broke).
    sse_done: ClassVar[bool] = True

    def __init__(self, client_wants_usage: bool) -> None:
        super().__init__()
        self._wants = client_wants_usage

    def on_event(self, event: SseEvent) -> bool:
        data = event.data
        usage = openai_usage(data)
        if usage is None:
            return True
        self.usage, self.final = usage, True
        if self._wants:
            return True
        if data.get("choices") == []:
            return False  # the usage-only chunk the gateway asked for on the client's behalf
        data.pop("usage", None)
        return True


class _OpenAIGenerate(OpenAIErrors):
    disaggregable: ClassVar[bool] = True

    def prepare_body(self, body: dict[str, Any], stream: bool) -> dict[str, Any] | None:
        """Streams always ask for the final usage chunk (dropped later if the client didn't)."""
        if not stream:
            return None
        opts = body.get("stream_options")
        if isinstance(opts, dict) and opts.get("include_usage"):
            return None
        return {**body, "stream_options": {**(opts or {}), "include_usage": True}}

    def new_tap(self, client_wants_usage: bool) -> OpenAITap:
        return OpenAITap(client_wants_usage)


class ChatCompletions(_OpenAIGenerate):
    """``POST /v1/chat/completions``."""

    name: ClassVar[str] = "chat"
    routes: ClassVar[tuple[tuple[str, str], ...]] = (("POST", "/v1/chat/completions"),)

    def parse(self, data: dict[str, Any], headers: Mapping[str, str]) -> ParsedRequest:
        model, stream, wants_usage = check_common(data)
        messages = _check_messages(data.get("messages"))
        estimate = text_estimate(_size_hint(messages))
        return ParsedRequest(model, stream, chat_prompt(data, messages), estimate,
                             client_wants_usage=wants_usage)


class Completions(_OpenAIGenerate):
    """``POST /v1/completions``."""

    name: ClassVar[str] = "completions"
    routes: ClassVar[tuple[tuple[str, str], ...]] = (("POST", "/v1/completions"),)

    def parse(self, data: dict[str, Any], headers: Mapping[str, str]) -> ParsedRequest:
        model, stream, wants_usage = check_common(data)
        if "prompt" not in data:
            raise BadRequest("prompt is required", param="prompt")
        add_special = bool(data.get("add_special_tokens", True))
        prompt, estimate = text_prompt(data["prompt"], "prompt", add_special)
        return ParsedRequest(model, stream, prompt, estimate, client_wants_usage=wants_usage)


def _size_hint(messages: list[dict[str, Any]]) -> int:
    """Characters of the messages' string contents (cheaper than serialising them)."""
    size = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            size += len(content)
        elif content is not None:
            size += len(orjson.dumps(content))
        size += 16
    return size
