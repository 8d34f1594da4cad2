"""Replay benchmark: trace parsing, deterministic token blocks, bodies, sessions, schedule."""

from __future__ import annotations

import json

import pytest

from bench.replay_trace import (
    TRACE_BLOCK,
    BlockCache,
    TraceError,
    TraceRequest,
    block_tokens,
    block_words,
    completion_body,
    infer_sessions,
    parse_line,
    parse_trace,
    prompt_json,
    prompt_tokens,
    send_offsets,
)
from kvgate.engines.sim.core.tokenizer import tokenize


def req(index: int, ids: list[int], length: int | None = None, ts: int = 0) -> TraceRequest:
    n = length if length is not None else len(ids) * TRACE_BLOCK
    return TraceRequest(index, ts, n, 10, tuple(ids))


@pytest.mark.parametrize(("line", "expected"), [
    ('{"timestamp": 5, "input_length": 600, "output_length": 3, "hash_ids": [7, 8]}',
     TraceRequest(0, 5, 600, 3, (7, 8))),
    ('{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]}',
     TraceRequest(0, 0, 512, 1, (1,))),
])
def test_parse_line(line: str, expected: TraceRequest) -> None:
    assert parse_line(line, 0) == expected


@pytest.mark.parametrize("line", [
    '{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [7]}',  # too few ids
    '{"timestamp": 0, "input_length": 100, "output_length": 3, "hash_ids": [7, 8]}',  # too many
    '{"timestamp": 0, "output_length": 3, "hash_ids": [7]}',  # missing field
    "not json",
])
def test_parse_line_rejects(line: str) -> None:
    with pytest.raises(TraceError):
        parse_line(line, 3)


def test_parse_trace_limit_and_blank_lines() -> None:
    line = '{"timestamp": %d, "input_length": 10, "output_length": 1, "hash_ids": [%d]}'
    lines = [line % (i, i) for i in range(5)]
    lines.insert(2, "   ")
    got = parse_trace(lines, limit=3)
    assert [r.hash_ids for r in got] == [(0,), (1,), (2,)]
    assert [r.index for r in got] == [0, 1, 2]


@pytest.mark.parametrize(("a", "b", "same"), [(1, 1, True), (1, 2, False), (0, 123_456, False)])
def test_block_tokens_deterministic(a: int, b: int, same: bool) -> None:
    first, second = block_tokens(a), block_tokens(b)
    assert len(first) == TRACE_BLOCK
    assert (first == second) is same
    assert block_tokens(a) == first  # repeatable
    assert block_tokens(a, salt=1) != first


def test_words_tokenize_to_the_block_tokens() -> None:
    for hash_id in (0, 5, 99_999):
        words = block_words(hash_id)
        assert tokenize("".join(words)) == block_tokens(hash_id)


@pytest.mark.parametrize(("ids", "length"), [([3], 1), ([3, 4], 600), ([3, 4, 5], 1536)])
def test_prompt_cut_to_input_length(ids: list[int], length: int) -> None:
    r = req(0, ids, length)
    tokens = prompt_tokens(r)
    assert len(tokens) == length
    assert tokens[:TRACE_BLOCK] == block_tokens(ids[0])[:length]
    cache = BlockCache(max_blocks=1)  # eviction must not change the result
    assert json.loads(prompt_json(r, cache)) == tokens
    assert tokenize(json.loads(prompt_json(r, cache, text=True))) == tokens


def test_shared_hash_ids_give_shared_prefix() -> None:
    a, b = prompt_tokens(req(0, [1, 2, 3])), prompt_tokens(req(1, [1, 2, 9]))
    assert a[: 2 * TRACE_BLOCK] == b[: 2 * TRACE_BLOCK]
    assert a[2 * TRACE_BLOCK:] != b[2 * TRACE_BLOCK:]


@pytest.mark.parametrize(("text", "output", "cap", "max_tokens"), [
    (False, 500, 32, 32), (True, 5, 32, 5), (False, 0, 32, 1),
])
def test_completion_body(text: bool, output: int, cap: int, max_tokens: int) -> None:
    r = TraceRequest(0, 0, 700, output, (1, 2))
    body = json.loads(completion_body(r, "m", cap, BlockCache(), text))
    assert body["max_tokens"] == max_tokens
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["model"] == "m"
    prompt = tokenize(body["prompt"]) if text else body["prompt"]
    assert prompt == prompt_tokens(r)


@pytest.mark.parametrize(("traces", "expected"), [
    # a request extending an earlier one's whole prompt continues its session
    ([[1, 2], [1, 2, 3], [1, 2, 3, 4]], [0, 0, 0]),
    # sharing only a prefix (not the whole earlier prompt) is a new session
    ([[1, 2, 3], [1, 2, 4]], [0, 1]),
    # a one-block earlier prompt (a shared system prompt) does not join sessions
    ([[0], [0, 5], [0, 6], [0, 5, 7]], [0, 1, 2, 1]),
    # a repeat joins; the longest extended prompt wins
    ([[1, 2], [3, 4], [1, 2], [3, 4, 5], [3, 4, 5, 6]], [0, 1, 0, 1, 1]),
    # branches of one conversation stay in it
    ([[1, 2], [1, 2, 3], [1, 2, 4]], [0, 0, 0]),
])
def test_infer_sessions(traces: list[list[int]], expected: list[int]) -> None:
    assert infer_sessions([req(i, ids) for i, ids in enumerate(traces)]) == expected


@pytest.mark.parametrize(("turns", "expected"), [
    # next turn: the earlier prompt's full blocks [1, 2], then a new block 9 where the earlier
    # partial block 3 was (the answer and new message changed its content)
    ([([1, 2, 3], 1100), ([1, 2, 9, 10], 1900)], [0, 0]),
    # the earlier prompt has fewer than 2 full blocks: no session to continue
    ([([1, 3], 700), ([1, 9, 10], 1400)], [0, 1]),
    # it differs inside the earlier prompt's full blocks: a new session
    ([([1, 2, 3], 1100), ([1, 4, 9], 1400)], [0, 1]),
])
def test_infer_sessions_ignores_partial_last_block(
    turns: list[tuple[list[int], int]], expected: list[int]
) -> None:
    reqs = [req(i, ids, length) for i, (ids, length) in enumerate(turns)]
    assert infer_sessions(reqs) == expected


def test_send_offsets_compress_time() -> None:
    reqs = [req(i, [i], ts=ts) for i, ts in enumerate([1000, 1000, 3000, 11_000])]
    assert send_offsets(reqs, 10.0) == [0.0, 0.0, 0.2, 1.0]
    assert send_offsets([], 10.0) == []
