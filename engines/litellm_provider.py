"""LiteLLM backend: third-party models (``provider/model``) served in-process through
``litellm.acompletion``, answered in OpenAI's shape and accounted like self-hosted engines.

Registered as ``litellm`` in the ``kvgate.engines`` group; the gateway calls it for catalog
entries with a ``provider`` (middleware/framework/backend.py). LiteLLM is imported lazily, in a
thread when the app starts (``start``), with ``LITELLM_LOCAL_MODEL_COST_MAP=True`` set in the
process environment first, so importing it never fetches LiteLLM's price map over the network.

* Request: the chat body's OpenAI parameters (:data:`PASSED`: messages, tools, tool_choice,
  response_format, sampling ...) go to ``acompletion`` unchanged; ``model`` is the catalog's
  ``provider/model``; the key is read from the environment variable the catalog names, at call
  time, and never logged. Streams always ask for usage (``stream_options.include_usage``).
* Answer: JSON and ``chat.completion.chunk`` dicts with ``model`` set to the public name,
  LiteLLM's extra fields dropped; the usage is re-emitted as a usage-only chunk
  (``choices: []``), which the gateway removes when the client did not ask for it.
* Usage: :func:`normalise_usage` reads cached tokens from each provider's own fields --
  Anthropic ``cache_read_input_tokens`` (``cache_creation_input_tokens`` kept alongside),
  DeepSeek ``prompt_cache_hit_tokens``, everyone else ``prompt_tokens_details.cached_tokens``
  -- and leaves them out (``None`` for kvgate) when the provider did not report them.
* Errors (:func:`map_error`): 400/422 -> BadRequest, 401/403 -> Unauthorized, 404 ->
  ModelNotFound, 429 -> RateLimited, timeouts -> 504, connection failures and 5xx -> 502.
  429 and 5xx/connection errors before the first byte are retried ``retries`` times with
  ``retry_backoff_s`` doubling (catalog entry); the plan's fallbacks come after that.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Mapping
from types import ModuleType
from typing import Any, ClassVar

from kvgate.middleware.framework.backend import BackendReply, BackendStep
from kvgate.middleware.framework.errors import (
    BadRequest,
    EngineFailed,
    EngineStatus,
    EngineTimeout,
    HTTPError,
    ModelNotFound,
    RateLimited,
    Unauthorized,
    Unreachable,
    UpstreamError,
)
from kvgate.middleware.framework.types import Api, InferenceRequest, Usage

#: OpenAI chat-completions parameters handed to LiteLLM as they are.
PASSED = frozenset({
    "messages", "tools", "tool_choice", "parallel_tool_calls", "response_format", "temperature",
    "top_p", "max_tokens", "max_completion_tokens", "stop", "n", "seed", "presence_penalty",
    "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "user", "reasoning_effort",
    "functions", "function_call", "modalities", "audio", "prediction", "service_tier",
})
#: Longest provider error text passed on to the client (characters).
MAX_MESSAGE = 500


def load_litellm() -> ModuleType:
    """Import LiteLLM with its local price map (no network) and without its console noise."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    litellm.suppress_debug_info = True
    return litellm


def _cached(provider: str, usage: Mapping[str, Any]) -> int | None:
    if provider == "anthropic":
        value = usage.get("cache_read_input_tokens")
    elif provider == "deepseek" and "prompt_cache_hit_tokens" in usage:
        value = usage.get("prompt_cache_hit_tokens")
    else:
        details = usage.get("prompt_tokens_details")
        value = details.get("cached_tokens") if isinstance(details, Mapping) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def normalise_usage(provider: str, usage: Mapping[str, Any]) -> dict[str, Any]:
    """OpenAI usage from LiteLLM's (``prompt_tokens`` includes cache reads and writes)."""
    prompt, completion = int(usage.get("prompt_tokens") or 0), int(
        usage.get("completion_tokens") or 0)
    out: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                           "total_tokens": prompt + completion}
    cached = _cached(provider, usage)
    details: dict[str, int] = {} if cached is None else {"cached_tokens": cached}
    write = usage.get("cache_creation_input_tokens")
    if isinstance(write, int) and write:
        details["cache_creation_tokens"] = write
    if details:
        out["prompt_tokens_details"] = details
    return out


