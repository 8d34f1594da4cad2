"""The record-chain memo (plugins/prefix/record_chains.py): always the chain record_hash computes,
reusing a recent prompt's blocks where they agree, bounded in bytes."""

from __future__ import annotations

import random
from array import array

import pytest

from kvgate.plugins.prefix import record_hash
from kvgate.plugins.prefix.index import hashing as kv_hashing
from kvgate.plugins.prefix.index.hashing import HashingError
from kvgate.plugins.prefix.record_chains import EVENTS, RECORD, ChainHash, ChainMemo


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(2**32) for _ in range(n)]


def _edit(rng: random.Random, base: list[int], how: str) -> list[int]:
    """A next prompt made from ``base``: a session's next turn, a repeat, an edit, ..."""
    if how == "extend":
        return base + _ids(rng, rng.randrange(1, 500))
    if how == "repeat":
        return list(base)
    if how == "edit-middle":
        out = list(base)
        out[len(out) // 2] ^= 1
        return out
    if how == "shorter":
        return base[: len(base) * 2 // 3]
    if how == "new-after-first-block":
        return base[:64] + _ids(rng, 3000)
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["extend", "repeat", "edit-middle", "shorter",
                                 "new-after-first-block"])
@pytest.mark.parametrize("block_size", [64, 63, 16])
@pytest.mark.parametrize("as_array", [False, True])
@pytest.mark.parametrize("blocks", [120, 6])  # past the vectorised threshold; a 1 KiB chat's
def test_same_chain_as_hashing_whole(how: str, block_size: int, as_array: bool,
                                     blocks: int) -> None:
    rng = random.Random(f"{how}-{block_size}-{blocks}")
    memo = ChainMemo()
    scope = ("lora", None, "t1")
    prompt = _ids(rng, 64 * blocks + 5)
    for _turn in range(4):
        ids = array("I", prompt) if as_array else prompt
        got = memo.chain(ids, block_size, group_idx=1, scope=scope)
        assert got == record_hash.chain(ids, block_size, group_idx=1, scope=scope)
        prompt = _edit(rng, prompt, how)
    assert memo.stats.hits == 3 and memo.stats.misses == 1
    if how in ("extend", "repeat"):
        assert memo.stats.reused_blocks >= 3 * (len(prompt) // block_size) // 2


@pytest.mark.parametrize("bad", [-1, 2**32])
def test_ids_out_of_range_are_refused(bad: int) -> None:
    memo = ChainMemo()
    with pytest.raises(HashingError):
        memo.chain([1] * 64 + [bad] + [2] * 63, 64)
    assert len(memo) == 0


def test_scopes_and_block_sizes_never_share() -> None:
    rng = random.Random(3)
    prompt = _ids(rng, 64 * 10)
    memo = ChainMemo()
    for scope, size in [(("a",), 64), (("b",), 64), (("a",), 32)]:
        assert memo.chain(prompt, size, scope=scope) == record_hash.chain(prompt, size,
                                                                          scope=scope)
    assert memo.stats.hits == 0 and len(memo) == 3


@pytest.mark.parametrize("n", [0, 10, 63])
def test_short_prompts_are_not_kept(n: int) -> None:
    memo = ChainMemo()
    assert memo.chain(list(range(n)), 64) == []
    assert len(memo) == 0


def test_bounded_in_bytes_least_recent_out() -> None:
    rng = random.Random(5)
    memo = ChainMemo(max_bytes=200_000)  # each prompt below: 64 * 100 ids, ~27 KB
    prompts = [_ids(rng, 64 * 100) for _ in range(20)]
    for p in prompts:
        memo.chain(p, 64)
    assert memo.bytes <= 200_000 and memo.stats.evicted > 0
    memo.chain(prompts[-1], 64)  # the most recent is still there
    assert memo.stats.hits == 1
    memo.chain(prompts[0], 64)  # the oldest went first
    assert memo.stats.hits == 1


def test_returned_chain_is_the_callers() -> None:
    memo = ChainMemo()
    prompt = list(range(64 * 5))
    first = memo.chain(prompt, 64)
    first.clear()
    assert memo.chain(prompt, 64) == record_hash.chain(prompt, 64)


def _event_chain(ids: list[int] | array[int], size: int, group: int,
                 scope: tuple[str | None, ...]) -> list[int]:
    lora, salt = scope
    extra = kv_hashing.request_extra_keys(len(ids) // size, lora, salt)
    return kv_hashing.chain_hashes(ids, size, group_idx=group, extra_keys=extra)


@pytest.mark.parametrize("how", ["extend", "repeat", "edit-middle", "shorter",
                                 "new-after-first-block"])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("scope", [(None, None), ("adapter", None), (None, "salt"),
                                   ("adapter", "salt")])
def test_event_chain_same_as_hashing_whole(how: str, block_size: int,
                                           scope: tuple[str | None, str | None]) -> None:
    """The KV-event index's chain (vLLM's extra keys: the adapter on every block, the salt on
    the first) continued from a remembered prompt equals hashing the whole prompt."""
    rng = random.Random(f"events-{how}-{block_size}-{scope}")
    memo = ChainMemo(hasher=EVENTS)
    prompt = _ids(rng, 64 * 150 + 7)
    for _turn in range(4):
        got = memo.chain(array("I", prompt), block_size, group_idx=2, scope=scope)
        assert got == _event_chain(prompt, block_size, 2, scope)
        prompt = _edit(rng, prompt, how)
    assert memo.stats.hits == 3 and memo.stats.misses == 1


@pytest.mark.parametrize("retokenized", [0, 3])
@pytest.mark.parametrize("hasher", [RECORD, EVENTS], ids=["record", "events"])
def test_sessions_sharing_a_first_block_each_continue_their_own(hasher: ChainHash,
                                                                retokenized: int) -> None:
    """Agent sessions start with one system prompt: each turn is found by its previous turn's
    last blocks (not the shared first block's single slot), hashes only its new blocks, and
    supersedes that previous turn (one entry per session). ``retokenized``: the previous
    turn's last ids differ in the next (a chat's generation prompt tokenized again with the
    reply after it), which may change its last block."""
    rng = random.Random(11)
    system = _ids(rng, 64 * 30)
    sessions = [system + _ids(rng, 200) for _ in range(12)]
    memo = ChainMemo(hasher=hasher)
    hashed = 0
    for turn in range(6):
        for i, prompt in enumerate(sessions):
            kept = prompt[:len(prompt) - retokenized]
            sessions[i] = prompt = kept + _ids(rng, 300 + retokenized)
            before = memo.stats.hashed_blocks
            got = memo.chain(prompt, 16, scope=(None, None))
            want = (record_hash.chain(prompt, 16, scope=(None, None)) if hasher is RECORD
                    else _event_chain(prompt, 16, 0, (None, None)))
            assert got == want
            if turn:
                hashed = max(hashed, memo.stats.hashed_blocks - before)
    assert hashed <= 300 // 16 + 3  # only the turn's new blocks (and the partial ones before)
    assert len(memo) == len(sessions) and memo.stats.superseded == 5 * len(sessions)
