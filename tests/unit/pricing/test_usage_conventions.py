"""The golden table of usage conventions: raw usage JSON -> normalised counts -> cost.

Every case is priced with one fixed card through :func:`kvgate.pricing.cost.cost` (Decimal). Each row
asserts the counts (nothing double counted: ``prompt = uncached + cached + cache_write`` with
every part non-negative; no cached token lost: ``cost.cached_tokens`` is what the provider
reported) and the exact total. Rows marked with a LiteLLM issue are the usage its users hit,
with the amount LiteLLM billed where the issue shows it. docs/apis.md has the same table.
"""

from __future__ import annotations

import random
from decimal import Decimal
from typing import Any

import pytest

from kvgate.pricing.cost import CachedSource, TokenCounts, cost
from kvgate.pricing.prices import ModelPrice
from kvgate.pricing.usage_conventions import Convention, normalise

M = Decimal(1_000_000)
#: $3 / M input, $0.30 / M cached, $3.75 / M cache write, $15 / M output.
CARD = ModelPrice(input=Decimal(3) / M, cached_input=Decimal("0.30") / M,
                  cache_write=Decimal("3.75") / M, output=Decimal(15) / M)

VLLM_CHAT = {"prompt_tokens": 1200, "completion_tokens": 7, "total_tokens": 1207,
             "prompt_tokens_details": {"cached_tokens": 1024, "created_cache_tokens": 160}}
VLLM_MESSAGES = {"input_tokens": 16, "output_tokens": 7, "cache_creation_input_tokens": 160,
                 "cache_read_input_tokens": 1024}
VLLM_RESPONSES = {"input_tokens": 1200, "output_tokens": 7, "total_tokens": 1207,
                  "input_tokens_details": {"cached_tokens": 1024, "cache_write_tokens": 160,
                                           "input_tokens_per_turn": [1200],
                                           "cached_tokens_per_turn": [1024]},
                  "output_tokens_details": {"reasoning_tokens": 0}}
SAME_AS_VLLM = TokenCounts(prompt=1200, completion=7, cached=1024, cache_write=160)

