"""The prefix-closed index (the gateway's own record): binary-search match and the record's
refresh-only fast path give what the plain per-block walk gives, under eviction and expiry."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from kvgate.plugins.prefix.dispatch_state import RECORD_EXPIRY_STEP_S, record_expiry
from kvgate.plugins.prefix.index.index import DEVICE, LEARNED, KvIndex

BS = 64


def _chains(rng: random.Random, roots: int, length: int) -> list[list[int]]:
    """Chains sharing prefixes: each extends a random prefix of an earlier one or a new root."""
    chains: list[list[int]] = []
    for _ in range(roots * 4):
        if chains and rng.random() < 0.75:
            base = rng.choice(chains)
            prefix = base[: rng.randint(1, len(base))]
        else:
            prefix = []
        tail = [rng.getrandbits(63) for _ in range(rng.randint(1, length))]
        chains.append(prefix + tail)
    return chains


def _linear_match(index: KvIndex, holder: str, hashes: list[int], now: float) -> int:
    """The longest held, unexpired prefix, block by block (the reference)."""
    blocks = index._holders[holder].blocks if holder in index.holders() else {}
    run = 0
    for h in hashes:
        hold = blocks.get(h)
        if hold is None or hold.expires <= now:
            break
        run += 1
    return run


def _state(index: KvIndex, holder: str) -> list[tuple[int, float, int]]:
    return [(h, hold.expires, hold.tiers) for h, hold in index._holders[holder].blocks.items()]


@pytest.mark.parametrize(("seed", "capacity", "ttl"), [
    (1, 10_000, 1e9),   # no eviction, no expiry
    (2, 120, 1e9),      # LRU eviction under pressure
    (3, 120, 30.0),     # eviction and expiry together
    (4, 40, 5.0),       # tiny capacity, short lives
])
def test_binary_search_matches_the_linear_walk(seed: int, capacity: int, ttl: float) -> None:
    rng = random.Random(seed)
    chains = _chains(rng, roots=6, length=12)
    index = KvIndex(capacity, default_block_size=BS, prefix_closed=True)
    now = 0.0
    for _ in range(600):
        now += rng.random() * 3
        chain = rng.choice(chains)
        holder = rng.choice(("e0", "e1"))
        if rng.random() < 0.5:
            index.record(holder, chain, record_expiry(now, ttl), block_size=BS,
                         learned=rng.random() < 0.1)
        probe = rng.choice(chains)
        expected = {h: _linear_match(index, h, probe, now) for h in index.holders()}
        got = index.match({BS: probe}, now)
        assert got == {h: (n * BS, 0) for h, n in expected.items() if n}
    assert index.stats.evicted_blocks > 0 or capacity == 10_000


@pytest.mark.parametrize(("seed", "step"), [(5, 1.0), (6, 0.25), (7, 7.0)])
def test_record_fast_path_leaves_what_the_walk_leaves(seed: int, step: float) -> None:
    """Same records (repeats, extensions, shared prefixes, learned or not, stale expiries) on a
    prefix-closed index and a plain one: same blocks, LRU order, expiries and tiers."""
    rng = random.Random(seed)
    chains = _chains(rng, roots=5, length=10)
    closed = KvIndex(150, default_block_size=BS, prefix_closed=True)
    plain = KvIndex(150, default_block_size=BS)
    now = 0.0
    for _ in range(800):
        now += rng.random() * step
        expires = now + 60.0 - rng.random() * 30.0 if rng.random() < 0.1 else now + 60.0
        expires = float(int(expires / step) * step + step)
        chain = rng.choice(chains)
        learned = rng.random() < 0.1
        for index in (closed, plain):
            index.record("e0", chain, expires, block_size=BS, learned=learned)
        assert _state(closed, "e0") == _state(plain, "e0")
    assert len(closed) == len(plain)


def test_match_does_not_refresh_and_drops_the_expired_boundary_block() -> None:
    index = KvIndex(1000, default_block_size=BS, prefix_closed=True)
    old, new = [1, 2, 3], [4, 5]
    index.record("e0", old, 100.0, block_size=BS)
    index.record("e0", new, 100.0, block_size=BS)
    assert index.match({BS: old}, 0.0) == {"e0": (3 * BS, 0)}
    assert list(index._holders["e0"].blocks) == [3, 2, 1, 5, 4]  # order unchanged
    index.record("e0", [1], 200.0, block_size=BS)  # root outlives its children
    assert index.match({BS: old}, 150.0) == {"e0": (BS, 0)}
    assert 2 not in index._holders["e0"].blocks and index.stats.expired_blocks == 1


EVENT_UPDATES: list[tuple[str, Callable[[KvIndex], object]]] = [
    ("store", lambda index: index.store("e0", [1], None, list(range(BS)), BS)),
    ("remove", lambda index: index.remove("e0", [1])),
    ("forget_records", lambda index: index.forget_records("e0", [1], 0.0)),
]


@pytest.mark.parametrize(("name", "call"), EVENT_UPDATES)
def test_event_updates_are_refused(name: str, call: Callable[[KvIndex], object]) -> None:
    index = KvIndex(1000, default_block_size=BS, prefix_closed=True)
    with pytest.raises(TypeError, match="record"):
        call(index)


@pytest.mark.parametrize(("now", "ttl", "expected"), [
    (0.0, 600.0, 600.0), (0.2, 600.0, 601.0), (99.99, 0.5, 101.0), (5.0, 1.0, 6.0),
])
def test_record_expiry_rounds_up_to_the_step(now: float, ttl: float, expected: float) -> None:
    assert RECORD_EXPIRY_STEP_S == 1.0
    assert record_expiry(now, ttl) == expected
    assert now + ttl <= record_expiry(now, ttl) < now + ttl + RECORD_EXPIRY_STEP_S


def test_learned_records_keep_their_bit_on_the_fast_path() -> None:
    index = KvIndex(1000, default_block_size=BS, prefix_closed=True)
    index.record("e0", [1, 2], 50.0, block_size=BS, learned=True)
    index.record("e0", [1, 2], 50.0, block_size=BS)  # fast path: nothing but the order
    assert [hold.tiers for hold in index._holders["e0"].blocks.values()] == [
        DEVICE | LEARNED, DEVICE | LEARNED]


A, B, LONG = [1, 2, 3], [1, 2, 9], [20, 21, 22, 23, 24, 25]


@pytest.mark.parametrize(("name", "records"), [
    ("repeat", [A, A, A]),
    ("repeat after a sibling", [A, B, A]),
    ("repeat after its prefix", [A, A[:1], A]),
    ("repeat after the chain overflowed its holder", [LONG, LONG, A, LONG]),
    ("repeat after another chain evicted part of it", [A, LONG, A, A]),
])
def test_repeated_record_order_is_the_walks(name: str, records: list[list[int]]) -> None:
    """The refresh skipped for a chain the last record left at the LRU end gives the same
    order, expiries and evictions as the block-by-block walk."""
    closed = KvIndex(100, holder_capacity_blocks=5, default_block_size=BS, prefix_closed=True)
    plain = KvIndex(100, holder_capacity_blocks=5, default_block_size=BS)
    for chain in records:
        for index in (closed, plain):
            index.record("e0", chain, 10.0, block_size=BS)
        assert _state(closed, "e0") == _state(plain, "e0"), name
