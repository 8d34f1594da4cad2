"""The usage rewrite of two-hop requests: the client sees the prefill side's own cache hit."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvgate.apis.openai import ChatCompletions, OpenAITap
from kvgate.middleware.framework.connector import PrefillHit, reported_cached, rewrite_usage
from kvgate.middleware.framework.types import Usage
from kvgate.middleware.serving.disagg import UsageRewriter
from kvgate.middleware.serving.sse import EventRelay


def _relay(strip: bool, rw: UsageRewriter) -> EventRelay:
    """The stream relay as the dispatcher builds it for a two-hop chat request."""
    set_cached = ChatCompletions().set_cached_tokens

    def adjust(payload: dict[str, Any], usage: Usage) -> Usage:
        return rw.adjust(payload, usage, set_cached)[1] or usage

    return EventRelay(OpenAITap(client_wants_usage=not strip), adjust)


def _answer(prompt: int, cached: int | None, details: bool = True) -> dict[str, Any]:
    usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": 3,
                             "total_tokens": prompt + 3}
    if details:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return {"id": "x", "choices": [], "usage": usage, "kv_transfer_params": None}


@pytest.mark.parametrize(
    ("decode_cached", "details", "hit", "convention", "expected"),
    [
        # older engines: decode counts the transferred KV (whole prompt) as cached
        (992, True, (True, 128), "transferred", 128),
        # vLLM 0.32: decode already reports the prefill's hit
        (128, True, (True, 128), "prefill-hit", 128),
        # prefill answered without a hit: trust decode only if it reports the prefill hit
        (128, True, (True, None), "prefill-hit", 128),
        (992, True, (True, None), "transferred", None),
        # prefill not answered yet (concurrent connectors)
        (992, True, (False, None), "transferred", None),
        # decode reports no details at all: the prefill hit is added
        (None, False, (True, 64), "transferred", 64),
        # a hit above the prompt is clamped
        (None, True, (True, 5000), "transferred", 1000),
    ],
)
def test_rewrite_table(decode_cached: int | None, details: bool, hit: tuple[bool, int | None],
                       convention: str, expected: int | None) -> None:
    payload = _answer(1000, decode_cached, details)
    known, tokens = hit
    ph = PrefillHit()
    if known:
        ph.set(tokens)
    rw = UsageRewriter(ph, "transferred" if convention == "transferred" else "prefill-hit")
    rw.rewrite_chunk(payload)
    assert "kv_transfer_params" not in payload
    assert payload["usage"]["prompt_tokens"] == 1000
    if expected is None and not details:
        assert "prompt_tokens_details" not in payload["usage"]
    else:
        assert reported_cached(payload) == expected
        assert payload["usage"]["prompt_tokens_details"]["cached_tokens"] == expected


def test_rewrite_without_usage_only_drops_transfer_params() -> None:
    payload: dict[str, Any] = {"choices": [{"delta": {}}], "kv_transfer_params": {"a": 1}}
    assert rewrite_usage(payload, 5)
    assert payload == {"choices": [{"delta": {}}]}
    assert not rewrite_usage(payload, 5)


async def test_rewrite_json_bytes() -> None:
    ph = PrefillHit()
    ph.set(48)
    rw = UsageRewriter(ph, "transferred")
    out = json.loads(await rw.rewrite_json(json.dumps(_answer(100, 96)).encode()))
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
    assert await rw.rewrite_json(b"not json") == b"not json"


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


@pytest.mark.parametrize("split", [1, 7, 50, 10_000])
@pytest.mark.parametrize("strip", [False, True])
def test_sse_rewrite_split_chunks(split: int, strip: bool) -> None:
    """The usage chunk is rewritten however the stream is cut into reads."""
    stream = (_sse({"choices": [{"delta": {"content": "hi"}}]})
              + _sse({"choices": [], "usage": _answer(500, 496)["usage"]})
              + b"data: [DONE]\n\n")
    ph = PrefillHit()
    ph.set(32)
    tap = _relay(strip, UsageRewriter(ph, "transferred"))
    out = b"".join(tap.feed(stream[i:i + split]) for i in range(0, len(stream), split))
    out += tap.flush()
    assert tap.usage is not None and tap.usage.cached_tokens == 32
    assert tap.done
    if strip:
        assert b"usage" not in out
    else:
        assert b'"cached_tokens":32' in out
        assert b"496" not in out


def test_sse_missing_usage_chunk() -> None:
    ph = PrefillHit()
    ph.set(32)
    tap = _relay(False, UsageRewriter(ph, "transferred"))
    data = _sse({"choices": [{"delta": {"content": "a"}}]}) + b"data: [DONE]\n\n"
    assert tap.feed(data) == data
    assert tap.usage is None and tap.done


#: (case, decode usage, prefill hit, cached the client and hooks see). Cache writes the decode
#: engine reports stay; the hit is clamped into what is left of the prompt, so kvgate.pricing.cost
#: (which refuses reads + writes beyond the prompt) never raises.
CLAMP_CASES: list[tuple[str, Usage, int | None, int | None]] = [
    ("hit within the prompt", Usage(100, 3, None, 30), 60, 60),
    ("hit past prompt - writes", Usage(100, 3, None, 30), 90, 70),
    ("hit past the prompt", Usage(100, 3, 0, 0), 150, 100),
    ("writes are the whole prompt", Usage(100, 3, None, 100), 64, 0),
    ("unknown hit", Usage(100, 3, None, 30), None, None),
]


@pytest.mark.parametrize(("case", "usage", "hit", "expected"), CLAMP_CASES,
                         ids=[c[0] for c in CLAMP_CASES])
def test_adjust_clamps_the_hit_into_prompt_minus_writes(case: str, usage: Usage,
                                                        hit: int | None,
                                                        expected: int | None) -> None:
    from decimal import Decimal

    from kvgate.apis.anthropic import MessagesAdapter
    from kvgate.pricing.cost import TokenCounts, cost
    from kvgate.pricing.prices import ModelPrice

    prefill = PrefillHit()
    prefill.set(hit)
    rw = UsageRewriter(prefill, "transferred")
    chat = {"usage": {"prompt_tokens": usage.prompt_tokens, "completion_tokens": 3,
                      "prompt_tokens_details": {"cached_tokens": 0,
                                                "created_cache_tokens": usage.cache_write_tokens}}}
    messages = {"usage": {"input_tokens": usage.prompt_tokens - usage.cache_write_tokens,
                          "cache_creation_input_tokens": usage.cache_write_tokens,
                          "cache_read_input_tokens": 0, "output_tokens": 3}}
    for payload, set_cached, tap in (
            (chat, ChatCompletions().set_cached_tokens, ChatCompletions().new_tap(True)),
            (messages, MessagesAdapter().set_cached_tokens, MessagesAdapter().new_tap(True))):
        _, seen = rw.adjust(payload, usage, set_cached)
        assert seen is not None and seen.cached_tokens == expected
        tap.on_json(payload)  # what the client is shown agrees with what the hooks saw
        assert tap.usage is not None and tap.usage.cached_tokens == expected
        assert tap.usage.cache_write_tokens == usage.cache_write_tokens
        price = ModelPrice(input=Decimal(3), cached_input=Decimal(1), output=Decimal(15))
        cost(TokenCounts(prompt=seen.prompt_tokens, completion=seen.completion_tokens,
                         cached=seen.cached_tokens, cache_write=seen.cache_write_tokens), price)
