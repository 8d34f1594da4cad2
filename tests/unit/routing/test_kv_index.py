"""The block index: own chained hash, store/match/remove, tiers, records with TTL, bounds."""

from __future__ import annotations

import random
from array import array

import pytest

from kvgate.plugins.prefix.index.index import (
    HashingError,
    KvIndex,
    chain_hashes,
    engine_of,
    holder_id,
    request_extra_keys,
)
from tests.unit.routing.helpers import blocks

BS = 4


def _index(capacity: int = 1000, per_holder: int | None = None) -> KvIndex:
    return KvIndex(capacity, per_holder, default_block_size=BS)


def _store_chain(index: KvIndex, holder: str, tokens: list[int], base: int = 100,
                 medium: str | None = "GPU", parent: int | None = None) -> list[int]:
    """Stores the full blocks of ``tokens`` as one event; engine hashes base, base+1, ..."""
    n = len(tokens) // BS
    ehashes = list(range(base, base + n))
    index.store(holder, ehashes, parent, tokens[: n * BS], BS, medium=medium)
    return ehashes


def _match(index: KvIndex, tokens: list[int], now: float = 0.0) -> dict[str, tuple[int, int]]:
    return index.match({BS: chain_hashes(tokens, BS)}, now)


def test_chain_hash_is_pinned_and_prefix_stable() -> None:
    """Replicas and restarts must agree: the value is fixed by the algorithm."""
    toks = list(range(12))
    hashes = chain_hashes(toks, BS)
    assert len(hashes) == 3
    assert chain_hashes(toks[:8], BS) == hashes[:2]
    assert chain_hashes([*toks, 1, 2], BS) == hashes  # partial block ignored
    assert chain_hashes(toks, BS) == hashes
    assert hashes[0] == PINNED_FIRST_BLOCK
    assert chain_hashes(toks[4:], BS, parent=hashes[0]) == hashes[1:]


#: kvgate-kv-v2 chain of the module docstring; changing the algorithm must change this test.
PINNED_FIRST_BLOCK = 2443308327168783513


HASH_VARIANTS = [
    ("other group", {"group_idx": 1}),
    ("lora extra key", {"extra_keys": [("adapter",)]}),
    ("salt extra key", {"extra_keys": [("salt",)]}),
]


@pytest.mark.parametrize(("case", "kwargs"), HASH_VARIANTS, ids=[c[0] for c in HASH_VARIANTS])
def test_scope_changes_every_hash(case: str, kwargs: dict[str, object]) -> None:
    toks = list(range(8))
    plain = chain_hashes(toks, BS)
    other = chain_hashes(toks, BS, **kwargs)  # type: ignore[arg-type]
    assert not set(plain) & set(other)


def test_request_extra_keys_follow_vllm_layout() -> None:
    assert request_extra_keys(3, None, None) == [None, None, None]
    assert request_extra_keys(2, "ad", None) == [("ad",), ("ad",)]
    assert request_extra_keys(2, None, "s") == [("s",), None]
    assert request_extra_keys(2, "ad", "s") == [("ad", "s"), ("ad",)]
    assert request_extra_keys(0, "ad", "s") == []


@pytest.mark.parametrize("bad", [[-1, 0, 0, 0], [2**32, 0, 0, 0]])
def test_unhashable_token_ids(bad: list[int]) -> None:
    with pytest.raises(HashingError):
        chain_hashes(bad, BS)


def test_holder_ids() -> None:
    assert holder_id("e0", 0) == holder_id("e0", None) == "e0"
    assert holder_id("e0", 3) == "e0#dp3"
    assert engine_of("e0#dp3") == engine_of("e0") == "e0"


MATCH_CASES = [
    # (case, stored blocks of the prompt on e0, prompt blocks, expected e0 match in blocks)
    ("full prefix", 3, 3, 3),
    ("longer prompt", 2, 5, 2),
    ("shorter prompt", 4, 2, 2),
    ("partial trailing block", 3, 3, 3),
]


@pytest.mark.parametrize(("case", "stored_blocks", "prompt_blocks", "want"), MATCH_CASES,
                         ids=[c[0] for c in MATCH_CASES])
def test_longest_prefix(case: str, stored_blocks: int, prompt_blocks: int, want: int) -> None:
    index = _index()
    toks = blocks(1, 6, BS)
    _store_chain(index, "e0", toks[: stored_blocks * BS])
    prompt = toks[: prompt_blocks * BS] + ([7] if "partial" in case else [])
    assert _match(index, prompt) == {"e0": (want * BS, 0)}


