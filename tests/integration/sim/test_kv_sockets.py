"""The ``kv-events`` subscriber against simulated engines over real ZMQ: one socket per engine
that binds (so vLLM's empty default topic and fleet-wide topics work), and gaps filled from the
engine's replay ROUTER socket (vLLM's ``replay_endpoint`` protocol), or reset when it cannot."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from kvgate.engines.sim.core.config import KvEventsConfig, SimConfig
from kvgate.engines.sim.testing import RunningSim, serve_sim
from kvgate.middleware.framework.types import Endpoint
from kvgate.plugins.prefix.events.health import IndexState
from kvgate.plugins.prefix.events.subscriber import KvEventsSubscriber
from tests.servers import free_port
from tests.unit.routing.helpers import NoLookup

from .helpers import eventually, token_prompt

BS = 16


@contextlib.asynccontextmanager
async def _wired(topics: list[str], replay: str | None = None, buffer_steps: int = 10_000,
                 **params: Any) -> AsyncIterator[tuple[list[RunningSim], KvEventsSubscriber]]:
    """Sims binding their KV-event sockets (and a replay socket when ``replay`` is "sim"), a
    started subscriber connected to each, every link warmed up."""
    async with contextlib.AsyncExitStack() as stack:
        sims = []
        for i, topic in enumerate(topics):
            events = KvEventsConfig(endpoint="tcp://127.0.0.1:*", topic=topic,
                                    replay_endpoint="tcp://127.0.0.1:*" if replay else None,
                                    buffer_steps=buffer_steps)
            sims.append(await stack.enter_async_context(serve_sim(SimConfig(
                engine_id=f"sim-{i}", time_scale=0, seed=i, kv_events=events))))
        sub = KvEventsSubscriber("kv-events", KvEventsSubscriber.Params(**params), NoLookup())
        sub.on_endpoints_changed([_endpoint(i, s, replay) for i, s in enumerate(sims)], [])
        await sub.start()
        stack.push_async_callback(sub.stop)
        for i, sim in enumerate(sims):
            await _warm_up(sim, sub, f"e{i}")
        yield sims, sub


def _endpoint(i: int, sim: RunningSim, replay: str | None) -> Endpoint:
    publisher = sim.engine.publisher
    assert publisher is not None
    replay_at = None
    if replay == "sim":
        replay_at = publisher.replay_endpoint
    elif replay is not None:
        replay_at = replay
    return Endpoint(id=f"e{i}", url=sim.url, kind="vllm", kv_events=publisher.endpoint,
                    kv_events_replay=replay_at)


async def _warm_up(sim: RunningSim, sub: KvEventsSubscriber, engine: str) -> None:
    """PUB drops what it sends before the subscription arrives: clear the cache until one of
    the engine's batches gets through."""
    async with httpx.AsyncClient(base_url=sim.url) as client:
        for _ in range(200):
            assert (await client.post("/reset_prefix_cache")).status_code == 200
            with contextlib.suppress(AssertionError):
                await eventually(lambda: sub.health_state.last_event(engine) is not None, 0.05)
                return
    raise AssertionError(f"no KV events from {engine}")


async def _complete(sim: RunningSim, prompt: list[int]) -> None:
    async with httpx.AsyncClient(base_url=sim.url) as client:
        resp = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        assert resp.status_code == 200


def _held_blocks(sub: KvEventsSubscriber, prompt: list[int], engine: str) -> int:
    import time

    found = sub.index.match_tokens(prompt, time.monotonic(), block_size=BS)
    return sum(found.get(engine, (0, 0))) // BS


@pytest.mark.parametrize("topics", [["", ""], ["kv", "kv"], ["kv@sim-1", "kv@sim-0"]],
                         ids=["vLLM's empty topic", "one topic for the fleet", "crossed topics"])
async def test_each_engine_on_its_own_socket_whatever_the_topic(topics: list[str]) -> None:
    async with _wired(topics) as (sims, sub):
        prompts = [token_prompt(40, seed=10 + i) for i in range(2)]
        for sim, prompt in zip(sims, prompts, strict=True):
            await _complete(sim, prompt)
        await eventually(lambda: all(_held_blocks(sub, p, f"e{i}") == 2
                                     for i, p in enumerate(prompts)))
        assert _held_blocks(sub, prompts[0], "e1") == _held_blocks(sub, prompts[1], "e0") == 0
        assert sub.stats.unknown_topics == 0
        assert [sub.health_state.state(e) for e in ("e0", "e1")] == [IndexState.EXACT] * 2


