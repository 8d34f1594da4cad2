"""``prefix-cache-producer`` mode auto (per-engine precise or approximate), the prediction
check against the engine's cached_tokens, and the record bound learnt from KV capacity."""

from __future__ import annotations

from typing import Any

import pytest

from kvgate.middleware.framework.types import (
    Api,
    CycleState,
    Endpoint,
    EngineMetrics,
    RoutingDecision,
    Usage,
)
from kvgate.plugins.common.state import PREFIX_MATCH, TOKEN_IDS, TOKEN_IDS_INEXACT, PrefixMatch
from kvgate.plugins.prefix.events.health import IndexState
from kvgate.plugins.prefix.events.subscriber import KvEventsSubscriber
from kvgate.plugins.prefix.producer import PrefixCacheProducer
from tests.unit.routing.helpers import (
    Clock,
    Lookup,
    NoLookup,
    blocks,
    cleared,
    frames,
    removed,
    request,
    stored,
)

BS = 16
BIND = "tcp://127.0.0.1:5999"
EPS = [Endpoint(id=f"e{i}", url=f"http://10.0.0.{i}:8000", kind="vllm") for i in range(2)]


def _sub(clock: Clock, **params: Any) -> KvEventsSubscriber:
    sub = KvEventsSubscriber("kv-events", KvEventsSubscriber.Params(
        bind=BIND, prediction_window=10, prediction_min_checks=5, **params), NoLookup())
    sub.health_state.clock = clock
    sub.on_endpoints_changed(EPS, [])
    return sub


def _producer(sub: KvEventsSubscriber | None, clock: Clock, **params: Any) -> PrefixCacheProducer:
    lookup = NoLookup() if sub is None else Lookup({"kv-events": sub})
    producer = PrefixCacheProducer(
        "pc", PrefixCacheProducer.Params(**{"mode": "auto", "block_size": BS, **params}), lookup,
        clock=clock)
    producer.on_endpoints_changed(EPS, [])
    return producer


async def _serve(producer: PrefixCacheProducer, tokens: list[int], target: str,
                 cached: int | None = None, *, prefill: str | None = None,
                 inexact: str | None = None, eps: list[Endpoint] | None = None,
                 prompt_tokens: int | None = None) -> PrefixMatch:
    """prepare -> dispatch -> usage of one request; returns its PREFIX_MATCH."""
    state = CycleState()
    state.put(TOKEN_IDS, tuple(tokens))
    if inexact is not None:
        state.put(TOKEN_IDS_INEXACT, inexact)
    req = request(Api.COMPLETIONS)
    eps = EPS if eps is None else eps
    await producer.prepare(req, state, eps)
    by_id = {ep.id: ep for ep in eps}
    decision = RoutingDecision(target=by_id[target],
                               prefill=None if prefill is None else by_id[prefill])
    await producer.before_dispatch(req, state, decision)
    if cached is not None or prompt_tokens is not None:
        usage = Usage(prompt_tokens if prompt_tokens is not None else len(tokens), 1, cached)
        await producer.on_usage(req, state, by_id[target], usage)
    return state.require(PREFIX_MATCH)


async def test_auto_without_kv_events_is_approximate_everywhere() -> None:
    clock = Clock()
    producer = _producer(None, clock)
    toks = blocks(1, 3, BS)
    first = await _serve(producer, toks, "e1")
    again = await _serve(producer, toks, "e0")
    assert not first.device and not first.precise
    assert dict(again.device) == {"e1": 3 * BS}
    assert again.precise_engines == frozenset()
    section = producer.health()
    engines = section["engines"]
    assert isinstance(engines, dict)
    assert engines["e0"]["state"] == "approximate"
    assert "no kv-events plugin 'kv-events' is configured" in engines["e0"]["reason"]
    names = {s.name for m in producer.collector().collect() for s in m.samples}
    assert "kvgate_kv_index_state" in names


