"""Conversations recognised without session headers (plugins/placement/conversations.py) and what the
placement scorer does with them: a conversation's own growth does not push it off its engine,
while a new session sharing only a system prompt is not taken for someone's later turn."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvgate.middleware.framework.types import CycleState, RoutingDecision
from kvgate.plugins.common.state import PREFIX_MATCH, PROMPT_CHAIN, TOKEN_IDS, PrefixMatch
from kvgate.plugins.placement.conversations import Conversations
from kvgate.plugins.placement.scorer import KvPlacementScorer
from kvgate.plugins.prefix.index.hashing import chain_hashes
from tests.unit.routing_load.helpers import Lookup, ep, req

B = 16
SYSTEM = list(range(1000, 1000 + 40 * B))  # a 640-token system prompt shared by sessions


def _chain(tokens: Sequence[int]) -> list[int]:
    return chain_hashes(tokens, B)


def _turns(first: int, *grow: int, start: int = 10_000) -> list[list[int]]:
    """One conversation's prompts: the system prompt plus ``first`` tokens, each later prompt
    the previous one plus ``grow[i]`` new tokens (reply and message)."""
    out = [SYSTEM + list(range(start, start + first))]
    nxt = start + first
    for g in grow:
        out.append(out[-1] + list(range(nxt, nxt + g)))
        nxt += g
    return out


A = _turns(37, 70, 301)  # partial tails: 37 and 107 tokens past the system prompt
OTHER = _turns(37, start=50_000)  # another session: same system prompt, another message
SAME_START = [[*A[0][:-12], *[7] * 12]]  # same first blocks, another partial tail
#: remembered prompts (all but the last ``slack`` = 8 tokens) ending on a block boundary
ALIGNED = _turns(2 * B + 8, 3 * B, start=90_000)

# (case, prompts remembered, prompt looked up, index of the expected remembered prompt or None)
LOOKUPS = [
    ("the next turn extends the previous prompt", [A[0]], A[1], 0),
    ("the latest earlier turn is found", [A[0], A[1]], A[2], 1),
    ("a turn that skipped one still finds the one it extends", [A[0]], A[2], 0),
    ("another session sharing only the system prompt is not it", [A[0]], OTHER[0], None),
    ("same full blocks, another partial tail: not it", [A[0]], SAME_START[0], None),
    ("prompts ending on a block boundary", [ALIGNED[0]], ALIGNED[1], 0),
    ("the same prompt again (a retry) is its own earlier turn", [A[1]], A[1], 0),
    ("a shorter prompt never matches a longer one", [A[1]], A[0], None),
    ("the template's last tokens may retokenize: the last 8 are not compared",
     [A[0]], [*A[0][:-3], 5, 5, 5, *A[1][len(A[0]):]], 0),
    ("a burst after one system prompt: another short question of the same length is not it",
     [A[0]], [*A[0][:-3], 5, 5, 5], None),
    ("... nor one a few tokens longer", [A[0]], [*A[0][:-3], 5, 5, 5, 6, 6], None),
]


@pytest.mark.parametrize(("case", "known", "prompt", "expected"), LOOKUPS,
                         ids=[c[0] for c in LOOKUPS])
def test_previous_turn(case: str, known: list[list[int]], prompt: list[int],
                       expected: int | None) -> None:
    conv = Conversations(max_entries=10)
    for i, tokens in enumerate(known):
        conv.add(tokens, B, _chain(tokens), f"e{i}", 100.0, 0.0, 1000.0, None)
    turn = conv.previous(prompt, B, _chain(prompt))
    assert (None if turn is None else int(turn.engine[1:])) == expected
    assert conv.found == (0 if expected is None else 1)


def test_bounded_and_lookback_limited() -> None:
    conv = Conversations(max_entries=2, max_lookback=3)
    for tokens in (A[0], OTHER[0], ALIGNED[0]):
        conv.add(tokens, B, _chain(tokens), "e0", 1.0, 0.0, 1000.0, None)
    assert (len(conv), conv.evicted) == (2, 1)
    assert conv.previous(A[1], B, _chain(A[1])) is None  # A[0] was the least recent: gone
    assert conv.previous(ALIGNED[1], B, _chain(ALIGNED[1])) is not None  # 3 blocks back
    longer = ALIGNED[0] + list(range(4 * B))
    assert conv.previous(longer, B, _chain(longer)) is None  # 4 blocks back: past the limit


def test_own_insertions_carry_over_on_the_same_engine_only() -> None:
    conv = Conversations(max_entries=10)
    conv.add(A[0], B, _chain(A[0]), "e0", 1000.0, 1000.0, 1000.0, None)
    first = conv.previous(A[1], B, _chain(A[1]))
    conv.add(A[1], B, _chain(A[1]), "e0", 500.0, 2000.0, 1000.0, first)  # one half-life later
    second = conv.previous(A[2], B, _chain(A[2]))
    assert second is not None
    assert conv.own_pressure(second, 2000.0, 1000.0, 10_000) == pytest.approx(0.1)
    conv.add(A[2], B, _chain(A[2]), "e1", 300.0, 2000.0, 1000.0, second)  # moved: afresh
    nxt = A[2] + list(range(1, 21))  # a reply and a message
    third = conv.previous(nxt, B, _chain(nxt))
    assert third is not None and (third.engine, third.inserted) == ("e1", 300.0)
    conv.forget_engine("e1")
    assert len(conv) == 0  # A[0] and A[1] were continued: each is remembered until then


def test_a_remembered_prompt_is_continued_once() -> None:
    """Two sessions that both extend one remembered prompt (it holds only what they share):
    the first is taken for its conversation, the second is a new one."""
    conv = Conversations(max_entries=10)
    conv.add(A[0], B, _chain(A[0]), "e0", 1.0, 0.0, 1000.0, None)
    first = conv.previous(A[1], B, _chain(A[1]))
    assert first is not None
    conv.add(A[1], B, _chain(A[1]), "e0", 1.0, 0.0, 1000.0, first)
    fork = [*A[0], *range(70_000, 70_100)]
    assert conv.previous(fork, B, _chain(fork)) is None


def _run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(coro)


def _state(tokens: list[int], held: dict[str, int]) -> CycleState:
    state = CycleState()
    state.put(TOKEN_IDS, tuple(tokens))
    state.put(PREFIX_MATCH, PrefixMatch(len(tokens), held, {}, True))
    state.put(PROMPT_CHAIN, (B, _chain(tokens)))
    return state


def _dispatch(s: KvPlacementScorer, tokens: list[int], held: dict[str, int],
              target: str) -> None:
    state = _state(tokens, held)
    s.score(req(body={"max_tokens": 0}), state, [ep("e0"), ep("e1")])
    _run(s.before_dispatch(req(body={"max_tokens": 0}), state,
                           RoutingDecision(target=ep(target))))


def _best(s: KvPlacementScorer, tokens: list[int], held: dict[str, int]) -> str:
    scores = s.score(req(), _state(tokens, held), [ep("e0"), ep("e1")])
    return max(scores, key=lambda e: scores[e])


def test_a_conversation_without_headers_is_not_pushed_off_by_its_own_growth() -> None:
    """The header-less twin of test_placement's own-growth case: a conversation alone on e0
    grows it by 3,000 tokens a turn; its next turn stays, while a new session sharing only
    the system prompt (nothing of its own anywhere) goes to the idle engine."""
    s = KvPlacementScorer("kv-placement-scorer", KvPlacementScorer.Params(
        default_capacity_tokens=10_000, pin_tokens=0), Lookup())
    turns = _turns(3000, 3000, 3000, 800)
    for k, tokens in enumerate(turns[:-1]):
        _dispatch(s, tokens, {"e0": len(turns[k - 1]) if k else 0, "e1": 0}, "e0")
    held = {"e0": len(turns[-2]), "e1": 0}
    assert _best(s, turns[-1], held) == "e0"
    assert s.conversations.found == 3
    stranger = SYSTEM + list(range(70_000, 70_800))
    assert _best(s, stranger, {"e0": len(SYSTEM), "e1": 0}) == "e1"
    text = generate_latest(_registry(s)).decode()
    assert "kvgate_placement_conversation_turns_found_total 3.0" in text
    assert "kvgate_placement_conversations 1.0" in text  # each turn replaces the last


def _registry(s: KvPlacementScorer) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(s.collector())
    return registry
