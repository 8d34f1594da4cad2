"""Cross-check against the simulated engine: its real ZMQ KV events (both encodings) must leave
the index agreeing, block for block, with each engine's own prefix cache, evictions included."""

from __future__ import annotations

import asyncio
import random

import pytest

from kvgate.engines.sim.core.config import KvEventsConfig, SimConfig
from kvgate.engines.sim.core.engine import SimEngine
from kvgate.engines.sim.core.scheduler import SeqSpec
from kvgate.plugins.prefix.events.subscriber import KvEventsSubscriber
from kvgate.plugins.prefix.index.index import chain_hashes, request_extra_keys
from tests.unit.routing.helpers import NoLookup, endpoint

BS = 16
TIMEOUT_S = 10.0


async def _wait(cond: object, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + TIMEOUT_S
    while not cond():  # type: ignore[operator]
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


def _engine(name: str, address: str, encoding: str) -> SimEngine:
    events = KvEventsConfig(endpoint=address, topic=f"kv@{name}@sim-model",
                            encoding=encoding)
    return SimEngine(SimConfig(engine_id=name, block_size=BS, capacity_blocks=48, time_scale=0,
                               kv_events=events))


async def _connect(sub: KvEventsSubscriber, engine: SimEngine, rng: random.Random) -> None:
    """Run throwaway requests until the subscriber hears the engine, then clear its cache, so
    both start from the same (empty) state."""
    name = engine.config.engine_id
    while sub.stats.messages == 0 or sub.index.blocks_of(name) == 0:
        await engine.submit(SeqSpec(f"warm-{rng.random()}", [rng.randrange(16, 999)
                                                              for _ in range(BS)], 1)).result()
        await asyncio.sleep(0.01)
    assert engine.reset_prefix_cache()
    await _wait(lambda: sub.index.blocks_of(name) == 0, "the clear")


def _sent(engines: list[SimEngine]) -> int:
    return sum(e.publisher.stats.sent for e in engines if e.publisher is not None)


def _prompts(rng: random.Random) -> list[tuple[list[int], str | None]]:
    shared = [[rng.randrange(16, 30_000) for _ in range(n * BS)] for n in (2, 4, 7)]
    out = []
    for _ in range(40):
        head = rng.choice(shared)
        tail = [rng.randrange(16, 30_000) for _ in range(rng.randrange(0, 3 * BS))]
        out.append((head + tail, rng.choice([None, None, "tenant-a"])))
    return out


@pytest.mark.parametrize("encoding", ["tagged", "positional"])
async def test_index_mirrors_simulated_engines(encoding: str) -> None:
    rng = random.Random(7)
    sub = KvEventsSubscriber("kv-events", KvEventsSubscriber.Params(bind="tcp://127.0.0.1:*"),
                             NoLookup())
    sub.on_endpoints_changed([endpoint("s0"), endpoint("s1")], [])
    await sub.start()
    assert sub.bound_address is not None
    engines = [_engine(n, sub.bound_address, encoding) for n in ("s0", "s1")]
    try:
        for engine in engines:
            await _connect(sub, engine, rng)
        # every batch published so far has arrived or was lost while connecting
        lost = _sent(engines) - sub.stats.messages
        prompts = _prompts(random.Random(11))
        for i, (prompt, salt) in enumerate(prompts):
            engine = rng.choice(engines)
            await engine.submit(SeqSpec(f"r{i}", prompt, rng.randint(1, 40), cache_salt=salt,
                                        ignore_eos=True)).result()
        await _wait(lambda: sub.stats.messages + lost >= _sent(engines), "every batch")
        assert sub.stats.malformed_messages == sub.stats.malformed_events == 0
        assert sub.stats.sequence_gaps == 0
        assert sub.index.stats.evicted_blocks == 0  # only the engines evicted
        removed = sub.stats.events_applied["BlockRemoved"]
        assert removed > 0, "the workload should overflow the 48-block caches"
        hits = 0
        for prompt, salt in prompts:
            extra = request_extra_keys(len(prompt) // BS, None, salt)
            found = sub.index.match({BS: chain_hashes(prompt, BS, extra_keys=extra)}, 0.0)
            for engine in engines:
                want = engine.scheduler.cache.match(prompt, salt)
                got = found.get(engine.config.engine_id, (0, 0))
                assert got == (want, 0), (engine.config.engine_id, salt, len(prompt))
                hits += want > 0
        assert hits >= 10, "the probes should find cached prefixes"
    finally:
        for engine in engines:
            await engine.aclose()
        await sub.stop()