def map_error(exc: BaseException, step: BackendStep) -> HTTPError:
    """A LiteLLM / OpenAI-client exception as kvgate's error (provider text kept, trimmed)."""
    import openai

    text = str(exc)[:MAX_MESSAGE]
    if isinstance(exc, openai.APITimeoutError):
        return EngineTimeout(f"provider timed out: {step.target}")
    if isinstance(exc, openai.APIConnectionError):
        return Unreachable(f"cannot reach provider for {step.target}: {text}")
    status = getattr(exc, "status_code", None)
    if status in (400, 422):
        return BadRequest(text, code="provider_bad_request")
    if status in (401, 403):
        env = step.options.get("api_key_env")
        return Unauthorized(f"the provider rejected the credentials configured for "
                            f"{step.model!r} (variable {env}): {text}",
                            code="provider_authentication_error")
    if status == 404:
        return ModelNotFound(f"the provider does not serve {step.target!r}: {text}")
    if status == 429:
        return RateLimited(f"provider rate limit: {text}", code="provider_rate_limited")
    code = status if isinstance(status, int) else None
    if code is not None and code >= 500:
        return EngineFailed(f"provider error for {step.target}: {text}", code)
    return EngineStatus(f"provider error for {step.target}: {text}", code)


async def _close(stream: Any) -> None:
    """Close LiteLLM's stream wrapper (releases the provider connection) if it can be."""
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


def is_retryable(err: HTTPError) -> bool:
    return isinstance(err, RateLimited) or (isinstance(err, UpstreamError) and err.retryable)


def _dump(obj: Any) -> dict[str, Any]:
    return dict(obj.model_dump()) if hasattr(obj, "model_dump") else dict(obj)


def _tool_call(raw: Mapping[str, Any], streamed: bool) -> dict[str, Any]:
    fn = raw.get("function") or {}
    call: dict[str, Any] = {"function": {k: fn[k] for k in ("name", "arguments")
                                         if fn.get(k) is not None}}
    for key in ("index", "id", "type") if streamed else ("id", "type"):
        if raw.get(key) is not None:
            call[key] = raw[key]
    return call


def _message(raw: Mapping[str, Any], streamed: bool) -> dict[str, Any]:
    """An OpenAI message / delta: role, content, tool_calls (+ refusal, reasoning)."""
    out: dict[str, Any] = {}
    for key in ("role", "content", "refusal", "reasoning_content"):
        if raw.get(key) is not None:
            out[key] = raw[key]
    if not streamed:
        out.setdefault("role", "assistant")
        out.setdefault("content", None)
    calls = raw.get("tool_calls")
    if calls:
        out["tool_calls"] = [_tool_call(c, streamed) for c in calls]
    return out


def to_openai_json(resp: Any, public: str, provider: str) -> dict[str, Any]:
    raw = _dump(resp)
    choices = [{"index": c.get("index", i), "message": _message(c.get("message") or {}, False),
                "finish_reason": c.get("finish_reason"), "logprobs": c.get("logprobs")}
               for i, c in enumerate(raw.get("choices") or [])]
    out = {"id": raw.get("id"), "object": "chat.completion", "created": raw.get("created"),
           "model": public, "choices": choices}
    if isinstance(raw.get("usage"), Mapping):
        out["usage"] = normalise_usage(provider, raw["usage"])
    return out


def to_openai_chunks(chunk: Any, public: str, provider: str) -> list[dict[str, Any]]:
    """The chunk's content (if any), then a usage-only chunk if it carries usage."""
    raw = _dump(chunk)
    head = {"id": raw.get("id"), "object": "chat.completion.chunk",
            "created": raw.get("created"), "model": public}
    out: list[dict[str, Any]] = []
    choices = []
    for i, c in enumerate(raw.get("choices") or []):
        delta = _message(c.get("delta") or {}, True)
        if delta or c.get("finish_reason") is not None:
            choices.append({"index": c.get("index", i), "delta": delta,
                            "finish_reason": c.get("finish_reason")})
    if choices:
        out.append({**head, "choices": choices})
    usage = raw.get("usage")
    if isinstance(usage, Mapping) and usage.get("prompt_tokens") is not None:
        out.append({**head, "choices": [], "usage": normalise_usage(provider, usage)})
    return out


