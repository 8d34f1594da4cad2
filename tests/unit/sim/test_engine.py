"""The async engine: streaming tokens, abort, bounds, reset, real-time pacing, event queue."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from kvgate.engines.sim.core.config import KvEventsConfig, SimConfig
from kvgate.engines.sim.core.engine import EngineDead, EngineOverloaded, SimEngine
from kvgate.engines.sim.core.kv_events import AllBlocksCleared, BlockRemoved, KvEventPublisher
from kvgate.engines.sim.core.scheduler import SeqSpec


def _spec(rid: str, n: int = 50, max_tokens: int = 5, seed: int = 0) -> SeqSpec:
    rng = random.Random(seed)
    return SeqSpec(rid, [rng.randrange(16, 32_000) for _ in range(n)], max_tokens,
                   ignore_eos=True)


@pytest.mark.parametrize("concurrent", [1, 8])
async def test_tokens_stream_then_end(concurrent: int) -> None:
    engine = SimEngine(SimConfig(time_scale=0))
    try:
        handles = [engine.submit(_spec(f"r{i}", seed=i, max_tokens=6)) for i in range(concurrent)]
        results = await asyncio.gather(*(h.result() for h in handles))
    finally:
        await engine.aclose()
    for handle, toks in zip(handles, results, strict=True):
        assert len(toks) == 6 and toks[-1].finish_reason == "length"
        assert (handle.prompt_tokens, handle.completion_tokens) == (50, 6)
    assert engine.scheduler.cache.used_blocks == 0


async def test_abort_ends_the_stream_and_frees_blocks() -> None:
    engine = SimEngine(SimConfig(time_scale=1.0))
    try:
        handle = engine.submit(_spec("a", max_tokens=1000))
        first = await anext(handle.tokens())
        assert first.finish_reason is None and engine.num_running == 1
        handle.abort()
        assert [t async for t in handle.tokens()] == []
        assert handle.finish_reason == "abort" and engine.num_running == 0
        assert engine.scheduler.cache.used_blocks == 0
    finally:
        await engine.aclose()


async def test_bounds_and_closing() -> None:
    engine = SimEngine(SimConfig(time_scale=1.0, max_num_seqs=1, max_waiting_requests=2))
    pending = [engine.submit(_spec(f"r{i}", max_tokens=1000, seed=i)) for i in range(2)]
    await asyncio.sleep(0.01)  # one admitted, one waiting
    engine.submit(_spec("r2", seed=2))
    with pytest.raises(EngineOverloaded):
        engine.submit(_spec("r3", seed=3))
    await engine.aclose()
    assert all(h.finish_reason == "abort" for h in pending)
    with pytest.raises(EngineDead):
        engine.submit(_spec("late"))


async def test_reset_prefix_cache_publishes_all_cleared() -> None:
    engine = SimEngine(SimConfig(time_scale=1.0))
    try:
        handle = engine.submit(_spec("a", max_tokens=1000))
        await anext(handle.tokens())
        assert engine.reset_prefix_cache() is False  # blocks in use
        handle.abort()
        assert engine.reset_prefix_cache() is True
        assert len(engine.scheduler.cache) == 0
    finally:
        await engine.aclose()


@pytest.mark.parametrize(("time_scale", "steps"), [(1.0, 20), (0.5, 20)])
async def test_real_time_pacing(time_scale: float, steps: int) -> None:
    """20 decode-dominated steps take about their modelled time x time_scale."""
    engine = SimEngine(SimConfig(time_scale=time_scale))
    try:
        handle = engine.submit(_spec("a", n=1, max_tokens=steps))
        start = time.perf_counter()
        await handle.result()
        elapsed = time.perf_counter() - start
    finally:
        await engine.aclose()
    # First step: 1-token prefill (a decode-sized step); then steps - 1 decodes, ~5.4 ms each.
    modelled = engine.timing.decode_step_seconds([1]) * steps * time_scale
    assert modelled * 0.9 < elapsed < modelled * 1.5 + 0.02


def test_publisher_queue_drops_oldest_and_leaves_a_gap() -> None:
    pub = KvEventPublisher(KvEventsConfig(endpoint="tcp://*:0", queue_limit=2), topic="t")
    for i in range(3):
        pub.publish([BlockRemoved([i])])
    pub.publish([])  # empty batches are not sent
    assert pub.stats.dropped == 1 and pub.stats.queued == 3
    assert [seq for seq, _, _ in pub._queue] == [1, 2]
    pub.publish([AllBlocksCleared()])
    assert [seq for seq, _, _ in pub._queue] == [2, 3]
