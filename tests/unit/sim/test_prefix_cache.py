"""Prefix cache: chained hashing, matching, reference counts, LRU eviction, capacity."""

from __future__ import annotations

import random

import pytest

from kvgate.engines.sim.core.prefix_cache import (
    CacheFull,
    PrefixCache,
    block_hashes,
    chain_hash,
    root_hash,
)

BS = 4


def _tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32_000) for _ in range(n)]


@pytest.mark.parametrize(("n", "blocks"), [(0, 0), (3, 0), (4, 1), (7, 1), (8, 2), (33, 8)])
def test_only_full_blocks_are_hashed(n: int, blocks: int) -> None:
    assert len(block_hashes(_tokens(n), BS)) == blocks


def test_hashes_are_chained_64_bit_and_deterministic() -> None:
    toks = _tokens(12)
    hashes = block_hashes(toks, BS)
    assert hashes == block_hashes(list(toks), BS)
    assert hashes[0] == chain_hash(root_hash(None), toks[:4])
    assert hashes[2] == chain_hash(hashes[1], toks[8:12])
    assert all(0 <= h < 2**64 for h in hashes)
    # Same block content under another prefix hashes differently.
    other = _tokens(4, seed=9) + toks[4:8]
    assert block_hashes(other, BS)[1] != hashes[1]


def test_incremental_hashing_matches_full() -> None:
    toks = _tokens(40)
    assert block_hashes(toks, BS, start=block_hashes(toks[:17], BS)) == block_hashes(toks, BS)


@pytest.mark.parametrize(("salt_a", "salt_b", "shared"), [
    (None, None, True), ("t1", "t1", True), ("t1", "t2", False), (None, "t1", False),
])
def test_salt_isolates(salt_a: str | None, salt_b: str | None, shared: bool) -> None:
    cache = PrefixCache(64, BS)
    toks = _tokens(16)
    cache.insert(toks, salt_a)
    assert (cache.match(toks, salt_b) == 16) is shared


@pytest.mark.parametrize(("query_len", "diverge_at", "expected"), [
    (16, None, 16), (15, None, 12), (20, None, 16), (16, 5, 4), (16, 0, 0), (3, None, 0),
])
def test_match_longest_cached_prefix(query_len: int, diverge_at: int | None, expected: int) -> None:
    cache = PrefixCache(64, BS)
    stored = _tokens(16)
    cache.insert(stored)
    query = (stored + _tokens(16, seed=3))[:query_len]
    if diverge_at is not None:
        query[diverge_at] = (query[diverge_at] + 1) % 32_000
    assert cache.match(query) == expected


def test_insert_reports_stored_and_evicted() -> None:
    cache = PrefixCache(4, BS)
    first = cache.insert(_tokens(12, seed=1))
    assert len(first.stored) == 3 and first.removed == []
    again = cache.insert(_tokens(12, seed=1))
    assert again.stored == [] and again.removed == []
    second = cache.insert(_tokens(8, seed=2))
    assert len(second.stored) == 2
    # One block short: the oldest chain loses its tail block first.
    assert second.removed == [first.stored[-1]]
    assert len(cache) == 4
    assert cache.match(_tokens(12, seed=1)) == 8


def test_release_orders_tail_first() -> None:
    cache = PrefixCache(8, BS)
    hashes = block_hashes(_tokens(12), BS)
    cache.allocate(3)
    for h in hashes:
        cache.commit(h)
    cache.release(hashes, 0)
    assert list(cache.evictable_order()) == list(reversed(hashes))


def test_blocks_in_use_are_never_evicted() -> None:
    cache = PrefixCache(3, BS)
    hashes = block_hashes(_tokens(8), BS)
    cache.allocate(2)
    for h in hashes:
        cache.commit(h)  # referenced by a running sequence
    assert cache.used_blocks == 2 and cache.free_blocks == 1
    with pytest.raises(CacheFull):
        cache.allocate(2)
    assert cache.allocate(1) == []
    cache.release(hashes, 1)
    assert cache.used_blocks == 0 and cache.usage == 0.0
    assert sorted(cache.allocate(3)) == sorted(hashes)  # now both evictable, both evicted


def test_acquire_pins_and_lru_refresh() -> None:
    cache = PrefixCache(4, BS)
    a = cache.insert(_tokens(8, seed=1)).stored
    b = cache.insert(_tokens(8, seed=2)).stored
    cache.acquire(a)  # a running sequence reuses prompt a
    assert cache.allocate(2) == list(reversed(b))
    assert cache.match(_tokens(8, seed=1)) == 8


def test_duplicate_commit_shares_the_block() -> None:
    cache = PrefixCache(4, BS)
    h = block_hashes(_tokens(4), BS)[0]
    cache.allocate(2)
    assert cache.commit(h) is True
    assert cache.commit(h) is False  # a second sequence computed the same block
    assert len(cache) == 1 and cache.used_blocks == 1
    cache.release([h], 0)
    assert cache.used_blocks == 1
    cache.release([h], 0)
    assert cache.used_blocks == 0 and list(cache.evictable_order()) == [h]


@pytest.mark.parametrize(("capacity", "prompts"), [(8, 20), (16, 50), (5, 7)])
def test_capacity_is_never_exceeded(capacity: int, prompts: int) -> None:
    cache = PrefixCache(capacity, BS)
    rng = random.Random(capacity)
    for i in range(prompts):
        cache.insert(_tokens(rng.randrange(4, capacity * BS + 1), seed=i))
        assert len(cache) <= capacity
        assert cache.used_blocks == 0


def test_clear_refuses_while_in_use() -> None:
    cache = PrefixCache(4, BS)
    cache.allocate(1)
    assert cache.clear() is False
    cache.release([], 1)
    cache.insert(_tokens(8))
    assert cache.clear() is True and len(cache) == 0