def test_divergent_prompt_matches_shared_prefix_only() -> None:
    index = _index()
    toks = blocks(1, 4, BS)
    _store_chain(index, "e0", toks)
    other = toks[:BS] + blocks(9, 3, BS)
    assert _match(index, other) == {"e0": (BS, 0)}
    assert _match(index, blocks(5, 2, BS)) == {}


def test_parent_links_continue_chains_and_orphans_are_skipped() -> None:
    index = _index()
    toks = blocks(2, 4, BS)
    first = _store_chain(index, "e0", toks[: 2 * BS], base=10)
    index.store("e0", [20, 21], first[-1], toks[2 * BS:], BS)
    assert _match(index, toks) == {"e0": (4 * BS, 0)}
    assert index.store("e1", [30], 999, toks[:BS], BS) == 0
    assert index.stats.orphan_blocks == 1
    assert index.blocks_of("e1") == 0


def test_tiers_device_then_other() -> None:
    index = _index()
    toks = blocks(3, 4, BS)
    first = _store_chain(index, "e0", toks[: 2 * BS], base=10, medium="GPU")
    index.store("e0", [20, 21], first[-1], toks[2 * BS:], BS, medium="CPU")
    assert _match(index, toks) == {"e0": (2 * BS, 2 * BS)}
    _store_chain(index, "e1", toks, base=10, medium="CPU")
    assert _match(index, toks)["e1"] == (0, 4 * BS)


def test_removal_clears_one_tier_at_a_time() -> None:
    index = _index()
    toks = blocks(4, 2, BS)
    _store_chain(index, "e0", toks, base=10, medium="GPU")
    _store_chain(index, "e0", toks, base=10, medium="CPU")  # offloaded copy, same hashes
    index.remove("e0", [11], medium="GPU")
    assert _match(index, toks) == {"e0": (BS, BS)}
    index.remove("e0", [11], medium="CPU")
    assert _match(index, toks) == {"e0": (BS, 0)}
    assert index.remove("e0", [11, 77]) == 0
    assert index.stats.unknown_removals == 2


def test_removal_tail_to_root_one_event_each() -> None:
    index = _index()
    toks = blocks(5, 3, BS)
    hashes = _store_chain(index, "e0", toks)
    expected = [2 * BS, BS, 0]
    for h, want in zip(reversed(hashes), expected, strict=True):
        index.remove("e0", [h])
        assert _match(index, toks).get("e0", (0, 0))[0] == want
    assert len(index) == 0


def test_group_idx_keeps_groups_apart() -> None:
    index = _index()
    toks = blocks(6, 2, BS)
    index.store("e0", [1, 2], None, toks, BS, group_idx=1)
    assert _match(index, toks) == {}
    assert index.match({BS: chain_hashes(toks, BS, group_idx=1)}, 0.0, group_idx=1) == {
        "e0": (2 * BS, 0)}
    index.remove("e0", [1, 2], group_idx=0)
    assert len(index) == 2


def test_block_size_per_holder() -> None:
    index = _index()
    toks = blocks(7, 4, 8)
    index.store("big", [1, 2, 3, 4], None, toks, 8)
    index.store("small", [1, 2], None, toks[:8], BS)
    assert index.block_sizes() == frozenset({8, BS})
    got = index.match({8: chain_hashes(toks, 8), BS: chain_hashes(toks, BS)}, 0.0)
    assert got == {"big": (32, 0), "small": (8, 0)}


def test_reset_one_holder_and_engine() -> None:
    index = _index()
    toks = blocks(8, 2, BS)
    for holder in ("e0", "e0#dp1", "e1"):
        _store_chain(index, holder, toks)
    assert sorted(index.holders_of(["e0", "e1", "e9"])) == ["e0", "e0#dp1", "e1"]
    assert index.holders_of(["e0"]) == ["e0", "e0#dp1"]  # every rank of the engine
    index.reset("e1")
    assert set(_match(index, toks)) == {"e0", "e0#dp1"}
    assert index.holders_of(["e0", "e1"]) == ["e0", "e0#dp1"]
    assert index.reset_engine("e0") == 4
    assert len(index) == 0 and index.holders() == () and index.holders_of(["e0", "e1"]) == []
    _store_chain(index, "e1", toks)  # a holder that comes back is found again
    assert index.holders_of(["e1"]) == ["e1"]