# (id, convention, raw usage, expected counts, expected total USD)
GOLDEN: list[tuple[str, Convention, dict[str, Any], TokenCounts, str]] = [
    ("openai-chat", Convention.OPENAI_CHAT,
     {"prompt_tokens": 2006, "completion_tokens": 300, "total_tokens": 2306,
      "prompt_tokens_details": {"cached_tokens": 1920, "audio_tokens": 0}},
     TokenCounts(2006, 300, 1920, 0), "0.005334"),
    ("openai-responses", Convention.OPENAI_RESPONSES,
     {"input_tokens": 2006, "input_tokens_details": {"cached_tokens": 1920},
      "output_tokens": 300, "output_tokens_details": {"reasoning_tokens": 0},
      "total_tokens": 2306},
     TokenCounts(2006, 300, 1920, 0), "0.005334"),
    ("vllm-chat-litellm-22984", Convention.OPENAI_CHAT,  # LiteLLM showed 0 cache reads
     {"total_tokens": 150687, "prompt_tokens": 150383, "completion_tokens": 304,
      "prompt_tokens_details": {"text_tokens": None, "audio_tokens": None,
                                "image_tokens": None, "cached_tokens": 149936},
      "completion_tokens_details": {"reasoning_tokens": 15}},
     TokenCounts(150383, 304, 149936, 0), "0.0508818"),
    ("vllm-0.32-chat", Convention.OPENAI_CHAT, VLLM_CHAT, SAME_AS_VLLM, "0.0010602"),
    ("vllm-0.32-messages", Convention.ANTHROPIC, VLLM_MESSAGES, SAME_AS_VLLM, "0.0010602"),
    ("vllm-0.32-responses", Convention.OPENAI_RESPONSES, VLLM_RESPONSES, SAME_AS_VLLM,
     "0.0010602"),
    ("vllm-chat-no-details", Convention.OPENAI_CHAT,  # --enable-prompt-tokens-details off
     {"prompt_tokens": 1200, "completion_tokens": 7, "total_tokens": 1207},
     TokenCounts(1200, 7, None, 0), "0.003705"),
    ("vllm-messages-no-details", Convention.ANTHROPIC,
     {"input_tokens": 1200, "output_tokens": 7}, TokenCounts(1200, 7, None, 0), "0.003705"),
    ("anthropic-cache-write-litellm-9812", Convention.ANTHROPIC,  # LiteLLM: $0.091311
     {"input_tokens": 3, "cache_creation_input_tokens": 12304, "cache_read_input_tokens": 0,
      "output_tokens": 550},
     TokenCounts(12307, 550, 0, 12304), "0.054399"),
    ("anthropic-cache-read", Convention.ANTHROPIC,
     {"input_tokens": 4, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 2455,
      "output_tokens": 23},
     TokenCounts(2459, 23, 2455, 0), "0.0010935"),
    ("litellm-usage-anthropic-stream-11789", Convention.OPENAI_CHAT,  # detail 0, top-level set
     {"total_tokens": 2482, "prompt_tokens": 2459, "completion_tokens": 23,
      "prompt_tokens_details": {"audio_tokens": None, "cached_tokens": 0},
      "cache_read_input_tokens": 2455, "cache_creation_input_tokens": 0},
     TokenCounts(2459, 23, 2455, 0), "0.0010935"),
    ("litellm-usage-anthropic-11364", Convention.OPENAI_CHAT,
     {"total_tokens": 103925, "prompt_tokens": 98805, "completion_tokens": 5120,
      "prompt_tokens_details": {"cached_tokens": 66360, "cache_creation_tokens": 32435},
      "cache_read_input_tokens": 66360, "cache_creation_input_tokens": 32435},
     TokenCounts(98805, 5120, 66360, 32435), "0.21836925"),
    ("litellm-messages-to-responses-35127", Convention.OPENAI_RESPONSES,  # cached dropped
     {"input_tokens": 12000, "output_tokens": 40, "input_tokens_details": {"cached_tokens": 11008}},
     TokenCounts(12000, 40, 11008, 0), "0.0068784"),
    ("sglang-cache-report", Convention.OPENAI_CHAT,
     {"prompt_tokens": 3000, "completion_tokens": 20, "total_tokens": 3020,
      "prompt_tokens_details": {"cached_tokens": 2048}},
     TokenCounts(3000, 20, 2048, 0), "0.0037704"),
    ("sglang-no-report", Convention.OPENAI_CHAT,  # details only when enabled and > 0
     {"prompt_tokens": 3000, "completion_tokens": 20, "total_tokens": 3020,
      "prompt_tokens_details": None},
     TokenCounts(3000, 20, None, 0), "0.0093"),
    ("fireworks", Convention.OPENAI_CHAT,
     {"prompt_tokens": 5000, "completion_tokens": 100, "total_tokens": 5100,
      "prompt_tokens_details": {"cached_tokens": 4096}},
     TokenCounts(5000, 100, 4096, 0), "0.0054408"),
    ("deepseek", Convention.DEEPSEEK,
     {"prompt_tokens": 4282, "completion_tokens": 46, "total_tokens": 4328,
      "prompt_cache_hit_tokens": 1024, "prompt_cache_miss_tokens": 3258,
      "prompt_tokens_details": {"cached_tokens": 1024}},
     TokenCounts(4282, 46, 1024, 0), "0.0107712"),
    ("deepseek-hit-miss-only", Convention.DEEPSEEK,
     {"completion_tokens": 46, "prompt_cache_hit_tokens": 1024,
      "prompt_cache_miss_tokens": 3258},
     TokenCounts(4282, 46, 1024, 0), "0.0107712"),
    ("gemini", Convention.GEMINI,
     {"promptTokenCount": 10000, "candidatesTokenCount": 200, "cachedContentTokenCount": 8000,
      "thoughtsTokenCount": 50, "totalTokenCount": 10250},
     TokenCounts(10000, 250, 8000, 0), "0.01215"),
    ("gemini-tool-use-no-cache", Convention.GEMINI,
     {"promptTokenCount": 900, "toolUsePromptTokenCount": 100, "candidatesTokenCount": 10},
     TokenCounts(1000, 10, None, 0), "0.00315"),
]


@pytest.mark.parametrize(("convention", "raw", "expected", "total"),
                         [c[1:] for c in GOLDEN], ids=[c[0] for c in GOLDEN])
