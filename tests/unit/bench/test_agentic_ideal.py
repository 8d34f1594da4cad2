"""Ideal cached tokens and the live working set (bench/agentic_ideal.py) on hand-made tables.

Blocks of 4 tokens keep the tables readable; the engines' block is 128."""

from __future__ import annotations

import pytest

from bench.agentic_client import Record
from bench.agentic_ideal import (
    WorkingSet,
    chain,
    computed,
    ideal_cached,
    live_working_set,
    summarize,
)

B = 4
BASE = tuple(range(1, 11))  # 10 tokens: 2 full blocks and a partial one


def rec(index: int, sid: str, sent: float, done: float | None, prompt: tuple[int, ...],
        output: tuple[int, ...] = (100, 101, 102), status: int = 200,
        cached: int | None = 0) -> Record:
    return Record(index, sid, None, 0, sent, done, status, None, 0.01, len(prompt), cached,
                  prompt, output, "engine-0")


def test_chain_names_prefixes_of_full_blocks() -> None:
    a, b = chain((1, 2, 3, 4, 5, 6, 7, 8, 9), B), chain((1, 2, 3, 4, 5, 6, 7, 0), B)
    assert len(a) == 2 and len(b) == 2  # the partial third block is not cached
    assert a[0] == b[0] and a[1] != b[1]
    assert chain((5, 6, 7, 8), B)[0] != a[1]  # a block's key depends on its prefix


def test_computed_is_prompt_and_output_but_the_last_token() -> None:
    assert computed(rec(0, "s", 0, 1, (1, 2), (3, 4, 5))) == (1, 2, 3, 4)


# (index, sent, done, prompt, status, expected ideal, why)
TABLE = [
    (0, 0.0, 1.0, BASE, 200, 0, "first request: nothing cached"),
    (1, 0.5, 1.5, (*BASE, 11, 12), 200, 0, "sent before request 0 completed"),
    # request 0 computed BASE + (100, 101): 12 tokens = 3 full blocks
    (2, 2.0, 3.0, (*BASE, 100, 101, 7, 7, 7), 200, 12,
     "extends request 0's prompt and answer: 3 blocks"),
    (3, 3.5, 4.0, BASE[:8], 200, 4,
     "a fully cached 2-block prompt recomputes its last token: capped at 1 block"),
    (4, 4.0, 5.0, (9, *BASE[1:]), 200, 0, "differs in the first block"),
    (5, 5.0, None, (*BASE, 11, 12, 13, 14), 502, 0, "failed: no ideal"),
    # request 1 computed BASE + (11, 12, 100, 101): its 3rd block is (9, 10, 11, 12)
    (6, 6.0, 7.0, (*BASE, 11, 12, 13, 14, 15, 16, 17), 200, 12,
     "request 1's prompt (3 blocks) is cached; the failed request 5 added nothing"),
]


def test_ideal_on_a_hand_made_table() -> None:
    records = [rec(i, f"s{i}", sent, done, prompt, status=status)
               for i, sent, done, prompt, status, _, _ in TABLE]
    expected = [row[5] for row in TABLE]
    assert ideal_cached(records, B) == expected


def test_completed_at_the_same_instant_counts() -> None:
    records = [rec(0, "a", 0.0, 1.0, BASE), rec(1, "a", 1.0, 2.0, (*BASE, 1))]
    assert ideal_cached(records, B) == [0, 8]


def test_working_set_partitioned_and_concentrated() -> None:
    shared = (1, 2, 3, 4)  # one block every session shares
    a = rec(0, "a", 0.0, 1.0, (*shared, 10, 11, 12, 13), (0,))
    b = rec(1, "b", 0.1, 1.1, (*shared, 20, 21, 22, 23), (0,))
    c = rec(2, "c", 0.2, 1.2, (*shared, 30, 31, 32, 33), (0,))
    later = [rec(3, "a", 2.0, 3.0, (*a.prompt_ids, 14)), rec(4, "b", 2.1, 3.1, b.prompt_ids),
             rec(5, "c", 2.2, 3.2, c.prompt_ids)]
    ws = live_working_set([a, b, c, *later], engines=2, block=B)
    # at t=2.0..2.2 every session is live with 2 blocks of which one is shared:
    # one engine holds 1 + 3 = 4 blocks; split a, c | b: 1 + 2 = 3 on the fuller engine
    # (the first three sends find nothing completed: 0, the lower half of the six samples)
    assert ws == WorkingSet(concentrated=(4, 4, 4), partitioned=(3, 3, 3))


def test_working_set_of_no_records() -> None:
    assert live_working_set([], block=B) == WorkingSet((0, 0, 0), (0, 0, 0))


def test_summary_share_and_engine_split() -> None:
    records = [rec(0, "a", 0.0, 1.0, BASE, cached=0),
               rec(1, "a", 2.0, 3.0, (*BASE, 100, 101, 5), cached=8),
               rec(2, "a", 4.0, None, BASE, status=500, cached=None)]
    engines = {"engine-0": {"requests": 2.0, "prefill_tokens": 15.0, "preemptions": 0.0},
               "engine-1": {"requests": 0.0, "prefill_tokens": 0.0, "preemptions": 0.0}}
    s = summarize("random", "low", "headers", records, engines, 3.0, block=B)
    assert (s.requests, s.failed, s.cached_tokens, s.ideal_tokens) == (3, 1, 8, 12)
    assert s.share_of_ideal == pytest.approx(8 / 12)
    assert s.prompt_tokens == 10 + 13
    assert s.engine_requests == {"engine-0": 2.0, "engine-1": 0.0}
    assert s.routed_by_header == {"engine-0": 2}
    assert s.ttft_p50_s == pytest.approx(0.01)
