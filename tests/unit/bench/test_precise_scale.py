"""bench/precise_scale.py: seeded growing conversations, and the added-latency arithmetic."""

from __future__ import annotations

import itertools
import json

from bench import precise_scale


def _opts(*argv: str) -> precise_scale.Options:
    return precise_scale.parse_options(["--sessions", "3", "--max-tokens", "6000", *argv])


def test_conversations_are_seeded_and_grow_by_whole_turns() -> None:
    opts = _opts()
    first, again = precise_scale.conversations(opts), precise_scale.conversations(opts)
    bodies = [[c.next_body(opts) for _ in range(4)] for c in first]
    assert bodies == [[c.next_body(opts) for _ in range(4)] for c in again]
    for turns in bodies:
        for before, after in itertools.pairwise(turns):
            assert after.startswith(before[:-2])  # the previous messages, then new ones
        msgs = json.loads(turns[-1])["messages"]
        assert [m["role"] for m in msgs] == ["system", "user"] + ["assistant", "user"] * 3
    systems = {json.loads(t[0])["messages"][0]["content"] for t in bodies}
    assert len(systems) == 1  # one shared system prompt, as agents have
    assert len({t[0] for t in bodies}) == 3  # but each session its own text
    assert precise_scale.turns_per_session(opts) == (6000 - 2000) // 400


def test_added_latency_by_percentiles_and_by_pairs() -> None:
    direct = {"p50_ms": 1.0, "p99_ms": 2.0, "latency": {"0/0": 1.0, "0/1": 2.0}}
    system = {"p50_ms": 4.0, "p99_ms": 9.0, "latency": {"0/0": 3.0, "0/1": 9.0, "1/0": 5.0}}
    added = precise_scale.added(system, direct)
    assert (added["added_p50_ms"], added["added_p99_ms"]) == (3.0, 7.0)
    assert (added["paired_p50_ms"], added["paired_p99_ms"]) == (2.0, 7.0)  # of 2.0 and 7.0
    assert precise_scale.added(system, None)["added_p99_ms"] is None
