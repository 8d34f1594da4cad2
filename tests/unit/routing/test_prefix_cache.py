"""Prefix-cache producer (precise, speculative, approximate) and scorer."""

from __future__ import annotations

from typing import Any

import pytest

from kvgate.middleware.framework.errors import ConfigError
from kvgate.middleware.framework.types import Api, CycleState, Endpoint, RoutingDecision
from kvgate.plugins.common.state import PREFIX_MATCH, TOKEN_IDS, PrefixMatch
from kvgate.plugins.prefix.events.subscriber import KvEventsSubscriber
from kvgate.plugins.prefix.producer import PrefixCacheProducer
from kvgate.plugins.prefix.scorer import PrefixCacheScorer
from tests.unit.routing.helpers import (
    Clock,
    Lookup,
    NoLookup,
    blocks,
    endpoint,
    frames,
    request,
    stored,
    subscriber,
)

BS = 16
EPS = [endpoint("e0"), endpoint("e1"), endpoint("e2")]


def _precise(sub: KvEventsSubscriber, clock: Clock, **params: Any) -> PrefixCacheProducer:
    return PrefixCacheProducer(
        "pc", PrefixCacheProducer.Params(mode="precise", **params), Lookup({"kv-events": sub}),
        clock=clock,
    )


def _approx(clock: Clock, **params: Any) -> PrefixCacheProducer:
    return PrefixCacheProducer(
        "pc", PrefixCacheProducer.Params(mode="approximate", **params), NoLookup(), clock=clock
    )


async def _prepare(producer: PrefixCacheProducer, tokens: list[int],
                   body: dict[str, Any] | None = None, *, model: str = "m",
                   tenant: str | None = None,
                   eps: list[Endpoint] | None = None) -> tuple[CycleState, PrefixMatch]:
    state = CycleState()
    state.put(TOKEN_IDS, tuple(tokens))
    req = request(Api.COMPLETIONS, body, model=model, tenant=tenant)
    await producer.prepare(req, state, EPS if eps is None else eps)
    return state, state.require(PREFIX_MATCH)


async def _dispatch(producer: PrefixCacheProducer, state: CycleState, target: str,
                    prefill: str | None = None, *, tenant: str | None = None) -> None:
    by_id = {ep.id: ep for ep in EPS}
    decision = RoutingDecision(target=by_id[target],
                               prefill=None if prefill is None else by_id[prefill])
    await producer.before_dispatch(request(Api.COMPLETIONS, tenant=tenant), state, decision)


async def test_precise_match_from_events() -> None:
    sub, clock = subscriber(["e0", "e1", "e2"]), Clock()
    toks = blocks(1, 4, BS)
    sub.handle_frames(frames("kv@e0@m", 0, [stored([1, 2, 3], None, toks[: 3 * BS], BS)]))
    sub.handle_frames(frames("kv@e1@m", 0, [stored([1], None, toks[:BS], BS, medium="CPU")]))
    _, match = await _prepare(_precise(sub, clock), [*toks, 5, 6])
    assert match.prompt_tokens == 4 * BS + 2
    assert match.precise
    assert dict(match.device) == {"e0": 3 * BS, "e1": 0}
    assert dict(match.other) == {"e0": 0, "e1": BS}


async def test_precise_match_only_for_candidate_endpoints_and_dp_ranks_folded() -> None:
    sub, clock = subscriber(["e0", "e1"]), Clock()
    toks = blocks(2, 2, BS)
    sub.handle_frames(frames("kv@e0", 0, [stored([1], None, toks[:BS], BS)], rank=0))
    sub.handle_frames(frames("kv@e0", 0, [stored([1, 2], None, toks, BS)], rank=1))
    sub.handle_frames(frames("kv@e1", 0, [stored([1, 2], None, toks, BS)]))
    _, match = await _prepare(_precise(sub, clock), toks, eps=[EPS[0]])
    assert dict(match.device) == {"e0": 2 * BS}


