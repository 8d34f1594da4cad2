"""The agentic workload (bench/agentic.py): seeded, within the engines' context, agent-shaped."""

from __future__ import annotations

from typing import Any

import pytest

from bench import agentic
from bench.agentic_client import Record, Runner, _Stream, finish, read_event


def count(text: str) -> int:
    """A stand-in tokenizer: one token per 4 characters (rounded up)."""
    return -(-len(text) // 4)


def _estimate(workload: agentic.Workload, agent: agentic.Agent) -> int:
    """Largest estimated prompt of ``agent``'s turns, as the planner counts it."""
    size = count(workload.shared_prompt) + agentic.MESSAGE_OVERHEAD + 1
    for turn in agent.turns:
        size += turn.user_tokens + turn.max_tokens * agentic.ANSWER_ESTIMATE \
            + 2 * agentic.MESSAGE_OVERHEAD
        if turn.spawn is not None:
            size += turn.spawn.turns[-1].max_tokens * agentic.ANSWER_ESTIMATE \
                + agentic.MESSAGE_OVERHEAD
    return size


@pytest.mark.parametrize("level", sorted(agentic.LEVELS))
def test_same_seed_same_workload_other_seed_other(level: str) -> None:
    first, again = agentic.build(7, level, count), agentic.build(7, level, count)
    other = agentic.build(8, level, count)
    assert first == again
    assert first.agents != other.agents
    assert first.shared_prompt != other.shared_prompt


def test_levels_share_prompts_and_differ_in_concurrency() -> None:
    low, high = agentic.build(0, "low", count), agentic.build(0, "high", count)
    assert low.shared_prompt == high.shared_prompt and low.sub_prompts == high.sub_prompts
    assert low.slots < high.slots
    assert len(low.agents) == agentic.LEVELS["low"].agents
    assert len(high.agents) == agentic.LEVELS["high"].agents


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_prompt_stays_within_the_budget(seed: int) -> None:
    workload = agentic.build(seed, "high", count)
    for agent in workload.agents:
        assert 1 <= len(agent.turns) <= agentic.TURNS[1]
        assert _estimate(workload, agent) <= agentic.PROMPT_BUDGET
        assert agent.turns[-1].spawn is None  # a last sub-agent would have no one to report to


def test_agent_shape() -> None:
    workload = agentic.build(0, "high", count)
    shared = count(workload.shared_prompt)
    assert 0.9 * agentic.SHARED_PROMPT_TOKENS <= shared <= 1.2 * agentic.SHARED_PROMPT_TOKENS
    turns = [t for a in workload.agents for t in a.turns]
    low, high = agentic.TOOL_RESULT_TOKENS
    assert all(agentic.ANSWER_TOKENS[0] <= t.max_tokens <= agentic.ANSWER_TOKENS[1]
               for t in turns)
    assert all(t.user_tokens <= high + 40 for t in turns)  # a line past the target at most
    assert all(0 <= t.think_s <= agentic.THINK_CAP_S for t in turns)
    subs = [t.spawn for t in turns if t.spawn is not None]
    assert subs, "the workload has sub-agents"
    assert {s.kind for s in subs} == set(range(agentic.SUB_KINDS))
    assert all(1 <= len(s.turns) <= agentic.SUB_TURNS[1] for s in subs)
    assert len({s.sid for s in subs}) == len(subs)
    assert workload.requests() == len(turns) + sum(len(s.turns) for s in subs)
    assert low < high


def test_stream_events_fold_into_a_record() -> None:
    stream = _Stream()
    events: list[dict[str, Any]] = [
        {"prompt_token_ids": [1, 2, 3], "choices": [{"delta": {"role": "assistant",
                                                              "content": ""}}]},
        {"choices": [{"delta": {"content": "def"}, "token_ids": [7]}]},
        {"choices": [{"delta": {"content": " x"}, "token_ids": [8, 9]}]},
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3,
                                  "prompt_tokens_details": {"cached_tokens": 0}}},
    ]
    for event in events:
        read_event(event, stream)
    record = Record(0, "agent-0", None, 0, 0.0)
    finish(record, stream)
    assert record.prompt_ids == (1, 2, 3) and record.output_ids == (7, 8, 9)
    assert record.answer == "def x" and record.cached_tokens == 0 and record.error is None


def test_missing_usage_is_an_error() -> None:
    record = Record(0, "agent-0", None, 0, 0.0)
    finish(record, _Stream())
    assert record.error is not None and record.cached_tokens is None


@pytest.mark.parametrize(("sessions", "parent", "expected"), [
    (True, None, {"x-session-affinity": "a", "x-session-id": "a"}),
    (True, "p", {"x-session-affinity": "a", "x-session-id": "a", "x-parent-session-id": "p"}),
    (False, "p", {}),
])
def test_session_headers(sessions: bool, parent: str | None, expected: dict[str, str]) -> None:
    runner = Runner("http://x", agentic.build(0, "low", count), "m", "salt", sessions=sessions)
    headers = runner.headers("a", parent)
    assert headers == {"content-type": "application/json", **expected}