def test_golden_table(convention: Convention, raw: dict[str, Any], expected: TokenCounts,
                      total: str) -> None:
    counts = normalise(convention, raw)
    assert counts == expected
    cached = counts.cached or 0
    uncached = counts.prompt - cached - counts.cache_write
    assert min(uncached, cached, counts.cache_write) >= 0  # nothing counted twice
    priced = cost(counts, CARD)
    assert priced.cached_tokens == cached  # no cached token lost
    assert priced.cached_source is (CachedSource.UNKNOWN if counts.cached is None
                                    else CachedSource.REPORTED)
    assert priced.total == Decimal(total)


def test_one_engine_usage_costs_the_same_through_every_api() -> None:
    """vLLM 0.32 reports one request's usage in three shapes; the bill is one."""
    totals = {cost(normalise(c, raw) or TokenCounts(0, 0), CARD).total
              for c, raw in [(Convention.OPENAI_CHAT, VLLM_CHAT),
                             (Convention.ANTHROPIC, VLLM_MESSAGES),
                             (Convention.OPENAI_RESPONSES, VLLM_RESPONSES)]}
    assert totals == {Decimal("0.0010602")}


def test_litellm_22984_was_billed_at_the_full_input_rate() -> None:
    raw = GOLDEN[2][2]
    wrong = cost(TokenCounts(raw["prompt_tokens"], raw["completion_tokens"], 0), CARD).total
    assert wrong == Decimal("0.455709")
    assert cost(normalise(Convention.OPENAI_CHAT, raw) or TokenCounts(0, 0), CARD).total < wrong


def test_conventions_agree_on_random_usage() -> None:
    """Seeded: one (uncached, read, write, out) split written in each convention normalises to
    the same counts and the same cost."""
    rng = random.Random(20261124)
    for _ in range(500):
        uncached, read, write, out = (rng.randrange(0, 200_000) for _ in range(4))
        prompt = uncached + read + write
        shapes = [
            (Convention.ANTHROPIC, {"input_tokens": uncached, "cache_read_input_tokens": read,
                                    "cache_creation_input_tokens": write, "output_tokens": out}),
            (Convention.OPENAI_CHAT, {"prompt_tokens": prompt, "completion_tokens": out,
                                      "prompt_tokens_details": {"cached_tokens": read,
                                                                "cache_write_tokens": write}}),
            (Convention.OPENAI_RESPONSES, {"input_tokens": prompt, "output_tokens": out,
                                           "input_tokens_details": {
                                               "cached_tokens": read,
                                               "cache_write_tokens": write}}),
        ]
        results = {normalise(c, raw) for c, raw in shapes}
        assert results == {TokenCounts(prompt, out, read, write)}


@pytest.mark.parametrize("convention", list(Convention))
@pytest.mark.parametrize("raw", [None, [], {}, {"prompt_tokens": "12"}, {"input_tokens": -1},
                                 {"promptTokenCount": True}])
def test_unrecognisable_usage_is_none(convention: Convention, raw: object) -> None:
    assert normalise(convention, raw) is None


def test_impossible_numbers_are_clamped_not_double_billed() -> None:
    counts = normalise(Convention.OPENAI_CHAT, {
        "prompt_tokens": 100, "completion_tokens": 1,
        "prompt_tokens_details": {"cached_tokens": 90, "cache_write_tokens": 30}})
    assert counts == TokenCounts(100, 1, 70, 30)
    cost(counts, CARD)  # valid for the cost formula


def test_the_adapters_use_these_normalisers() -> None:
    import kvgate.apis.anthropic
    import kvgate.apis.responses
    from kvgate.pricing import usage_conventions

    assert vars(kvgate.apis.anthropic)["from_anthropic"] is usage_conventions.from_anthropic
    assert vars(kvgate.apis.responses)["from_openai_responses"] is (
        usage_conventions.from_openai_responses)


class _Count(int):
    """An int subclass that is not a bool (as an ``IntEnum`` member is): still a count."""


@pytest.mark.parametrize(("value", "expected"), [
    (0, 0), (7, 7), (-1, None), (True, None), (False, None), (1.0, None), (None, None),
    ("3", None), (_Count(5), 5), (_Count(-5), None), ([1], None),
])
def test_a_count_is_a_non_negative_int_not_a_bool(value: object, expected: int | None) -> None:
    from kvgate.pricing.usage_conventions import count

    assert count(value) == expected