SCOPE_CASES = [
    # (case, extra_keys in the event, lora_name in the event, request body, model, matches)
    ("salted blocks need the salt", [["s1"], None], None, {"cache_salt": "s1"}, "m", True),
    ("salted blocks miss without it", [["s1"], None], None, {}, "m", False),
    ("other salt misses", [["s1"], None], None, {"cache_salt": "s2"}, "m", False),
    ("unsalted blocks miss a salted request", None, None, {"cache_salt": "s1"}, "m", False),
    ("lora blocks via extra keys", [["ad"], ["ad"]], None, {}, "ad", True),
    ("lora blocks via lora_name (old engine)", None, "ad", {}, "ad", True),
    ("lora blocks miss the base model", [["ad"], ["ad"]], None, {}, "m", False),
]


@pytest.mark.parametrize(("case", "extra", "lora", "body", "model", "hit"), SCOPE_CASES,
                         ids=[c[0] for c in SCOPE_CASES])
async def test_precise_scoping(case: str, extra: Any, lora: str | None, body: dict[str, Any],
                               model: str, hit: bool) -> None:
    sub, clock = subscriber(["e0"]), Clock()
    toks = blocks(3, 2, BS)
    more: dict[str, Any] = {}
    if extra is not None:
        more["extra_keys"] = extra
    if lora is not None:
        more["lora_name"] = lora
    sub.handle_frames(frames("kv@e0", 0, [stored([1, 2], None, toks, BS, **more)]))
    producer = _precise(sub, clock, lora_adapters=["ad"])
    _, match = await _prepare(producer, toks, body, model=model)
    assert match.device.get("e0", 0) == (2 * BS if hit else 0)


async def test_speculative_entry_until_ttl() -> None:
    sub, clock = subscriber(["e0", "e1", "e2"]), Clock()
    producer = _precise(sub, clock, speculative_ttl_s=2.0)
    toks = blocks(4, 3, BS)
    state, first = await _prepare(producer, toks)
    assert not first.device
    await _dispatch(producer, state, "e1")
    clock.now += 1.9
    _, burst = await _prepare(producer, toks)
    assert dict(burst.device) == {"e1": 3 * BS}
    clock.now += 0.2
    _, later = await _prepare(producer, toks)
    assert not later.device


async def test_speculation_confirmed_by_event_outlives_ttl() -> None:
    sub, clock = subscriber(["e0", "e1", "e2"]), Clock()
    producer = _precise(sub, clock)
    toks = blocks(5, 2, BS)
    state, _ = await _prepare(producer, toks)
    await _dispatch(producer, state, "e2")
    sub.handle_frames(frames("kv@e2", 0, [stored([7, 8], None, toks, BS)]))
    clock.now += 100
    _, match = await _prepare(producer, toks)
    assert dict(match.device) == {"e2": 2 * BS}


async def test_speculation_uses_the_engine_block_size_and_covers_prefill() -> None:
    sub, clock = subscriber(["e0", "e1", "e2"]), Clock()
    other = blocks(60, 1, 32)
    sub.handle_frames(frames("kv@e0", 0, [stored([1], None, other, 32)]))  # e0 uses 32
    producer = _precise(sub, clock)
    toks = blocks(6, 4, BS)  # 64 tokens: 2 blocks of 32, 4 of 16
    state, _ = await _prepare(producer, toks)
    await _dispatch(producer, state, "e1", prefill="e0")
    _, match = await _prepare(producer, toks)
    assert dict(match.device) == {"e0": 64, "e1": 64}
    assert sub.index.blocks_of("e0") == 3 and sub.index.blocks_of("e1") == 4


async def test_speculation_disabled() -> None:
    sub, clock = subscriber(["e0"]), Clock()
    producer = _precise(sub, clock, speculative_ttl_s=0)
    state, _ = await _prepare(producer, blocks(7, 2, BS))
    await _dispatch(producer, state, "e0")
    assert len(sub.index) == 0


