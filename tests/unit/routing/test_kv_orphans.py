"""Events whose parent the index lost (gateway restart, reset) are re-keyed from the prompts the
gateway recently routed (plugins/prefix/index/recent.py, KvIndex._resolve)."""

from __future__ import annotations

import random

import pytest

from kvgate.middleware.framework.types import Api, CycleState, RoutingDecision
from kvgate.plugins.common.state import PREFIX_MATCH, TOKEN_IDS
from kvgate.plugins.prefix.index.index import KvIndex, chain_hashes, request_extra_keys
from kvgate.plugins.prefix.index.recent import SCAN_PROMPTS, RecentPrompts, pack_tokens
from kvgate.plugins.prefix.producer import PrefixCacheProducer
from tests.unit.routing.helpers import Clock, Lookup, endpoint, frames, removed, request, stored
from tests.unit.routing.helpers import subscriber as make_subscriber

BS = 16


def _tokens(seed: int, n_blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n_blocks * BS)]


# -- RecentPrompts -----------------------------------------------------------------------------


def test_candidates_are_aligned_newest_first_and_scoped() -> None:
    recent = RecentPrompts(1 << 20)
    a = _tokens(1, 4)
    recent.add("e0", 0, BS, pack_tokens(a), chain_hashes(a, BS))
    b = _tokens(2, 1) + a[: 3 * BS]  # a's blocks 0..2 at b's blocks 1..3
    recent.add("e0", 0, BS, pack_tokens(b), chain_hashes(b, BS))
    recent.add("e1", 0, BS, pack_tokens(a), chain_hashes(a, BS))  # other holder
    recent.add("e0", 1, BS, pack_tokens(a), chain_hashes(a, BS))  # other group
    block = pack_tokens(a[BS : 2 * BS])
    found = [(hashes[i], i) for hashes, i in recent.candidates("e0", 0, block)]
    assert found == [(chain_hashes(b, BS)[2], 2), (chain_hashes(a, BS)[1], 1)]
    unaligned = pack_tokens(a[BS + 3 : 2 * BS + 3])
    assert list(recent.candidates("e0", 0, unaligned)) == []
    assert list(recent.candidates("e0", 0, pack_tokens(a[:8]))) == []  # not a block's width


@pytest.mark.parametrize(("capacity", "max_prompts", "kept"), [
    (10 * 4 * BS, 100, 2),  # 10 blocks of bytes: the last two 4-block prompts
    (1 << 20, 3, 3),  # count bound
    (3 * 4 * BS, 100, 0),  # a prompt larger than the whole bound is not kept
])
def test_recent_prompts_are_bounded(capacity: int, max_prompts: int, kept: int) -> None:
    recent = RecentPrompts(capacity, max_prompts)
    for seed in range(5):
        t = _tokens(seed, 4)
        recent.add("e0", 0, BS, pack_tokens(t), chain_hashes(t, BS))
    assert len(recent) == kept and recent.size_bytes == kept * 4 * 4 * BS
    recent.forget("e0")
    assert len(recent) == 0 and recent.size_bytes == 0


# -- re-keying in the index ------------------------------------------------------------------

#: (case, LoRA of the routed prompt, LoRA of the event, remembered, resolved). A LoRA name is an
#: extra key of every block, so the check on the event's first block tells adapters apart (a
#: ``cache_salt`` only marks block 0, which an orphan event never contains).
RESOLVE: list[tuple[str, str | None, str | None, bool, bool]] = [
    ("prefix reused, new blocks extend it", None, None, True, True),
    ("nothing routed there recently", None, None, False, False),
    ("routed for another LoRA adapter", "sql-lora", "chat-lora", True, False),
    ("same LoRA adapter", "sql-lora", "sql-lora", True, True),
]


@pytest.mark.parametrize(("case", "routed_lora", "event_lora", "remembered", "resolved"),
                         RESOLVE, ids=[c[0] for c in RESOLVE])