async def test_auto_routes_exact_engines_precisely_and_degraded_ones_on_the_record() -> None:
    clock = Clock()
    sub = _sub(clock)
    producer = _producer(sub, clock, speculative_ttl_s=0)
    toks = blocks(2, 4, BS)
    await _serve(producer, toks, "e0")  # recorded for e0 by the gateway, no event yet
    sub.handle_frames(frames("kv@e1", 0, [stored([1, 2], None, toks[: 2 * BS], BS)]))
    match = await _serve(producer, toks, "e1")
    assert match.precise and match.precise_engines == {"e0", "e1"}
    assert dict(match.device) == {"e1": 2 * BS}  # e0's record is not trusted while exact
    sub.health_state.gap_opened("e0", "lost batches")
    match = await _serve(producer, toks, "e1")
    assert not match.precise and match.precise_engines == {"e1"}
    assert dict(match.device) == {"e0": 4 * BS, "e1": 2 * BS}
    assert producer.health() == {}  # kv-events owns the states and shows them


PREDICTIONS = [
    # (case, event blocks held, prompt tokens, reported cached, result)
    ("cold", 0, 3 * BS + 5, 0, "within_block"),
    ("warm exact", 3, 3 * BS + 5, 3 * BS, "within_block"),
    ("fully cached prompt capped at its last token", 4, 4 * BS, 3 * BS, "within_block"),
    ("one block short is within", 3, 3 * BS + 5, 2 * BS, "within_block"),
    ("engine lost the blocks", 3, 3 * BS + 5, 0, "over"),
    ("engine holds more than the index", 0, 3 * BS + 5, 3 * BS, "under"),
]


@pytest.mark.parametrize(("case", "held", "n_tokens", "cached", "result"), PREDICTIONS,
                         ids=[c[0] for c in PREDICTIONS])
async def test_prediction_against_reported_cached_tokens(
        case: str, held: int, n_tokens: int, cached: int, result: str) -> None:
    clock = Clock()
    sub = _sub(clock)
    producer = _producer(sub, clock, mode="precise")
    toks = blocks(3, 5, BS)[:n_tokens]
    if held:
        sub.handle_frames(frames("kv@e0", 0, [stored(list(range(1, held + 1)), None,
                                                      toks[: held * BS], BS)]))
    await _serve(producer, toks, "e0", cached)
    clock.now += 2  # an unexplained over waits settle_s for the engine's next batch
    sub.health_state.tick()
    assert sub.health_state.results("e0")[result] == 1
    assert sum(sub.health_state.results("e0").values()) == 1


async def test_a_miss_on_a_concurrent_requests_blocks_is_speculative() -> None:
    """Two requests on a new prefix dispatched back to back: the second is predicted to hit the
    first's speculative entries, the engine had not computed them yet (reports 0): counted as
    ``speculative``, not as the index being wrong."""
    clock = Clock()
    sub = _sub(clock)
    producer = _producer(sub, clock, mode="precise")
    toks = blocks(6, 4, BS)
    await _serve(producer, toks, "e0")  # dispatched, no usage yet: a speculative entry
    await _serve(producer, toks, "e0", 0)
    assert sub.health_state.results("e0")["speculative"] == 1
    assert sub.health_state.results("e0")["over"] == 0


async def test_no_check_for_two_hops_or_unreported_cached_tokens() -> None:
    clock = Clock()
    sub = _sub(clock)
    producer = _producer(sub, clock, mode="precise")
    await _serve(producer, blocks(4, 3, BS), "e0", 0, prefill="e1")
    await _serve(producer, blocks(5, 3, BS), "e0", None, prompt_tokens=3 * BS)
    assert sum(sub.health_state.results("e0").values()) == 0