REPLAY_CASES = [
    # (case, replay socket, buffer_steps, result, prompts indexed after the gap)
    ("filled from the replay buffer", "sim", 10_000, "filled", [True, True, True]),
    ("buffer too short: reset", "sim", 1, "failed", [False, False, True]),
    ("no answer: reset", "dead", 10_000, "failed", [False, False, True]),
]


@pytest.mark.parametrize(("case", "replay", "buffer_steps", "result", "indexed"), REPLAY_CASES,
                         ids=[c[0] for c in REPLAY_CASES])
async def test_sequence_gap_and_replay(case: str, replay: str, buffer_steps: int, result: str,
                                       indexed: list[bool],
                                       caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    address = replay if replay == "sim" else f"tcp://127.0.0.1:{free_port()}"
    async with _wired([""], address, buffer_steps, replay_timeout_s=0.5) as ([sim], sub):
        publisher = sim.engine.publisher
        assert publisher is not None
        publisher.withhold(2)  # the next two batches never reach the subscriber
        prompts = [token_prompt(40, seed=20 + i) for i in range(3)]
        for prompt in prompts:
            await _complete(sim, prompt)
        await eventually(lambda: sum(sub.stats.replays.values()) == 1, 5.0)
        assert publisher.stats.withheld == 2
        assert sub.stats.sequence_gaps == 1
        assert sub.stats.replays[result] == 1
        assert [_held_blocks(sub, p, "e0") == 2 for p in prompts] == indexed
        assert sub.health_state.state("e0") is IndexState.EXACT
        lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("engine e0 exact -> degraded: lost KV-event batches" in m for m in lines)
        assert any("engine e0 degraded -> exact" in m for m in lines)
        assert any("could not fill" in m for m in lines) is (result == "failed")
        if result == "filled":
            assert publisher.stats.replays == 1


HISTORY_CASES = [
    # (case, replay socket, buffer_steps, result, earlier prompts indexed)
    ("caught up from the replay buffer", "sim", 10_000, "caught_up", True),
    ("buffer of one batch: only the latest", "sim", 1, "caught_up", False),
    ("no replay socket", None, 10_000, "failed", False),
    ("no answer", "dead", 10_000, "failed", False),
]


@pytest.mark.parametrize(("case", "replay", "buffer_steps", "result", "earlier_indexed"),
                         HISTORY_CASES, ids=[c[0] for c in HISTORY_CASES])
async def test_history_at_first_contact(case: str, replay: str | None, buffer_steps: int,
                                        result: str, earlier_indexed: bool) -> None:
    """Prompts served before the gateway listened are indexed from the engine's replay buffer
    when it first hears from the engine; otherwise the index starts from that batch."""
    events = KvEventsConfig(endpoint="tcp://127.0.0.1:*", buffer_steps=buffer_steps,
                            replay_endpoint="tcp://127.0.0.1:*" if replay else None)
    address = replay if replay != "dead" else f"tcp://127.0.0.1:{free_port()}"
    async with serve_sim(SimConfig(engine_id="sim-0", time_scale=0, seed=0,
                                   kv_events=events)) as sim:
        earlier = [token_prompt(40, seed=30 + i) for i in range(3)]
        for prompt in earlier:  # published with nobody listening
            await _complete(sim, prompt)
        sub = KvEventsSubscriber("kv-events", KvEventsSubscriber.Params(replay_timeout_s=0.5),
                                 NoLookup())
        sub.on_endpoints_changed([_endpoint(0, sim, address)], [])
        await sub.start()
        try:
            later = await _first_heard(sim, sub)
            await eventually(lambda: sum(sub.stats.history.values()) == 1, 5.0)
            assert sub.stats.history[result] == 1
            await eventually(lambda: _held_blocks(sub, later, "e0") == 2, 5.0)
            assert [_held_blocks(sub, p, "e0") == 2 for p in earlier] == [earlier_indexed] * 3
            assert sub.stats.sequence_gaps == 0 and sub.stats.replays == {"filled": 0,
                                                                          "failed": 0}
            assert sub.health_state.state("e0") is IndexState.EXACT  # a history is no loss
        finally:
            await sub.stop()


async def _first_heard(sim: RunningSim, sub: KvEventsSubscriber) -> list[int]:
    """New prompts until one's batch reaches the subscriber (PUB drops what it sends before
    the subscription arrives); the last prompt sent."""
    for i in range(200):
        prompt = token_prompt(40, seed=100 + i)
        await _complete(sim, prompt)
        with contextlib.suppress(AssertionError):
            await eventually(lambda: sub.stats.messages > 0, 0.05)
            return prompt
    raise AssertionError("no KV events from e0")
