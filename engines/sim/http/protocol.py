"""vLLM's OpenAI-compatible request and response shapes, as the simulator speaks them.

:func:`parse_request` validates a ``/v1/chat/completions`` or ``/v1/completions`` body into a
:class:`ParsedRequest` (raising :class:`ApiError` with vLLM-like messages); :class:`Shaper`
builds the JSON objects of answers and SSE chunks. Unknown body fields are ignored, as vLLM
does; sampling fields (``temperature``, ``top_p``, ``stop``...) are type-checked and otherwise
without effect: the text is a deterministic function of the seed and the prompt.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvgate.engines.sim.core.config import SimConfig
from kvgate.engines.sim.core.scheduler import TokenOut
from kvgate.engines.sim.core.tokenizer import VOCAB_TOTAL, TemplateError, chat_token_ids, tokenize

Api = Literal["chat", "completions"]

_ERROR_TYPES = {
    400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
    404: "NotFoundError", 409: "ConflictError", 413: "RequestTooLargeError",
    422: "UnprocessableEntityError", 429: "RateLimitError", 503: "ServiceUnavailableError",
}


class ApiError(Exception):
    """An error answer: ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        kind = _ERROR_TYPES.get(self.status, "InternalServerError")
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.status}}


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A validated inference request. ``max_tokens`` already has its default applied."""

    api: Api
    model: str
    prompt_ids: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    ignore_eos: bool = False
    min_tokens: int = 0
    seed: int | None = None
    cache_salt: str | None = None
    kv_transfer_params: Mapping[str, Any] | None = None
    #: SGLang's prefill/decode rendezvous fields, when sent.
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _opt_int(body: Mapping[str, Any], name: str, lo: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value) or (lo is not None and value < lo):
        bound = "" if lo is None else f" >= {lo}"
        raise ApiError(400, f"{name} must be an integer{bound}", name)
    return int(value)


def _opt_bool(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"{name} must be a boolean", name)
    return value


def _check_number(body: Mapping[str, Any], name: str, lo: float, hi: float = math.inf) -> None:
    value = body.get(name)
    if value is None:
        return
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not lo <= value <= hi:
        bounds = f">= {lo}" if hi == math.inf else f"in [{lo}, {hi}]"
        raise ApiError(400, f"{name} must be a number {bounds}", name)


def _token_list(value: Sequence[Any], param: str) -> list[int]:
    if not all(_is_int(t) and 0 <= t < VOCAB_TOTAL for t in value):
        raise ApiError(400, f"{param}: token ids must be integers in [0, {VOCAB_TOTAL})", param)
    return list(value)


def completion_prompt_ids(prompt: Any) -> list[int]:
    """``prompt`` of ``/v1/completions``: a string, token ids, or a batch of one of either."""
    if isinstance(prompt, str):
        return tokenize(prompt)
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str | list):
            if len(prompt) != 1:
                raise ApiError(
                    400, "batched prompts are not supported by the simulator: send one prompt "
                    "per request", "prompt")
            return completion_prompt_ids(first)
        return _token_list(prompt, "prompt")
    raise ApiError(400, "prompt must be a non-empty string, a list of token ids, or a list "
                   "holding one of these", "prompt")


def _prompt_ids(api: Api, body: Mapping[str, Any]) -> list[int]:
    if api == "completions":
        ids = completion_prompt_ids(body.get("prompt"))
    else:
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise ApiError(400, "messages must be a list of messages", "messages")
        add_generation_prompt = body.get("add_generation_prompt", True)
        if not isinstance(add_generation_prompt, bool):
            raise ApiError(400, "add_generation_prompt must be a boolean", "add_generation_prompt")
        try:
            ids = chat_token_ids(messages, add_generation_prompt)
        except TemplateError as exc:
            raise ApiError(400, str(exc), "messages") from None
    if not ids:
        raise ApiError(400, "the prompt is empty", "prompt" if api == "completions" else "messages")
    return ids


def _max_tokens(api: Api, body: Mapping[str, Any], prompt_len: int, max_len: int) -> int:
    """The completion limit; vLLM's default is whatever the context has left."""
    requested = _opt_int(body, "max_completion_tokens", 1) if api == "chat" else None
    if requested is None:
        requested = _opt_int(body, "max_tokens", 1)
    if prompt_len >= max_len or (requested is not None and prompt_len + requested > max_len):
        asked = prompt_len + (requested or 0)
        raise ApiError(
            400, f"This model's maximum context length is {max_len} tokens. However, you "
            f"requested {asked} tokens ({prompt_len} in the messages, {requested or 0} in the "
            "completion). Please reduce the length of the messages or completion.",
            "max_tokens" if requested is not None and prompt_len < max_len else
            ("messages" if api == "chat" else "prompt"))
    return requested if requested is not None else max_len - prompt_len