async def test_disagreeing_predictions_fall_back_to_the_record_and_recover() -> None:
    clock = Clock()
    sub = _sub(clock)
    producer = _producer(sub, clock, fallback_after_s=5)
    toks = blocks(6, 4, BS)
    for _ in range(5):  # the engine keeps reporting hits the index knows nothing of
        await _serve(producer, toks, "e0", cached=3 * BS)
        clock.now += 10  # past the speculative entries
    assert sub.health_state.state("e0") is IndexState.DEGRADED
    assert "predictions disagree" in sub.health_state.reason("e0")
    clock.now += 5
    sub.health_state.tick()
    assert sub.health_state.state("e0") is IndexState.APPROXIMATE
    match = await _serve(producer, toks, "e1", cached=0)
    assert dict(match.device) == {"e0": 4 * BS}  # the record, while e0 is approximate
    sub.handle_frames(frames("kv@e0", 0, [stored([1, 2, 3, 4], None, toks, BS)]))
    for _ in range(5):  # events flow again and a new window agrees
        await _serve(producer, toks, "e0", cached=3 * BS)
    assert sub.health_state.state("e0") is IndexState.APPROXIMATE  # hysteresis: held
    assert "recovering" in sub.health_state.reason("e0")
    clock.now += 10  # recover_hold_s clear
    sub.health_state.tick()
    assert sub.health_state.state("e0") is IndexState.EXACT


async def test_pseudo_token_ids_degrade_and_route_on_the_record() -> None:
    clock = Clock()
    sub = _sub(clock)
    producer = _producer(sub, clock)
    toks = blocks(7, 3, BS)
    await _serve(producer, toks, "e1", inexact="approx pseudo-tokens")
    assert sub.health_state.state("e1") is IndexState.DEGRADED
    assert "approx pseudo-tokens" in sub.health_state.reason("e1")
    match = await _serve(producer, toks, "e0", cached=0, inexact="approx pseudo-tokens")
    assert dict(match.device) == {"e1": 3 * BS} and match.precise_engines == frozenset()
    assert sum(sub.health_state.results("e0").values()) == 0  # never compared
    await _serve(producer, toks, "e1")  # the engine's own ids again
    assert sub.health_state.state("e1") is IndexState.EXACT


async def test_record_bounded_by_the_reported_kv_capacity() -> None:
    clock = Clock()
    producer = _producer(None, clock, engine_capacity_blocks=100)
    small = Endpoint(id="e0", url="http://e0", kind="vllm",
                     metrics=EngineMetrics(extra={"kv_capacity_tokens": 4.0 * BS}))
    prompts = [blocks(10 + i, 2, BS) for i in range(3)]
    for toks in prompts:
        await _serve(producer, toks, "e0", eps=[small])
    assert producer.index.blocks_of("e0") == 4
    assert producer.index.capacity_of("e0") == 4
    assert producer.index.capacity_of("e1") == 100  # the param where nothing is reported


async def test_silence_is_reported_through_usage() -> None:
    clock = Clock()
    sub = _sub(clock, silence_s=5)
    producer = _producer(sub, clock, mode="precise")
    await _serve(producer, blocks(8, 3, BS), "e0", cached=0)
    clock.now += 5
    sub.health_state.tick()
    assert sub.health_state.state("e0") is IndexState.DEGRADED
    assert sub.health_state.reason("e0").startswith("silent")


async def test_reported_cached_tokens_teach_the_index_what_no_event_announced() -> None:
    """A restarted gateway (empty index) learns from the engine's cached_tokens what it held
    before: the next turn is matched there; a lower report drops what was learnt beyond it;
    learnt entries expire after learned_ttl_s. Events are not needed for any of it."""
    clock = Clock()
    sub = _sub(clock)
    producer = _producer(sub, clock, learned_ttl_s=300)
    toks = blocks(8, 5, BS)
    first = await _serve(producer, toks, "e0", cached=4 * BS)  # held since before the restart
    assert not first.device
    clock.now += 10  # past the speculative entries
    again = await _serve(producer, toks, "e1", cached=0)
    assert dict(again.device).get("e0") == 4 * BS
    assert sub.index.stats.learned_blocks == 4
    clock.now += 10
    await _serve(producer, toks, "e0", cached=1 * BS)  # the engine evicted the rest since
    assert sub.index.stats.unlearned_blocks == 3
    clock.now += 10
    after = await _serve(producer, toks, "e1", cached=0)
    assert dict(after.device).get("e0") == 1 * BS
    clock.now += 301
    gone = await _serve(producer, toks, "e1", cached=0)
    assert "e0" not in dict(gone.device)


