"""The gateway record's vectorised block hash (plugins/prefix/record_hash.py): the same integers as the
plain-Python statement of the algorithm, prefix-stable, scoped, and refusing what it cannot
hash."""

from __future__ import annotations

import random
from array import array
from collections.abc import Sequence

import pytest

from kvgate.plugins.prefix import record_hash
from kvgate.plugins.prefix.index.hashing import HashingError


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2**32) for _ in range(n)]


@pytest.mark.parametrize(("n", "block_size"), [
    (0, 64), (63, 64), (64, 64), (65, 64), (64 * 63, 64), (64 * 64, 64),  # Python / numpy
    (64 * 300 + 7, 64), (101 * 63, 63),  # 300 and 101 blocks: the cumsum path
    (10, 1), (100, 3), (96, 16), (1000, 128), (5, 2),
])
@pytest.mark.parametrize("as_array", [False, True])
def test_vectorised_equals_the_reference(n: int, block_size: int, as_array: bool) -> None:
    ids: Sequence[int] = _ids(n * 7 + block_size, n)
    if as_array:
        ids = array("I", ids)
    got = record_hash.chain(ids, block_size, group_idx=1, scope=("lora", None, "t1"))
    assert got == record_hash.reference_chain(ids, block_size, group_idx=1,
                                              scope=("lora", None, "t1"))
    assert len(got) == n // block_size
    assert all(0 <= h < 2**64 for h in got)


@pytest.mark.parametrize("block_size", [1, 16, 63, 64])
def test_equal_prefixes_give_equal_leading_hashes(block_size: int) -> None:
    shared = _ids(1, block_size * 20)
    a = record_hash.chain(array("I", shared + _ids(2, block_size * 5)), block_size)
    b = record_hash.chain(shared + _ids(3, block_size * 9 + 1), block_size)
    assert a[:20] == b[:20]
    assert all(x != y for x, y in zip(a[20:], b[20:], strict=False))


def test_one_changed_token_changes_its_block_and_every_later_one() -> None:
    base = _ids(4, 64 * 10)
    ref = record_hash.chain(base, 64)
    for pos in (0, 1, 63, 64, 300, 639):
        changed = list(base)
        changed[pos] ^= 1
        got = record_hash.chain(changed, 64)
        first = pos // 64
        assert got[:first] == ref[:first]
        assert all(x != y for x, y in zip(got[first:], ref[first:], strict=True))


def test_word_order_within_a_block_matters() -> None:
    block = _ids(5, 64)
    swapped = block[2:4] + block[0:2] + block[4:]  # two 64-bit words exchanged
    assert record_hash.chain(block, 64) != record_hash.chain(swapped, 64)


@pytest.mark.parametrize(("scope_a", "scope_b", "group_a", "group_b"), [
    (("lora", None, None), (None, None, None), 0, 0),
    ((None, "salt", None), (None, None, None), 0, 0),
    ((None, None, "tenant-a"), (None, None, "tenant-b"), 0, 0),
    ((None, "x", None), (None, None, "x"), 0, 0),  # the same string in another role
    ((None, None, None), (None, None, None), 0, 1),
])
def test_scopes_and_groups_separate_chains(
    scope_a: tuple[str | None, ...], scope_b: tuple[str | None, ...], group_a: int, group_b: int,
) -> None:
    ids = _ids(6, 256)
    a = record_hash.chain(ids, 64, group_idx=group_a, scope=scope_a)
    b = record_hash.chain(ids, 64, group_idx=group_b, scope=scope_b)
    assert not set(a) & set(b)


def test_distinct_prompts_do_not_collide() -> None:
    seen: set[int] = set()
    for seed in range(200):
        hashes = record_hash.chain(_ids(1000 + seed, 64 * 8), 64)
        assert not seen & set(hashes)
        seen.update(hashes)
    assert len(seen) == 200 * 8


@pytest.mark.parametrize("bad", [[-1] * 64, [2**32] * 64, [2**70] * 64, ["a"] * 64])
def test_ids_outside_uint32_are_refused(bad: list[object]) -> None:
    with pytest.raises(HashingError):
        record_hash.chain(bad, 64)  # type: ignore[arg-type]


def test_a_non_positive_block_size_is_refused() -> None:
    with pytest.raises(HashingError):
        record_hash.chain([1, 2, 3], 0)
