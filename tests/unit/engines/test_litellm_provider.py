"""The LiteLLM backend's pure parts: usage normalisation per provider (cached tokens from each
provider's own fields, None when unreported), the error mapping onto kvgate's hierarchy, and
the OpenAI re-shaping of LiteLLM's answers and chunks."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import httpx
import pytest

from kvgate.engines.litellm_provider import (
    LitellmBackend,
    is_retryable,
    load_litellm,
    map_error,
    normalise_usage,
    to_openai_chunks,
    to_openai_json,
)
from kvgate.middleware.framework.backend import BackendStep

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
STEP = BackendStep("claude-x", "litellm", "anthropic/claude-x", {"api_key_env": "KVG_KEY"})

USAGES: list[tuple[str, str, dict[str, Any], int | None]] = [
    ("openai reported", "openai",
     {"prompt_tokens": 10, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 4}},
     4),
    ("openai details absent", "openai", {"prompt_tokens": 10, "completion_tokens": 2}, None),
    ("openai details null", "openai",
     {"prompt_tokens": 10, "completion_tokens": 2, "prompt_tokens_details": None}, None),
    ("anthropic read", "anthropic",
     {"prompt_tokens": 70, "completion_tokens": 5, "cache_read_input_tokens": 60,
      "cache_creation_input_tokens": 0, "prompt_tokens_details": {"cached_tokens": 60}}, 60),
    ("anthropic reported zero", "anthropic",
     {"prompt_tokens": 70, "completion_tokens": 5, "cache_read_input_tokens": 0,
      "cache_creation_input_tokens": 60}, 0),
    ("anthropic unreported", "anthropic", {"prompt_tokens": 7, "completion_tokens": 5}, None),
    ("deepseek hit", "deepseek",
     {"prompt_tokens": 9, "completion_tokens": 1, "prompt_cache_hit_tokens": 8}, 8),
    ("bool is not a count", "openai",
     {"prompt_tokens": 9, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": True}},
     None),
]


@pytest.mark.parametrize(("case", "provider", "raw", "cached"), USAGES,
                         ids=[u[0] for u in USAGES])
def test_normalise_usage(case: str, provider: str, raw: dict[str, Any],
                         cached: int | None) -> None:
    out = normalise_usage(provider, raw)
    assert out["total_tokens"] == raw["prompt_tokens"] + raw["completion_tokens"]
    usage = LitellmBackend().extract_usage({"usage": out})
    assert usage is not None
    assert usage.cached_tokens == cached
    assert usage.prompt_tokens == raw["prompt_tokens"]
    write = raw.get("cache_creation_input_tokens")
    details = out.get("prompt_tokens_details") or {}
    assert details.get("cache_creation_tokens") == (write or None)
    assert usage.cache_write_tokens == (write or 0)


@pytest.fixture(scope="module")
def litellm() -> ModuleType:
    return load_litellm()


def _status_error(litellm: ModuleType, cls_name: str, status: int) -> BaseException:
    cls = getattr(litellm, cls_name)
    response = httpx.Response(status, request=httpx.Request("POST", "http://x"))
    try:
        exc = cls(message="boom", llm_provider="anthropic", model="claude-x", response=response)
    except TypeError:  # some LiteLLM errors take no response
        exc = cls(message="boom", llm_provider="anthropic", model="claude-x")
    assert isinstance(exc, BaseException)
    return exc


ERRORS = [("BadRequestError", 400, 400, "invalid_request_error", False),
          ("AuthenticationError", 401, 401, "authentication_error", False),
          ("NotFoundError", 404, 404, "invalid_request_error", False),
          ("RateLimitError", 429, 429, "rate_limit_error", True),
          ("InternalServerError", 500, 502, "server_error", True),
          ("ServiceUnavailableError", 503, 502, "server_error", True)]


@pytest.mark.parametrize(("name", "status", "mapped", "kind", "retryable"), ERRORS,
                         ids=[e[0] for e in ERRORS])
def test_map_error(litellm: ModuleType, name: str, status: int, mapped: int, kind: str,
                   retryable: bool) -> None:
    err = map_error(_status_error(litellm, name, status), STEP)
    assert (err.status, err.type) == (mapped, kind)
    assert is_retryable(err) is retryable


def test_map_timeout_and_connection(litellm: ModuleType) -> None:
    timeout = map_error(litellm.Timeout(message="slow", model="claude-x",
                                        llm_provider="anthropic"), STEP)
    assert timeout.status == 504
    conn = map_error(litellm.APIConnectionError(message="refused", llm_provider="anthropic",
                                                model="claude-x"), STEP)
    assert conn.status == 502


def test_auth_error_names_variable_not_value(litellm: ModuleType,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVG_KEY", "sk-secret-value")
    err = map_error(_status_error(litellm, "AuthenticationError", 401), STEP)
    assert "KVG_KEY" in err.message and "sk-secret-value" not in err.message


def test_reshaped_json_and_chunks(litellm: ModuleType) -> None:
    response = litellm.ModelResponse(
        id="r1", model="claude-x", choices=[{"index": 0, "finish_reason": "tool_calls",
                                             "message": {"role": "assistant", "content": None,
                                                         "tool_calls": [{
                                                             "id": "c1", "type": "function",
                                                             "function": {"name": "f",
                                                                          "arguments": "{}"}}]}}],
        usage={"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4})
    out = to_openai_json(response, "public", "openai")
    assert out["model"] == "public" and out["object"] == "chat.completion"
    message = out["choices"][0]["message"]
    assert message == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    chunk = litellm.ModelResponseStream(id="r1", choices=[{"index": 0, "delta": {
        "content": "hi"}}])
    assert to_openai_chunks(chunk, "public", "openai") == [{
        "id": "r1", "object": "chat.completion.chunk", "created": chunk.created,
        "model": "public", "choices": [{"index": 0, "delta": {"content": "hi"},
                                        "finish_reason": None}]}]