async def test_approximate_records_routing_with_ttl() -> None:
    clock = Clock()
    producer = _approx(clock, block_size=BS, record_ttl_s=60)
    toks = blocks(8, 3, BS)
    state, match = await _prepare(producer, toks)
    assert not match.device and not match.precise
    await _dispatch(producer, state, "e2")
    clock.now += 59
    _, match = await _prepare(producer, toks[: 2 * BS] + blocks(9, 1, BS))
    assert dict(match.device) == {"e2": 2 * BS}
    clock.now += 59  # matching does not extend a record: it expires 60 s after its dispatch
    _, match = await _prepare(producer, toks)
    assert not match.device


@pytest.mark.parametrize("mode", ["approximate", "auto"])  # auto with no kv-events plugin
async def test_record_only_match_is_the_whole_match(mode: str) -> None:
    """Without a KV-event index every candidate is matched on the record alone: device tokens
    for the engines that hold the prefix (in the candidates' order), nothing on other tiers,
    nothing precise; engines that are not candidates are left out."""
    producer = PrefixCacheProducer("pc", PrefixCacheProducer.Params(mode=mode, block_size=BS),
                                   NoLookup(), clock=Clock())
    toks = blocks(70, 3, BS)
    for target in ("e2", "e0"):
        state, _ = await _prepare(producer, toks)
        await _dispatch(producer, state, target)
    _, match = await _prepare(producer, [*toks[: 2 * BS], *blocks(71, 1, BS)])
    assert match == PrefixMatch(3 * BS, {"e0": 2 * BS, "e2": 2 * BS},
                                {"e0": 0, "e2": 0}, False, frozenset())
    assert list(match.device) == ["e0", "e2"]
    _, match = await _prepare(producer, toks, eps=[EPS[1], EPS[2]])
    assert (dict(match.device), dict(match.other)) == ({"e2": 3 * BS}, {"e2": 0})


async def test_approximate_per_engine_lru_mirrors_engine_capacity() -> None:
    clock = Clock()
    producer = _approx(clock, block_size=BS, engine_capacity_blocks=4)
    prompts = [blocks(10 + i, 2, BS) for i in range(3)]
    for toks in prompts:
        state, _ = await _prepare(producer, toks)
        await _dispatch(producer, state, "e0")
    results = [(await _prepare(producer, toks))[1].device.get("e0", 0) for toks in prompts]
    assert results == [0, 2 * BS, 2 * BS]
    assert producer.index.stats.evicted_blocks == 2


async def test_approximate_forgets_engines_that_leave() -> None:
    producer = _approx(Clock(), block_size=BS)
    state, _ = await _prepare(producer, blocks(40, 2, BS))
    await _dispatch(producer, state, "e1")
    producer.on_endpoints_changed([], [EPS[0]])
    assert producer.index.blocks_of("e1") == 2
    producer.on_endpoints_changed([], [EPS[1]])
    assert len(producer.index) == 0


async def test_approximate_global_capacity() -> None:
    clock = Clock()
    producer = _approx(clock, block_size=BS, capacity_blocks=5)
    for i, target in enumerate(["e0", "e1", "e2", "e0"]):
        state, _ = await _prepare(producer, blocks(20 + i, 2, BS))
        await _dispatch(producer, state, target)
    assert len(producer.index) == 5


@pytest.mark.parametrize(("scope", "same_tenant_hits", "other_tenant_hits"),
                         [(True, True, False), (False, True, True)])
async def test_approximate_tenant_scoping(scope: bool, same_tenant_hits: bool,
                                          other_tenant_hits: bool) -> None:
    clock = Clock()
    producer = _approx(clock, block_size=BS, scope_by_tenant=scope)
    toks = blocks(30, 2, BS)
    state, _ = await _prepare(producer, toks, tenant="acme")
    await _dispatch(producer, state, "e0", tenant="acme")
    _, same = await _prepare(producer, toks, tenant="acme")
    _, other = await _prepare(producer, toks, tenant="globex")
    assert bool(same.device) is same_tenant_hits
    assert bool(other.device) is other_tenant_hits


