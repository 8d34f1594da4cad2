"""Usage conventions: every provider's usage JSON normalised to one :class:`TokenCounts`.

:class:`TokenCounts` follows OpenAI semantics: ``prompt`` *includes* the cached (cache-read) and
the cache-written tokens, ``cached`` is None when the usage did not say. Providers disagree:

=====================  ===========================================================================
convention             raw fields -> TokenCounts
=====================  ===========================================================================
``openai-chat``        ``prompt_tokens`` (includes ``prompt_tokens_details.cached_tokens`` and the
                       cache-write detail: vLLM ``created_cache_tokens``, LiteLLM
                       ``cache_creation_tokens``, OpenAI ``cache_write_tokens``); also vLLM chat,
                       SGLang chat, Fireworks. LiteLLM's own Usage also carries Anthropic's
                       top-level ``cache_read_input_tokens`` / ``cache_creation_input_tokens``
                       (counted inside ``prompt_tokens``), which win over a zero detail.
``openai-responses``   ``input_tokens`` includes ``input_tokens_details.cached_tokens`` and
                       ``.cache_write_tokens`` (OpenAI and vLLM alike)
``anthropic``          ``input_tokens`` EXCLUDES ``cache_read_input_tokens`` and
                       ``cache_creation_input_tokens``: prompt = the three summed (Anthropic and
                       vLLM's Messages endpoint alike)
``deepseek``           ``prompt_tokens = prompt_cache_hit_tokens + prompt_cache_miss_tokens``
``gemini``             ``usageMetadata``: ``promptTokenCount`` includes ``cachedContentTokenCount``;
                       tool-use prompt tokens are separate input; thoughts are billed as output
=====================  ===========================================================================

One implementation: the API adapters' usage taps (apis/) call these same functions, and the
golden table (tests/unit/pricing/test_usage_conventions.py) prices their output with
:func:`kvgate.pricing.cost.cost`. Pure: no I/O, no state.

A field that is absent is unknown (``cached`` None), never 0. Impossible numbers (cache reads
and writes beyond the prompt) are clamped so that nothing is billed twice: the cache-write
count to the prompt, then the cached count to what is left.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from typing import Any, TypeGuard

from kvgate.pricing.cost import TokenCounts


class Convention(enum.StrEnum):
    OPENAI_CHAT = "openai-chat"
    OPENAI_RESPONSES = "openai-responses"
    ANTHROPIC = "anthropic"
    DEEPSEEK = "deepseek"
    GEMINI = "gemini"


def count(value: object) -> int | None:
    """A token count: a non-negative int (bools and floats are not counts), else None.
    (A parsed JSON count is an exact ``int``: decided first, with no ``isinstance`` call; ~12
    reads per answer.)"""
    if type(value) is int:
        return value if value >= 0 else None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def _is_mapping(value: object) -> TypeGuard[Mapping[str, Any]]:
    """``isinstance(value, Mapping)``, a parsed JSON object (a dict) tested first: the ABC
    check is a Python-level call, and usage is read on every answer."""
    return type(value) is dict or isinstance(value, Mapping)


def _sub(usage: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = usage.get(key)
    return value if _is_mapping(value) else {}


def _first(*values: object) -> int | None:
    for value in values:
        n = count(value)
        if n is not None:
            return n
    return None


def counts(prompt: int, completion: int, cached: int | None, cache_write: int) -> TokenCounts:
    """TokenCounts with the cache-write and cached counts clamped into the prompt."""
    write = min(cache_write, prompt)
    return TokenCounts(prompt=prompt, completion=completion,
                       cached=None if cached is None else min(cached, prompt - write),
                       cache_write=write)


def from_openai_chat(usage: Mapping[str, Any]) -> TokenCounts | None:
    """OpenAI chat/completions usage (vLLM, SGLang, Fireworks, LiteLLM's Usage)."""
    prompt = count(usage.get("prompt_tokens"))
    if prompt is None:
        return None
    details = _sub(usage, "prompt_tokens_details")
    cached = count(details.get("cached_tokens"))
    top_read = count(usage.get("cache_read_input_tokens"))
    if top_read is not None and (cached is None or top_read > cached):
        cached = top_read  # LiteLLM streaming left the detail at 0 (BerriAI/litellm#11789)
    write = _first(usage.get("cache_creation_input_tokens"), details.get("cache_creation_tokens"),
                   details.get("created_cache_tokens"), details.get("cache_write_tokens"))
    return counts(prompt, count(usage.get("completion_tokens")) or 0, cached, write or 0)


def from_openai_responses(usage: Mapping[str, Any]) -> TokenCounts | None:
    """OpenAI Responses usage (``input_tokens`` includes the cached and cache-write details)."""
    prompt = count(usage.get("input_tokens"))
    if prompt is None:
        return None
    details = _sub(usage, "input_tokens_details")
    write = count(details.get("cache_write_tokens")) or 0
    return counts(prompt, count(usage.get("output_tokens")) or 0,
                  count(details.get("cached_tokens")), write)


def from_anthropic(usage: Mapping[str, Any]) -> TokenCounts | None:
    """Anthropic Messages usage: ``input_tokens`` excludes cache reads and cache writes."""
    uncached = count(usage.get("input_tokens"))
    if uncached is None:
        return None
    read = count(usage.get("cache_read_input_tokens"))
    write = count(usage.get("cache_creation_input_tokens")) or 0
    return counts(uncached + (read or 0) + write, count(usage.get("output_tokens")) or 0,
                  read, write)


def from_deepseek(usage: Mapping[str, Any]) -> TokenCounts | None:
    """DeepSeek: hit + miss = prompt; ``prompt_tokens_details.cached_tokens`` as a fallback."""
    hit, miss = count(usage.get("prompt_cache_hit_tokens")), count(
        usage.get("prompt_cache_miss_tokens"))
    prompt = count(usage.get("prompt_tokens"))
    if prompt is None and hit is not None and miss is not None:
        prompt = hit + miss
    if prompt is None:
        return None
    if hit is None:
        hit = count(_sub(usage, "prompt_tokens_details").get("cached_tokens"))
    return counts(prompt, count(usage.get("completion_tokens")) or 0, hit, 0)


def from_gemini(usage: Mapping[str, Any]) -> TokenCounts | None:
    """Gemini ``usageMetadata`` (camelCase as the REST API sends it)."""
    prompt = count(usage.get("promptTokenCount"))
    if prompt is None:
        return None
    prompt += count(usage.get("toolUsePromptTokenCount")) or 0
    completion = (count(usage.get("candidatesTokenCount")) or 0) + (
        count(usage.get("thoughtsTokenCount")) or 0)
    return counts(prompt, completion, count(usage.get("cachedContentTokenCount")), 0)


NORMALISERS: Mapping[Convention, Callable[[Mapping[str, Any]], TokenCounts | None]] = {
    Convention.OPENAI_CHAT: from_openai_chat,
    Convention.OPENAI_RESPONSES: from_openai_responses,
    Convention.ANTHROPIC: from_anthropic,
    Convention.DEEPSEEK: from_deepseek,
    Convention.GEMINI: from_gemini,
}


def normalise(convention: Convention, usage: object) -> TokenCounts | None:
    """``usage`` (the provider's usage object) in OpenAI semantics; None if unrecognisable."""
    if not _is_mapping(usage):
        return None
    return NORMALISERS[convention](usage)


__all__ = ["NORMALISERS", "Convention", "count", "counts", "from_anthropic", "from_deepseek",
           "from_gemini", "from_openai_chat", "from_openai_responses", "normalise"]