def _stream_usage(body: Mapping[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, Mapping):
        raise ApiError(400, "stream_options must be an object", "stream_options")
    if not stream:
        raise ApiError(400, "Stream options can only be defined when `stream=True`.",
                       "stream_options")
    return _opt_bool(options, "include_usage")


#: vLLM 0.32's rule for ``cache_salt`` (entrypoints/generate/base/protocol.py:38-58).
CACHE_SALT_MAX_CHARS = 128
CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")


def check_cache_salt(salt: object) -> None:
    """vLLM's ``validate_cache_salt``: absent, or a non-empty string of at most 128 characters
    without ``@``, ``/``, ``\\`` or NUL (400 naming ``cache_salt`` otherwise). vLLM runs it on
    chat, completions, responses and pooling bodies, and on Messages through the chat request
    it converts them to (entrypoints/anthropic/serving.py:611-621)."""
    if salt is None:
        return
    if not isinstance(salt, str) or not salt:
        raise ApiError(400, "Parameter 'cache_salt' must be a non-empty string if provided.",
                       "cache_salt")
    if len(salt) > CACHE_SALT_MAX_CHARS or not CACHE_SALT_FORBIDDEN.isdisjoint(salt):
        raise ApiError(400, "Parameter 'cache_salt' must be at most 128 characters and must "
                       "not contain '@', '/', '\\\\', or NUL.", "cache_salt")


def _check_sampling(body: Mapping[str, Any]) -> None:
    n = _opt_int(body, "n", 1)
    if n is not None and n != 1:
        raise ApiError(400, "n > 1 is not supported by the simulator", "n")
    _check_number(body, "temperature", 0.0)  # vLLM only requires >= 0
    _check_number(body, "top_p", 0.0, 1.0)
    check_cache_salt(body.get("cache_salt"))
    params = body.get("kv_transfer_params")
    if params is not None and not isinstance(params, Mapping):
        raise ApiError(400, "kv_transfer_params must be an object", "kv_transfer_params")


def parse_request(api: Api, body: Any, config: SimConfig) -> ParsedRequest:
    """Validate a request body; raises :class:`ApiError` (400, or 404 for an unknown model)."""
    if not isinstance(body, Mapping):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model", config.model_name)
    if model not in config.served_model_names:
        raise ApiError(404, f"The model `{model}` does not exist.", "model")
    _check_sampling(body)
    stream = _opt_bool(body, "stream")
    include_usage = _stream_usage(body, stream)
    ids = _prompt_ids(api, body)
    max_tokens = _max_tokens(api, body, len(ids), config.effective_max_model_len)
    min_tokens = _opt_int(body, "min_tokens", 0) or 0
    if min_tokens > max_tokens:
        raise ApiError(400, "min_tokens must be <= max_tokens", "min_tokens")
    return ParsedRequest(
        api=api, model=str(model), prompt_ids=ids, max_tokens=max_tokens, stream=stream,
        include_usage=include_usage, ignore_eos=_opt_bool(body, "ignore_eos"),
        min_tokens=min_tokens, seed=_opt_int(body, "seed"), cache_salt=body.get("cache_salt"),
        kv_transfer_params=body.get("kv_transfer_params"),
        bootstrap_host=_opt_str(body, "bootstrap_host"),
        bootstrap_port=_opt_int(body, "bootstrap_port", 1),
        bootstrap_room=_opt_int(body, "bootstrap_room", 0),
    )


def _opt_str(body: Mapping[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise ApiError(400, f"{name} must be a string", name)
    return value


def dumps(obj: Any) -> bytes:
    """Compact JSON, as vLLM's pydantic serialization writes it."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def sse(obj: Any) -> bytes:
    """One SSE event ``data: {...}\\n\\n``."""
    return b"data: " + dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class Shaper:
    """Builds one request's response objects in vLLM's shape.

    Parameters:
        req: the parsed request.
        response_id: ``chatcmpl-…`` / ``cmpl-…`` id.
        created: Unix seconds.
        prompt_details: include ``usage.prompt_tokens_details``.
    """

    def __init__(
        self, req: ParsedRequest, response_id: str, created: int, prompt_details: bool
    ) -> None:
        self.req = req
        self.head = {
            "id": response_id,
            "object": "chat.completion.chunk" if req.api == "chat" else "text_completion",
            "created": created,
            "model": req.model,
        }
        self.prompt_details = prompt_details

    def usage(self, u: Usage) -> dict[str, Any]:
        out: dict[str, Any] = {
            "prompt_tokens": u.prompt_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "completion_tokens": u.completion_tokens,
        }
        if self.prompt_details:
            out["prompt_tokens_details"] = {"cached_tokens": u.cached_tokens}
        return out

    def role_chunk(self) -> dict[str, Any]:
        """The chat stream's first event (sent with the first token, as vLLM does)."""
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}
        return {**self.head, "choices": [choice]}

    def token_chunk(self, tok: TokenOut) -> dict[str, Any]:
        if self.req.api == "chat":
            choice: dict[str, Any] = {"index": 0, "delta": {"content": tok.text},
                                      "logprobs": None, "finish_reason": tok.finish_reason}
        else:
            choice = {"index": 0, "text": tok.text, "logprobs": None,
                      "finish_reason": tok.finish_reason, "stop_reason": None}
        return {**self.head, "choices": [choice]}

    def usage_chunk(self, u: Usage) -> dict[str, Any]:
        return {**self.head, "choices": [], "usage": self.usage(u)}

    def full(
        self, tokens: Sequence[TokenOut], u: Usage, finish_reason: str | None
    ) -> dict[str, Any]:
        """A non-streaming answer."""
        text = "".join(t.text for t in tokens)
        if self.req.api == "chat":
            choice: dict[str, Any] = {
                "index": 0, "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}
            kind = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                      "stop_reason": None, "prompt_logprobs": None}
            kind = "text_completion"
        return {**self.head, "object": kind, "choices": [choice], "usage": self.usage(u),
                "prompt_logprobs": None, "kv_transfer_params": None}