async def test_no_token_ids_no_match() -> None:
    producer = _approx(Clock())
    state = CycleState()
    await producer.prepare(request(), state, EPS)
    assert PREFIX_MATCH not in state
    await producer.before_dispatch(request(), state, RoutingDecision(target=EPS[0]))
    assert len(producer.index) == 0


async def test_out_of_range_token_ids_are_ignored() -> None:
    producer = _approx(Clock(), block_size=2)
    state = CycleState()
    state.put(TOKEN_IDS, (2**40, 1))
    await producer.prepare(request(), state, EPS)
    assert PREFIX_MATCH not in state


def test_precise_needs_a_kv_events_plugin() -> None:
    with pytest.raises(ConfigError):
        PrefixCacheProducer("pc", PrefixCacheProducer.Params(), Lookup({"kv-events": object()}))


SCORE_CASES = [
    # (case, prompt, device, other, weight, expected scores)
    ("all on device", 100, {"e0": 100}, {}, 0.5, {"e0": 1.0, "e1": 0.0, "e2": 0.0}),
    ("device beats other", 100, {"e0": 50}, {"e1": 50}, 0.5, {"e0": 0.5, "e1": 0.25, "e2": 0.0}),
    ("mixed tiers", 100, {"e0": 40}, {"e0": 40}, 0.5, {"e0": 0.6, "e1": 0.0, "e2": 0.0}),
    ("other weight 1", 80, {}, {"e2": 40}, 1.0, {"e0": 0.0, "e1": 0.0, "e2": 0.5}),
    ("other weight 0", 80, {}, {"e2": 40}, 0.0, {"e0": 0.0, "e1": 0.0, "e2": 0.0}),
    ("never above 1", 10, {"e0": 16}, {}, 0.5, {"e0": 1.0, "e1": 0.0, "e2": 0.0}),
    ("empty prompt", 0, {}, {}, 0.5, {}),
]


@pytest.mark.parametrize(("case", "prompt", "device", "other", "weight", "expected"),
                         SCORE_CASES, ids=[c[0] for c in SCORE_CASES])
def test_scorer(case: str, prompt: int, device: dict[str, int], other: dict[str, int],
                weight: float, expected: dict[str, float]) -> None:
    scorer = PrefixCacheScorer("s", PrefixCacheScorer.Params(other_tier_weight=weight), NoLookup())
    state = CycleState()
    state.put(PREFIX_MATCH, PrefixMatch(prompt, device, other, precise=True))
    assert dict(scorer.score(request(), state, EPS)) == pytest.approx(expected)


def test_scorer_without_match_scores_nothing() -> None:
    scorer = PrefixCacheScorer("s", PrefixCacheScorer.Params(), NoLookup())
    assert scorer.score(request(), CycleState(), EPS) == {}


async def test_speculation_in_another_group_leaves_group_0_block_size_alone() -> None:
    """Regression: a speculative record for group 1 set the holder's group-0 block size."""
    sub, clock = subscriber(["e0", "e1", "e2"]), Clock()
    sub.handle_frames(frames("kv@e0", 0, [stored([1], None, blocks(61, 1, 32), 32,
                                                 group_idx=1)]))  # e0's group 1 uses 32
    producer = _precise(sub, clock, group_idx=1)
    toks = blocks(8, 4, BS)
    state, _ = await _prepare(producer, toks)
    await _dispatch(producer, state, "e0")
    assert sub.index.block_size("e0", 1) == 32
    assert sub.index.block_size("e0", 0) == sub.index.default_block_size  # untouched
    _, match = await _prepare(producer, toks)
    assert dict(match.device) == {"e0": 64}
