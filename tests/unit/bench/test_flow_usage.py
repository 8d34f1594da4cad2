"""bench.flow_control counts a stream's cached prompt tokens only when the engine said them."""

from __future__ import annotations

from typing import Any

import pytest

from bench.flow_control import Tally, _count_usage, summary


@pytest.mark.parametrize(("usage", "counted"), [
    ({"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 64}}, (100, 64)),
    ({"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 0}}, (100, 0)),
    ({"prompt_tokens": 100, "prompt_tokens_details": None}, (0, 0)),  # unknown, not 0
    ({"prompt_tokens": 100}, (0, 0)),
    (None, (0, 0)),
    ({"prompt_tokens": None, "prompt_tokens_details": {"cached_tokens": 5}}, (0, 0)),
])
def test_usage_is_counted_only_with_cached_tokens(usage: dict[str, Any] | None,
                                                  counted: tuple[int, int]) -> None:
    tally = Tally()
    _count_usage(usage, tally)
    assert (tally.prompt_tokens, tally.cached_tokens) == counted


def test_summary_reports_the_cached_share() -> None:
    tally = Tally()
    _count_usage({"prompt_tokens": 300, "prompt_tokens_details": {"cached_tokens": 240}}, tally)
    _count_usage({"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 0}}, tally)
    _count_usage({"prompt_tokens": 999}, tally)
    out = summary(tally)
    assert (out["prompt_tokens"], out["cached_tokens"], out["cached_share"]) == (400, 240, 0.6)
    assert summary(Tally())["cached_share"] is None
