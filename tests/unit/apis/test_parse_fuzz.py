"""Seeded fuzz: any JSON body either parses or is a 400 naming a field, never a crash."""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest

from kvgate.apis.anthropic import CountTokensAdapter, MessagesAdapter
from kvgate.apis.responses import ResponsesAdapter
from kvgate.middleware.framework.errors import BadRequest
from tests.unit.apis.samples import cases

SCALARS: list[Any] = [None, True, 0, -1, 7, 1.5, "", "x", "x-anthropic-billing-header: y",
                      "text", "tool_use", "tool_result", "image", "thinking", "function_call",
                      "message", "reasoning", "user", "assistant", "system", "custom_tool_call"]


def _value(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.random()
    if depth > 3 or roll < 0.5:
        return rng.choice(SCALARS)
    if roll < 0.75:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(3))]
    keys = ["type", "text", "content", "role", "id", "name", "input", "source", "thinking",
            "tool_use_id", "tool", "call_id", "arguments", "output", "summary", "namespace"]
    return {rng.choice(keys): _value(rng, depth + 1) for _ in range(rng.randrange(4))}


def _mutate(rng: random.Random, node: Any, rate: float) -> Any:
    """A copy of ``node`` with each value replaced by a random one with probability ``rate``."""
    if rng.random() < rate:
        return _value(rng)
    if isinstance(node, dict):
        return {k: _mutate(rng, v, rate) for k, v in node.items()}
    if isinstance(node, list):
        return [_mutate(rng, v, rate) for v in node]
    return node


ADAPTERS: list[tuple[str, Any]] = [("messages", MessagesAdapter()),
                                   ("messages", MessagesAdapter(merge_inline_system=True)),
                                   ("messages", CountTokensAdapter()),
                                   ("responses", ResponsesAdapter())]


@pytest.mark.parametrize(("group", "adapter"), ADAPTERS,
                         ids=["messages", "messages-merged", "count_tokens", "responses"])
def test_parse_never_crashes(group: str, adapter: Any) -> None:
    rng = random.Random(f"kvgate-{group}-{type(adapter).__name__}")
    bodies = list(cases()[group].values())
    parsed, rejected = 0, []
    for _ in range(3000):
        body = _mutate(rng, copy.deepcopy(rng.choice(bodies)), rng.choice([0.02, 0.05, 0.1]))
        if not isinstance(body, dict):
            continue
        try:
            adapter.parse(body, {})
            parsed += 1
        except BadRequest as err:
            rejected.append(err)
    assert all(err.status == 400 and err.param for err in rejected)
    assert parsed > 300  # the fuzz reaches the conversion, not only the validation
