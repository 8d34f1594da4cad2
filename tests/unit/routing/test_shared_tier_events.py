"""The live gateway and a shared KV tier: KV events with locality REMOTE are filed under the
shared tier's holder, and the precise prefix match credits that tier to every engine; without
such events nothing changes."""

from __future__ import annotations

from kvgate.middleware.framework.types import Api, CycleState, RoutingDecision, Usage
from kvgate.plugins.common.state import PREFIX_MATCH, TOKEN_IDS, PrefixMatch
from kvgate.plugins.prefix.producer import PrefixCacheProducer
from kvgate.plugins.prefix.shared_tier import SHARED_HOLDER
from tests.unit.routing.helpers import (
    Clock,
    Lookup,
    blocks,
    endpoint,
    frames,
    request,
    stored,
    subscriber,
)

BS = 16
EPS = [endpoint("e0"), endpoint("e1"), endpoint("e2")]


async def _match(sub: object, tokens: list[int]) -> PrefixMatch:
    producer = PrefixCacheProducer("pc", PrefixCacheProducer.Params(mode="precise"),
                                   Lookup({"kv-events": sub}), clock=Clock())
    state = CycleState()
    state.put(TOKEN_IDS, tuple(tokens))
    await producer.prepare(request(Api.COMPLETIONS), state, EPS)
    return state.require(PREFIX_MATCH)


async def test_remote_blocks_are_the_fleets_not_the_publishers() -> None:
    sub = subscriber(["e0", "e1", "e2"])
    toks = blocks(1, 4, BS)
    sub.handle_frames(frames("kv@e0@m", 0, [
        stored([1, 2], None, toks[: 2 * BS], BS),  # e0's GPU: 2 blocks
        stored([1, 2, 3], None, toks[: 3 * BS], BS, medium="CPU", locality="REMOTE"),
    ]))
    assert sub.index.blocks_of(SHARED_HOLDER) == 3 and sub.index.blocks_of("e0") == 2
    match = await _match(sub, [*toks, 7])
    assert dict(match.device) == {"e0": 2 * BS}
    assert dict(match.other) == {"e0": BS, "e1": 3 * BS, "e2": 3 * BS}


async def test_remote_removals_leave_the_publishers_gpu_alone() -> None:
    sub = subscriber(["e0", "e1"])
    toks = blocks(2, 2, BS)
    sub.handle_frames(frames("kv@e1@m", 0, [
        stored([1, 2], None, toks, BS),
        stored([1, 2], None, toks, BS, medium="CPU", locality="REMOTE"),
        {"type": "BlockRemoved", "block_hashes": [1, 2], "medium": "CPU", "locality": "REMOTE"},
    ]))
    assert sub.index.blocks_of(SHARED_HOLDER) == 0 and sub.index.blocks_of("e1") == 2


async def test_without_remote_events_the_match_is_unchanged() -> None:
    sub = subscriber(["e0", "e1", "e2"])
    toks = blocks(3, 2, BS)
    # an engine's own CPU offload (no locality) stays that engine's slower tier
    sub.handle_frames(frames("kv@e1@m", 0, [stored([1], None, toks[:BS], BS, medium="CPU")]))
    match = await _match(sub, [*toks, 7])
    assert dict(match.device) == {"e1": 0} and dict(match.other) == {"e1": BS}
    assert sub.index.blocks_of(SHARED_HOLDER) == 0


def test_the_shared_tier_size_reaches_metrics() -> None:
    sub = subscriber(["e0"])
    sub.handle_frames(frames("kv@e0", 0, [
        stored([1], None, [1, 2], 2),
        stored([1, 2], None, [1, 2, 3, 4], 2, medium="CPU", locality="REMOTE"),
    ]))
    names = {m.name: m for m in sub.collector().collect()}
    assert names["kvgate_kv_index_shared_tier_blocks"].samples[0].value == 2
    assert names["kvgate_kv_index_blocks"].samples[0].value == 3


async def test_a_configured_medium_means_the_shared_store() -> None:
    """vLLM 0.32's Mooncake store connector publishes medium "cpu" without a locality."""
    sub = subscriber(["e0", "e1"], shared_media=["cpu"])
    toks = blocks(4, 2, BS)
    sub.handle_frames(frames("kv@e0@m", 0, [
        stored([1, 2], None, toks, BS, medium="cpu"),
        stored([7], None, blocks(5, 1, BS), BS, medium="CPU"),  # e0's own CPU offload
    ]))
    assert sub.index.blocks_of(SHARED_HOLDER) == 2 and sub.index.blocks_of("e0") == 1
    match = await _match(sub, [*toks, 7])
    assert dict(match.other) == {"e0": 2 * BS, "e1": 2 * BS, "e2": 2 * BS}


async def test_an_engine_loading_the_tier_is_predicted_right() -> None:
    """The engine reports the tier's prefix as cached: the prediction check counts it, so a
    shared tier never makes an engine's predictions look wrong (auto mode keeps it precise)."""
    sub = subscriber(["e0", "e1"], prediction_window=10, prediction_min_checks=5)
    producer = PrefixCacheProducer("pc", PrefixCacheProducer.Params(mode="auto"),
                                   Lookup({"kv-events": sub}), clock=Clock())
    eps = [endpoint("e0"), endpoint("e1")]
    producer.on_endpoints_changed(eps, [])
    toks = blocks(6, 3, BS)
    sub.handle_frames(frames("kv@e0@m", 0, [
        stored([1, 2, 3], None, toks, BS, medium="CPU", locality="REMOTE")]))
    for _ in range(6):
        state = CycleState()
        state.put(TOKEN_IDS, (*toks, 7))
        req = request(Api.COMPLETIONS)
        await producer.prepare(req, state, eps)
        await producer.before_dispatch(req, state, RoutingDecision(target=eps[1]))
        await producer.on_usage(req, state, eps[1], Usage(3 * BS + 1, 1, 3 * BS))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for m in sub.health_state.collector().collect() for s in m.samples}
    assert samples[("kvgate_kv_predictions_total",
                    (("engine", "e1"), ("result", "within_block")))] == 6