def test_orphan_event_is_rekeyed_from_a_recent_prompt(
    case: str, routed_lora: str | None, event_lora: str | None, remembered: bool,
    resolved: bool,
) -> None:
    index = KvIndex(1_000, recent_prompt_bytes=1 << 20)
    prompt = _tokens(3, 6)  # blocks 0..3 cached on the engine before the gateway restarted
    own = chain_hashes(prompt, BS, extra_keys=request_extra_keys(6, routed_lora, None))
    if remembered:
        index.remember("e0", prompt, own, block_size=BS)
    # the engine reused blocks 0..3 (engine hash 103 = block 3) and stores blocks 4, 5
    event_extra = request_extra_keys(2, event_lora, None)
    stored_n = index.store("e0", [104, 105], 103, prompt[4 * BS :], BS, extra_keys=event_extra)
    assert stored_n == (2 if resolved else 0)
    assert index.stats.resolved_orphans == int(resolved)
    assert index.stats.orphan_blocks == (0 if resolved else 2)
    match = index.match({BS: own}, now=0.0)
    assert match == ({"e0": (6 * BS, 0)} if resolved else {})
    if resolved:  # the parent's engine hash is linked: later events and removals use it
        assert index.store("e0", [204], 103, _tokens(9, 1), BS, extra_keys=event_extra) == 1
        assert index.stats.resolved_orphans == 1
        assert index.remove("e0", [103]) == 1
        assert index.match({BS: own}, now=0.0) == {"e0": (3 * BS, 0)}


def test_resolution_keeps_the_root_most_recent() -> None:
    """Ancestors are indexed after the event's blocks, root last, so LRU eviction in the index
    takes a chain's tail first (as for ordinary events)."""
    index = KvIndex(1_000, recent_prompt_bytes=1 << 20)
    prompt = _tokens(4, 5)
    own = chain_hashes(prompt, BS)
    index.remember("e0", prompt, own, block_size=BS)
    index.store("e0", [4], 3, prompt[4 * BS :], BS)
    index.capacity_blocks = 3
    index.store("e0", [900], None, _tokens(5, 1), BS)  # one more block: evicts 3 oldest
    assert index.match({BS: own}, now=0.0) == {"e0": (2 * BS, 0)}


# -- through the subscriber and the producer ---------------------------------------------------


async def test_gateway_restart_relearns_a_hot_prefix() -> None:
    """The engine kept a hot prefix across a gateway restart: its events only ever extend it.
    The first event teaches the block size, the next routed request is remembered, and its
    event is re-keyed, after which the prefix matches again."""
    sub, clock = make_subscriber(["e0", "e1"]), Clock()
    producer = PrefixCacheProducer("pc", PrefixCacheProducer.Params(mode="precise"),
                                   Lookup({"kv-events": sub}), clock=clock)
    system = _tokens(6, 8)
    seq = 1000  # the engine's publisher kept counting
    sub.handle_frames(frames("kv@e0", seq, [stored([11], 8, _tokens(7, 1), BS)]))
    assert sub.index.stats.orphan_blocks == 1
    for turn in range(2):
        prompt = system + _tokens(10 + turn, 2)
        state = CycleState()
        state.put(TOKEN_IDS, tuple(prompt))
        req = request(Api.COMPLETIONS)
        await producer.prepare(req, state, [endpoint("e0"), endpoint("e1")])
        held = state.require(PREFIX_MATCH).device.get("e0", 0)
        assert held == (0 if turn == 0 else 8 * BS)
        await producer.before_dispatch(req, state, RoutingDecision(target=endpoint("e0")))
        clock.now += 10  # speculative entries have expired
        seq += 1
        tail = prompt[8 * BS :]
        sub.handle_frames(frames("kv@e0", seq, [stored([20 + turn, 30 + turn], 8, tail, BS)]))
    assert sub.index.stats.resolved_orphans == 1
    sub.handle_frames(frames("kv@e0", seq + 1, [removed([8])]))
    assert sub.index.match_tokens(system, clock.now) == {"e0": (7 * BS, 0)}


def test_lookup_scans_only_the_newest_prompts_of_the_holder() -> None:
    recent = RecentPrompts(1 << 24, max_prompts=10_000)
    old = _tokens(20, 2)
    recent.add("e0", 0, BS, pack_tokens(old), chain_hashes(old, BS))
    for seed in range(SCAN_PROMPTS - 1):
        t = _tokens(100 + seed, 2)
        recent.add("e0", 0, BS, pack_tokens(t), chain_hashes(t, BS))
    block = pack_tokens(old[BS:])
    assert [i for _, i in recent.candidates("e0", 0, block)] == [1]  # the 64th newest
    recent.add("e1", 0, BS, pack_tokens(old), chain_hashes(old, BS))  # other holders don't count
    assert [i for _, i in recent.candidates("e0", 0, block)] == [1]
    recent.add("e0", 0, BS, pack_tokens(_tokens(7, 2)), chain_hashes(_tokens(7, 2), BS))
    assert list(recent.candidates("e0", 0, block)) == []  # now 65th: not searched