class LitellmBackend:
    """``litellm`` backend (see the module docstring and docs/litellm.md). Stateless: LiteLLM
    keeps its own HTTP clients; nothing here grows per request."""

    kind: ClassVar[str] = "litellm"

    def __init__(self) -> None:
        self._litellm: ModuleType | None = None

    async def start(self) -> None:
        """Import LiteLLM off the event loop (seconds) before the first request needs it."""
        self._litellm = await asyncio.to_thread(load_litellm)

    async def stop(self) -> None:
        return None

    def _module(self) -> ModuleType:
        if self._litellm is None:
            self._litellm = load_litellm()
        return self._litellm

    def _kwargs(self, req: InferenceRequest, step: BackendStep) -> dict[str, Any]:
        if req.api != Api.CHAT:  # LiteLLM's Messages / Responses bridges are not wired yet
            raise BadRequest(
                f"model {req.model!r} is served by a third-party provider through LiteLLM, "
                f"which kvgate reaches only with /v1/chat/completions; {req.api!r} requests "
                "are not supported for it", param="model")
        opts = step.options
        kwargs = {k: v for k, v in req.body.items() if k in PASSED}
        # retries are ours (catalog ``retries``); ``_skip_mcp_handler``: LiteLLM 1.106 routes
        # any request with ``tools`` through its MCP gateway, which needs the ``mcp`` package
        # (its proxy extra) and is not used here -- the tools go to the provider as given.
        kwargs.update(model=step.target, timeout=float(opts.get("timeout_s") or 600),
                      max_retries=0, num_retries=0, _skip_mcp_handler=True)
        if opts.get("api_base"):
            kwargs["api_base"] = opts["api_base"]
        env = opts.get("api_key_env")
        if env:
            kwargs["api_key"] = os.environ.get(str(env), "")
        if req.stream:
            kwargs.update(stream=True, stream_options={"include_usage": True})
        return kwargs

    async def open(self, req: InferenceRequest, step: BackendStep) -> BackendReply:
        import openai

        litellm = self._module()
        kwargs = self._kwargs(req, step)
        retries, backoff = int(step.options.get("retries") or 0), float(
            step.options.get("retry_backoff_s") or 0)
        for attempt in range(retries + 1):
            try:
                return await self._call(litellm, kwargs, req, step)
            except openai.APIError as exc:
                err = map_error(exc, step)
                if attempt == retries or not is_retryable(err):
                    raise err from None
            await asyncio.sleep(backoff * 2**attempt)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _call(self, litellm: ModuleType, kwargs: dict[str, Any], req: InferenceRequest,
                    step: BackendStep) -> BackendReply:
        provider = step.target.split("/", 1)[0]
        resp = await litellm.acompletion(**kwargs)
        if not req.stream:
            return BackendReply(payload=to_openai_json(resp, req.model, provider))
        stream = resp.__aiter__()
        try:
            first = await anext(stream)  # failures up to here may still retry or fall back
        except BaseException:
            await _close(resp)
            raise
        return BackendReply(chunks=self._chunks(first, resp, step, req.model, provider))

    async def _chunks(self, first: Any, stream: Any, step: BackendStep,
                      public: str, provider: str) -> AsyncIterator[dict[str, Any]]:
        """OpenAI chunks; closing this generator (client gone) closes the provider stream."""
        import openai

        try:
            for out in to_openai_chunks(first, public, provider):
                yield out
            async for chunk in stream:
                for out in to_openai_chunks(chunk, public, provider):
                    yield out
        except openai.APIError as exc:
            raise map_error(exc, step) from None
        finally:
            await _close(stream)

    def extract_usage(self, payload: Mapping[str, Any]) -> Usage | None:
        usage = payload.get("usage")
        if not isinstance(usage, Mapping):
            return None
        details = usage.get("prompt_tokens_details")
        details = details if isinstance(details, Mapping) else {}
        cached, write = details.get("cached_tokens"), details.get("cache_creation_tokens")
        return Usage(prompt_tokens=int(usage["prompt_tokens"]),
                     completion_tokens=int(usage["completion_tokens"]),
                     cached_tokens=cached if isinstance(cached, int) else None,
                     cache_write_tokens=write if isinstance(write, int) else 0)