def test_records_expire_and_events_supersede_them() -> None:
    index = _index()
    toks = blocks(9, 3, BS)
    hashes = chain_hashes(toks, BS)
    index.record("e0", hashes, expires=10.0, block_size=BS)
    assert _match(index, toks, now=9.9) == {"e0": (3 * BS, 0)}
    assert _match(index, toks, now=10.0) == {}
    assert index.stats.expired_blocks == 1
    index.record("e1", hashes, expires=10.0, block_size=BS)
    _store_chain(index, "e1", toks[: 2 * BS])  # the engine confirms two blocks
    assert _match(index, toks, now=50.0) == {"e1": (2 * BS, 0)}


def test_record_does_not_shorten_an_event_entry() -> None:
    index = _index()
    toks = blocks(10, 2, BS)
    _store_chain(index, "e0", toks, medium="CPU")
    index.record("e0", chain_hashes(toks, BS), expires=1.0, block_size=BS)
    assert _match(index, toks, now=5.0) == {"e0": (0, 2 * BS)}


def test_global_capacity_evicts_lru_of_largest_holder() -> None:
    index = _index(capacity=6)
    a, b = blocks(11, 4, BS), blocks(12, 2, BS)
    _store_chain(index, "big", a)
    _store_chain(index, "small", b, base=200)
    assert len(index) == 6
    _store_chain(index, "small", blocks(13, 1, BS), base=300)
    assert len(index) == 6 and index.stats.evicted_blocks == 1
    assert index.blocks_of("big") == 3 and index.blocks_of("small") == 3
    # the tail went first: the root and the next blocks still match
    assert _match(index, a)["big"] == (3 * BS, 0)
    index.remove("big", [103])  # the evicted block's engine hash was forgotten too
    assert index.stats.unknown_removals == 1


def test_match_refreshes_recency() -> None:
    index = _index(capacity=1000, per_holder=4)
    old, new = blocks(14, 2, BS), blocks(15, 2, BS)
    _store_chain(index, "e0", old, base=10)
    _store_chain(index, "e0", new, base=20)
    _match(index, old)  # a hit: the engine refreshed these blocks, so do we
    _store_chain(index, "e0", blocks(16, 2, BS), base=30)
    assert _match(index, old) == {"e0": (2 * BS, 0)}
    assert _match(index, new) == {}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_workload_stays_bounded_and_consistent(seed: int) -> None:
    import random

    rng = random.Random(seed)
    index = _index(capacity=50)
    live: dict[str, list[int]] = {"e0": [], "e0#dp1": [], "e1": [], "e2": []}
    next_hash = 1
    for _ in range(400):
        holder = rng.choice(list(live))
        if rng.random() < 0.05:
            index.reset_engine(engine_of(holder))
            live.update({h: [] for h in live if engine_of(h) == engine_of(holder)})
        elif live[holder] and rng.random() < 0.3:
            index.remove(holder, [live[holder].pop(rng.randrange(len(live[holder])))])
        else:
            n = rng.randint(1, 4)
            hashes = list(range(next_hash, next_hash + n))
            next_hash += n
            index.store(holder, hashes, None, blocks(next_hash, n, BS), BS)
            live[holder].extend(hashes)
        assert len(index) <= 50
        assert len(index) == sum(index.blocks_of(h) for h in index.holders())
        assert sorted(index.holders_of(["e0", "e1", "e2"])) == sorted(index.holders())


def test_match_tokens_hashes_like_a_request() -> None:
    index = _index()
    toks = blocks(17, 3, BS)
    extra = request_extra_keys(3, "ad", "salt")
    index.store("e0", [1, 2, 3], None, toks, BS, extra_keys=extra)
    assert index.match_tokens(toks, 0.0, lora="ad", cache_salt="salt") == {"e0": (3 * BS, 0)}
    assert index.match_tokens(toks, 0.0, lora="ad") == {}
    assert index.match_tokens(toks, 0.0, block_size=8) == {}


@pytest.mark.parametrize("n_blocks", [1, 127, 128, 300])
def test_loop_and_vector_chains_agree(n_blocks: int) -> None:
    """Short prompts are chained in a loop, long ones in numpy: one function either way, so a
    prompt and its longer continuation share their leading hashes across the threshold."""
    rnd = random.Random(n_blocks)
    toks = [rnd.randrange(2**32) for _ in range(n_blocks * BS)]
    whole = chain_hashes(toks, BS)
    assert len(whole) == n_blocks
    cut = n_blocks // 2
    assert chain_hashes(toks[: cut * BS], BS) == whole[:cut]
    if cut:
        assert chain_hashes(toks[cut * BS :], BS, parent=whole[cut - 1]) == whole[cut:]
    assert chain_hashes(array("I", toks), BS) == whole  # zero-copy input, same values
