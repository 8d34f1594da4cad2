"""A restarted gateway sends each session back to the engine it used before the restart: the
quick start's default preset in front of two simulated engines, the gateway stopped (its
lifespan writes the routing state) and a fresh app started over the same fleet
(middleware/serving/routing_state.py)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from kvgate.engines.ports import free_port
from kvgate.engines.sim.demo import cache_aware_config, sim_config
from kvgate.engines.sim.testing import serve_sim
from kvgate.middleware.app import create_app
from kvgate.middleware.framework.composition.config import GatewayConfig
from tests.servers import serve_asgi

SESSIONS = 8
HEADER = "x-session-affinity"


def _body(session: int, turn: int) -> dict[str, object]:
    """Session 0 is ten times the others: the cache pressure it puts on its engine sends the
    next new sessions to the other engine whatever their session hash says, so where a session
    lives is placement's decision, which a restart without the state file forgets."""
    size = 120 * (turn + 1) * (10 if session == 0 else 1)
    words = " ".join(f"s{session}w{k}" for k in range(size))
    return {"model": "sim-model", "max_tokens": 4, "ignore_eos": True,
            "messages": [{"role": "user", "content": words}]}


async def _turn(url: str, turn: int) -> tuple[dict[int, str], dict[str, object]]:
    """One turn of every session: the engine each went to, and the gateway's /health."""
    engines: dict[int, str] = {}
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        order = range(SESSIONS) if turn % 2 == 0 else reversed(range(SESSIONS))
        for s in order:  # another order after the restart: a fresh placement would differ
            resp = await client.post("/v1/chat/completions", json=_body(s, turn),
                                     headers={HEADER: f"session-{s}"})
            assert resp.status_code == 200, resp.text
            engines[s] = resp.headers["x-kvgate-engine"]
        health = (await client.get("/health")).json()
    return engines, health


@contextlib.asynccontextmanager
async def _fleet() -> AsyncIterator[tuple[list[str], str]]:
    events = f"tcp://127.0.0.1:{free_port()}"
    async with contextlib.AsyncExitStack() as stack:
        sims = [await stack.enter_async_context(serve_sim(sim_config(i, events, 0.0)))
                for i in range(2)]
        yield [s.url for s in sims], events


def _config(urls: list[str], events: str, state_dir: Path) -> GatewayConfig:
    config = cache_aware_config(urls, events)
    server = config.server.model_copy(update={"routing_state_dir": str(state_dir)})
    return config.model_copy(update={"server": server})


@pytest.mark.parametrize("keep", [True, False])
async def test_sessions_return_to_their_engines_after_a_restart(tmp_path: Path,
                                                                keep: bool) -> None:
    """With the state file every session's next turn goes back to its engine; the control
    (the restarted gateway without it) places them afresh and moves some."""
    async with _fleet() as (urls, events):
        config = _config(urls, events, tmp_path / "state")
        async with serve_asgi(create_app(config)) as url:
            before, health = await _turn(url, 0)
        assert health["routing_state"]["status"] == "fresh"  # type: ignore[index]
        assert len(set(before.values())) == 2  # the sessions were spread over both engines
        if not keep:
            server = config.server.model_copy(update={"routing_state_dir": None})
            config = config.model_copy(update={"server": server})
        async with serve_asgi(create_app(config)) as url:
            after, health = await _turn(url, 1)
        moved = sum(after[s] != before[s] for s in before)
        if not keep:
            assert moved > 0
            return
        state = health["routing_state"]
        assert state["status"] == "restored", state  # type: ignore[index]
        assert state["restored"]["kv-placement-scorer"] >= SESSIONS  # type: ignore[index]
        assert moved == 0, (before, after)


async def test_without_a_state_dir_nothing_is_written(tmp_path: Path) -> None:
    async with _fleet() as (urls, events):
        config = cache_aware_config(urls, events)
        server = config.server.model_copy(update={"routing_state_dir": None})
        config = config.model_copy(update={"server": server})
        async with serve_asgi(create_app(config)) as url:
            _, health = await _turn(url, 0)
        assert "routing_state" not in health