async def test_learnt_entries_do_not_hide_missing_events_from_the_health_check() -> None:
    """Routing uses what usage taught, but the prediction judged for health is what the index
    knew without it: an engine whose hits no event ever announces still goes degraded."""
    clock = Clock()
    sub = _sub(clock)
    producer = _producer(sub, clock)
    toks = blocks(9, 4, BS)
    matches = []
    for _ in range(6):
        matches.append(await _serve(producer, toks, "e0", cached=3 * BS))
        clock.now += 10
    # learnt and used while exact; then degraded: routed on the gateway's record (all 4 blocks)
    assert [dict(m.device).get("e0") for m in matches[1:]] == [3 * BS] * 4 + [4 * BS]
    assert sub.health_state.state("e0") is not IndexState.EXACT
    assert sub.health_state.results("e0")["under"] >= 5


async def test_speculation_lasts_past_the_end_of_a_long_request() -> None:
    """A prefill longer than speculative_ttl_s (busy engine): the entries still cover the next
    turn, sent right after the answer, until the engine's events arrive."""
    clock = Clock()
    sub = _sub(clock)
    producer = _producer(sub, clock, speculative_ttl_s=2)
    toks = blocks(10, 3, BS)
    state = CycleState()
    state.put(TOKEN_IDS, tuple(toks))
    req = request(Api.COMPLETIONS)
    await producer.prepare(req, state, EPS)
    await producer.before_dispatch(req, state, RoutingDecision(target=EPS[0]))
    clock.now += 5  # the request took 5 s: dispatch-time speculation alone would have lapsed
    await producer.on_usage(req, state, EPS[0], Usage(len(toks), 1, 0))
    clock.now += 1
    nxt = await _serve(producer, toks, "e1")
    assert dict(nxt.device) == {"e0": 3 * BS}
    clock.now += 2
    late = await _serve(producer, toks, "e1")
    assert "e0" not in dict(late.device)  # no event ever came: it lapses 2 s after the end


@pytest.mark.parametrize(("took_s", "lives_until"), [
    (0.1, 2.0),  # under a quarter of the TTL: not re-recorded, lapses 2 s after dispatch
    (1.0, 3.0),  # longer: extended to 2 s past the end
])
async def test_speculation_is_extended_only_past_a_quarter_of_its_ttl(
        took_s: float, lives_until: float) -> None:
    """Re-recording a prompt's speculation at usage is a pass over all its blocks; a request
    that took under TTL/4 keeps its dispatch-time entries (>= 3/4 of the TTL past its end)."""
    clock = Clock()
    sub = _sub(clock)
    producer = _producer(sub, clock, speculative_ttl_s=2)
    toks = blocks(12, 3, BS)
    state = CycleState()
    state.put(TOKEN_IDS, tuple(toks))
    req = request(Api.COMPLETIONS)
    start = clock.now
    await producer.prepare(req, state, EPS)
    await producer.before_dispatch(req, state, RoutingDecision(target=EPS[0]))
    clock.now += took_s
    await producer.on_usage(req, state, EPS[0], Usage(len(toks), 1, 0))
    clock.now = start + lives_until - 0.01
    assert dict((await _serve(producer, toks, "e1")).device) == {"e0": 3 * BS}
    clock.now = start + lives_until + 0.01
    assert "e0" not in dict((await _serve(producer, toks, "e1")).device)


OTHER_BLOCK = stored([9], None, blocks(8, 1, BS), BS)


