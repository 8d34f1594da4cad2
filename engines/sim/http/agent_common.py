"""What the agent APIs of the simulator (Messages, Responses, tokenize, embeddings, render)
share: vLLM 0.32's request-validation errors, body reading, named SSE events, the
unknown-model and output-limit checks, and the cache-write count.

vLLM validates every body with FastAPI before its handler runs; a body that fails (malformed
JSON, a missing or mistyped field) is answered by one exception handler in the OpenAI shape on
*every* route, Anthropic's included::

    {"error": {"message": "1 validation error:\\n  {'type': 'missing', 'loc': 'body.max_tokens',
     'msg': 'Field required', 'input': '<dict of 2 items>'}", "type": "Bad Request",
     "param": "body.max_tokens", "code": 400}}

:class:`ValidationFailed` reproduces that; :func:`check_fields` finds the errors of a body
against a field table, as pydantic would (all of them, in table order).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from kvgate.engines.sim.http.protocol import ApiError, dumps

#: Largest request body accepted, in bytes (413 past it), as for chat.
MAX_BODY_BYTES = 16 << 20
_MAX_INPUT_CHARS = 200

#: Field kind → (pydantic error type, message, Python types accepted).
_KINDS: Mapping[str, tuple[str, str, tuple[type, ...]]] = {
    "str": ("string_type", "Input should be a valid string", (str,)),
    "int": ("int_type", "Input should be a valid integer", (int,)),
    "number": ("float_type", "Input should be a valid number", (int, float)),
    "bool": ("bool_type", "Input should be a valid boolean", (bool,)),
    "list": ("list_type", "Input should be a valid list", (list,)),
    "dict": ("dict_type", "Input should be a valid dictionary", (dict,)),
    "str|list": ("string_type", "Input should be a valid string", (str, list)),
    "str|dict": ("string_type", "Input should be a valid string", (str, dict)),
}


@dataclass(frozen=True, slots=True)
class Field:
    """One body field: its name, kind (a key of ``_KINDS``) and whether it is required."""

    name: str
    kind: str
    required: bool = False


def _summary(value: Any) -> str:
    """vLLM's size-bounded stand-in for an offending value."""
    if isinstance(value, str):
        return value if len(value) <= _MAX_INPUT_CHARS else \
            value[:_MAX_INPUT_CHARS] + "...[truncated]"
    if isinstance(value, list | dict | tuple):
        return f"<{type(value).__name__} of {len(value)} items>"
    return str(value)


class ValidationFailed(ApiError):
    """A body FastAPI's validation rejects: 400 in the OpenAI shape, type ``Bad Request``."""

    def __init__(self, errors: Sequence[Mapping[str, Any]]) -> None:
        count = len(errors)
        label = "error" if count == 1 else "errors"
        lines = "".join(f"  {dict(err)}\n" for err in errors[:10])
        if count > 10:
            lines += f"  ...and {count - 10} more {label}\n"
        super().__init__(400, f"{count} validation {label}:\n{lines}".rstrip(),
                         str(errors[0]["loc"]))

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": "Bad Request", "param": self.param,
                          "code": 400}}


def _kind_ok(value: Any, accepted: tuple[type, ...]) -> bool:
    if isinstance(value, bool) and bool not in accepted:
        return False
    return isinstance(value, accepted)


def field_errors(body: Mapping[str, Any], fields: Sequence[Field]) -> list[dict[str, Any]]:
    """Pydantic-style errors of ``body`` against ``fields`` (``None`` counts as absent)."""
    errors: list[dict[str, Any]] = []
    for f in fields:
        value = body.get(f.name)
        if value is None:
            if f.required:
                errors.append({"type": "missing", "loc": f"body.{f.name}",
                               "msg": "Field required", "input": _summary(dict(body))})
            continue
        kind, msg, accepted = _KINDS[f.kind]
        if not _kind_ok(value, accepted):
            errors.append({"type": kind, "loc": f"body.{f.name}", "msg": msg,
                           "input": _summary(value)})
    return errors


def check_fields(body: Any, fields: Sequence[Field]) -> Mapping[str, Any]:
    """The body as a mapping, or :class:`ValidationFailed` with every error found."""
    if not isinstance(body, Mapping):
        raise ValidationFailed([{
            "type": "model_attributes_type", "loc": "body",
            "msg": "Input should be a valid dictionary or object to extract fields from",
            "input": _summary(body)}])
    errors = field_errors(body, fields)
    if errors:
        raise ValidationFailed(errors)
    return body


async def read_body(request: Request) -> Any:
    """The JSON body; 413 past :data:`MAX_BODY_BYTES`, :class:`ValidationFailed` for bad JSON
    (``loc`` ``body.<offset>``, as FastAPI reports it)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise ApiError(413, f"request body larger than {MAX_BODY_BYTES} bytes")
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise ApiError(413, f"request body larger than {MAX_BODY_BYTES} bytes")
    try:
        return json.loads(raw)
    except UnicodeDecodeError as exc:
        raise ValidationFailed([{"type": "json_invalid", "loc": "body.0",
                                 "msg": "JSON decode error", "input": "<dict of 0 items>",
                                 "ctx": {"error": str(exc)}}]) from None
    except json.JSONDecodeError as exc:
        raise ValidationFailed([{"type": "json_invalid", "loc": f"body.{exc.pos}",
                                 "msg": "JSON decode error", "input": "<dict of 0 items>",
                                 "ctx": {"error": exc.msg}}]) from None


def resolve_model(model: Any, served: Sequence[str]) -> str:
    """The served model a request names (the first one when it names none); 404 otherwise,
    worded as vLLM 0.32 words it."""
    if model is None:
        return served[0]
    if model not in served:
        raise ApiError(404, f"The model `{model}` does not exist. Valid aliases: "
                       f"{', '.join(served)}.", "model")
    return str(model)


def output_limit(param: str, requested: int | None, prompt_len: int, max_len: int) -> int:
    """The completion limit (default: what the context has left); 400 as vLLM words it."""
    if requested is not None and requested < 1:
        raise ApiError(400, f"{param} must be at least 1, got {requested}.", param)
    if requested is not None and requested > max_len:
        raise ApiError(400, f"{param}={requested} cannot be greater than max_model_len="
                       f"{max_len}. Please request fewer output tokens. (parameter={param}, "
                       f"value={requested})", param)
    if prompt_len + (requested or 1) > max_len:
        raise ApiError(400, f"This model's maximum context length is {max_len} tokens. "
                       f"However, your request has {prompt_len} input tokens. Please reduce "
                       "the length of the input messages.", "input_tokens")
    return requested if requested is not None else max_len - prompt_len


def cache_write_tokens(prompt_tokens: int, cached_tokens: int, block_size: int) -> int:
    """Prompt tokens this request wrote to the prefix cache: its full blocks beyond the hit
    (vLLM 0.32's ``created_cache_tokens`` / ``cache_write_tokens``: a repeated 1,406-token
    prompt at block size 128 reports 1,280 written, then 0 written and 1,280 read)."""
    return max(0, prompt_tokens // block_size * block_size - cached_tokens)


def named_sse(event: str, obj: Any) -> bytes:
    """One SSE event with a name: ``event: <name>\\ndata: {...}\\n\\n``."""
    return b"event: " + event.encode() + b"\ndata: " + dumps(obj) + b"\n\n"
