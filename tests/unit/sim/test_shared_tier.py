"""The simulator's shared KV tier: LRU order, capacity (codec factor), load cost, wire events,
and schedulers of two engines reusing each other's prefixes through it."""

from __future__ import annotations

import random

import pytest

from kvgate.engines.sim.core.config import SimConfig
from kvgate.engines.sim.core.kv_events import BlockRemoved, BlockStored, encode_event
from kvgate.engines.sim.core.scheduler import Scheduler, SeqSpec
from kvgate.engines.sim.core.shared_tier import SharedTier, TierParams


def _tier(capacity: int, block_size: int = 2, **kw: float) -> SharedTier:
    return SharedTier(TierParams(capacity_blocks=capacity, block_size=block_size, **kw))


def test_chain_tail_is_evicted_before_its_root() -> None:
    t = _tier(2)
    t.put([1, 2, 3], None, [10, 11, 12, 13, 14, 15])
    assert len(t) == 2 and t.match_blocks([1, 2, 3]) == 2
    assert t.drain_events() == [
        BlockStored([1, 2, 3], None, [10, 11, 12, 13, 14, 15], 2, medium="CPU",
                    locality="REMOTE"),
        BlockRemoved([3], medium="CPU", locality="REMOTE"),
    ]


def test_only_new_runs_are_announced_and_held_blocks_refresh() -> None:
    t = _tier(3)
    t.put([1], None, [10, 11])
    t.put([5], None, [50, 51])
    t.drain_events()
    t.put([1, 2], None, [10, 11, 20, 21])  # 1 refreshed, 2 new (parent 1)
    assert t.drain_events() == [BlockStored([2], 1, [20, 21], 2, medium="CPU",
                                            locality="REMOTE")]
    t.put([7], None, [70, 71])  # evicts 5, the least recently used
    assert 5 not in t and t.match_blocks([1, 2]) == 2


@pytest.mark.parametrize(("capacity", "factor", "held"), [
    (100, 1.0, 100), (100, 1 / (1 - 0.33), 149), (1, 1.0, 1), (3, 2.0, 6),
])
def test_codec_factor_scales_capacity(capacity: int, factor: float, held: int) -> None:
    t = _tier(capacity, capacity_factor=factor)
    t.put(list(range(1, 1000)), None, [0] * 2 * 999)
    assert len(t) == held == t.capacity


def test_load_cost_is_setup_plus_bytes_over_link() -> None:
    t = _tier(10, block_size=512)
    assert t.load_seconds(0) == 0.0
    assert t.load_seconds(2) == pytest.approx(2e-3 + 2 * 512 * 131_072 / 25e9)
    t.put([1, 2], None, [0] * 1024)
    assert t.load([1, 2]) == pytest.approx(t.load_seconds(2))
    assert (t.stats.loads, t.stats.loaded) == (1, 2)


def test_tier_events_carry_locality_on_the_wire() -> None:
    ev = BlockRemoved([9], medium="CPU", locality="REMOTE")
    assert encode_event(ev, "tagged") == {"type": "BlockRemoved", "block_hashes": [9],
                                          "medium": "CPU", "group_idx": 0,
                                          "locality": "REMOTE"}
    assert encode_event(ev, "positional") == ["BlockRemoved", [9], "CPU", 0, "REMOTE"]
    # GPU events are unchanged: locality None is left off
    assert encode_event(BlockRemoved([9]), "positional") == ["BlockRemoved", [9], "GPU", 0]


def _run(s: Scheduler) -> None:
    while s.has_work():
        s.complete(s.schedule())


def _prompt(n: int) -> list[int]:
    rng = random.Random(7)
    return [rng.randrange(16, 32_000) for _ in range(n)]


@pytest.mark.parametrize("with_tier", [True, False])
def test_an_engine_loads_what_another_computed(with_tier: bool) -> None:
    tier = _tier(64, block_size=16) if with_tier else None
    cfg = SimConfig(block_size=16, capacity_blocks=64, time_scale=0)
    a, b = Scheduler(cfg, tier), Scheduler(cfg, tier)
    prompt = _prompt(100)  # 6 full blocks, the last token always computed
    a.add(SeqSpec("x", prompt, 2, ignore_eos=True))
    _run(a)
    seq = b.add(SeqSpec("y", prompt, 2, ignore_eos=True))
    plan = b.schedule()
    expected = 96 if with_tier else 0
    assert seq.cached_tokens == expected and plan[0].context == expected
    assert b.stats.prompt_tokens_tier == expected and b.stats.prompt_tokens_cache_hit == 0
    assert b.stats.prompt_tokens_local_compute == 100 - expected
    assert (b.tier_seconds > 0) is with_tier
    b.complete(plan)
    assert b.cache.match_blocks(seq.hashes) == 6  # the loaded blocks are now on b's GPU


def test_an_evicted_tier_gets_only_what_a_gpu_evicts() -> None:
    tier = SharedTier(TierParams(capacity_blocks=64, block_size=16, write="evicted"))
    s = Scheduler(SimConfig(block_size=16, capacity_blocks=8, time_scale=0), tier)
    s.add(SeqSpec("x", _prompt(100), 2, ignore_eos=True))  # 7 blocks: nothing evicted yet
    _run(s)
    assert len(tier) == 0
    rng = random.Random(1)
    s.add(SeqSpec("y", [rng.randrange(16, 32_000) for _ in range(100)], 2, ignore_eos=True))
    _run(s)
    assert len(tier) > 0 and all(h not in s.cache for h in tier._blocks)


def test_a_load_survives_blocks_evicted_since_the_match() -> None:
    t = _tier(2)
    t.put([1, 2], None, [0] * 4)
    assert t.match_blocks([1, 2]) == 2
    t.put([7, 8], None, [0] * 4)  # another engine's write evicts both
    assert t.load([1, 2]) == pytest.approx(t.load_seconds(2)) and len(t) == 2