@pytest.mark.parametrize(("removed_in_flight", "after_usage", "result"), [
    ([removed([3]), removed([2])], False, "evicted"),  # evicted while the request was in flight
    ([removed([3]), removed([2])], True, "evicted"),  # ... their batch trailing the usage
    ([OTHER_BLOCK], True, "over"),  # the next batch removed nothing: the index was wrong
    ([], False, "over"),  # no batch at all: judged after settle_s
    # vLLM publishes a reset after its next step: on an idle engine, the step of the request
    # routed on the index from before it (seen on a real engine: after the usage)
    ([cleared(), OTHER_BLOCK], False, "evicted"),
    ([cleared(), OTHER_BLOCK], True, "evicted"),
])
async def test_a_miss_on_blocks_evicted_in_flight_is_not_held_against_the_index(
        removed_in_flight: list[Any], after_usage: bool, result: str) -> None:
    """Under KV pressure the engine may evict blocks between routing and admission; their
    ``BlockRemoved`` arrives after the dispatch. Such an ``over`` is counted as ``evicted`` and
    left out of the agreement window, so a pressured engine's index state does not flap. The
    same for a cache reset (``AllBlocksCleared``) that arrives after the dispatch."""
    clock = Clock()
    sub = _sub(clock)
    producer = _producer(sub, clock, mode="precise", speculative_ttl_s=0)
    toks = blocks(7, 3, BS)
    sub.handle_frames(frames("kv@e0", 0, [stored([1, 2, 3], None, toks, BS)]))
    state = CycleState()
    state.put(TOKEN_IDS, (*toks, 1))
    req = request(Api.COMPLETIONS)
    await producer.prepare(req, state, EPS)
    assert state.require(PREFIX_MATCH).device == {"e0": 3 * BS}
    await producer.before_dispatch(req, state, RoutingDecision(target=EPS[0]))
    if removed_in_flight and not after_usage:
        sub.handle_frames(frames("kv@e0", 1, removed_in_flight))
    await producer.on_usage(req, state, EPS[0], Usage(len(toks) + 1, 1, BS))
    if removed_in_flight and after_usage:  # an over waits for the engine's next batch
        assert sum(sub.health_state.results("e0").values()) == 0
        sub.handle_frames(frames("kv@e0", 1, removed_in_flight))
    clock.now += 2
    sub.health_state.tick()
    assert sub.health_state.results("e0")[result] == 1
    assert sum(sub.health_state.results("e0").values()) == 1


#: How an engine's cache empties, as its KV events tell it: vLLM publishes AllBlocksCleared
#: from ``BlockPool.reset_prefix_cache`` (``POST /reset_prefix_cache``, and ``sleep`` at level
#: >= 1 through ``EngineCore._reset_caches``); a restarted engine's sequence starts over at 0.
RESETS = [
    ("reset_prefix_cache or sleep (AllBlocksCleared)", lambda seq: [cleared()]),
    ("restart (sequence back to 0)", lambda seq: None),
]


@pytest.mark.parametrize(("name", "events"), RESETS, ids=[r[0] for r in RESETS])
async def test_an_engine_cache_reset_clears_what_routing_knows_of_it(name: str,
                                                                    events: Any) -> None:
    """Everything the producer routes an engine on goes with its cache: the event entries,
    the speculative entries of a request just dispatched there, and what its reported
    cached_tokens taught; the other engine's entries stay."""
    clock = Clock()
    sub = _sub(clock)
    producer = _producer(sub, clock, mode="precise")
    toks, taught = blocks(11, 4, BS), blocks(12, 4, BS)
    for engine in ("kv@e0", "kv@e1"):
        sub.handle_frames(frames(engine, 0, [stored([1, 2, 3, 4], None, toks, BS)]))
    await _serve(producer, taught, "e0", cached=3 * BS)  # learnt: 3 blocks no event announced
    await _serve(producer, toks + blocks(13, 2, BS), "e0", cached=4 * BS)  # speculative: 6
    before = await _serve(producer, toks + blocks(13, 2, BS), "e1")
    assert (before.device.get("e0"), before.device.get("e1")) == (6 * BS, 4 * BS)
    batch = events(1)
    if batch is None:  # the new process publishes its first batch with seq 0
        batch = [stored([9], None, blocks(14, 1, BS), BS)]
    sub.handle_frames(frames("kv@e0", 0 if events(1) is None else 1, batch))
    after = await _serve(producer, toks + blocks(13, 2, BS), "e1")
    assert (after.device.get("e0"), after.device.get("e1")) == (None, 6 * BS)
    assert (await _serve(producer, taught, "e1")).device.get("e0") is None
