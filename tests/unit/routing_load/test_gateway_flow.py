"""Session affinity and token load inside the real request path: create_app in front of two
in-process simulated engines (no sleeping: time_scale 0)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from pydantic import BaseModel, ConfigDict

from kvgate.engines.sim.core.config import SimConfig
from kvgate.engines.sim.testing import serve_sim
from kvgate.engines.vllm import VllmAdapter
from kvgate.middleware.app import KvgateApp, create_app
from kvgate.middleware.framework.composition.config import parse_config
from kvgate.middleware.framework.composition.registry import Registry
from kvgate.middleware.framework.plugin import CompletionHook, Plugin, PluginLookup, UsageHook
from kvgate.middleware.framework.types import CycleState, Endpoint, InferenceRequest, Outcome, Usage
from kvgate.plugins.load.session_affinity import SessionAffinityScorer
from kvgate.plugins.load.token_load import TokenImbalanceFilter, TokenLoadScorer
from tests.unit.middleware.fakes import Best

SES = "ses_f84c6ba38ffe6UeTRaX25G3KTr"


class Failing(Plugin, UsageHook, CompletionHook):
    """A usage/completion hook that raises in the step named by ``fail_in``."""

    type_name = "failing-hook"

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")
        fail_in: str = "none"

    def __init__(self, name: str, params: BaseModel, plugins: PluginLookup) -> None:
        super().__init__(name, params, plugins)
        assert isinstance(params, Failing.Params)
        self.fail_in = params.fail_in

    async def on_usage(self, req: InferenceRequest, state: CycleState, target: Endpoint,
                       usage: Usage) -> None:
        if self.fail_in == "usage":
            raise ValueError("usage hook failed")

    async def on_complete(self, req: InferenceRequest, state: CycleState, target: Endpoint,
                          outcome: Outcome) -> None:
        if self.fail_in == "complete":
            raise ValueError("completion hook failed")


def _config(urls: list[str], fail_in: str = "none") -> dict[str, Any]:
    return {
        "engines": [{"name": f"e{i}", "url": url, "models": ["sim-model"]}
                    for i, url in enumerate(urls)],
        "plugins": [
            {"type": "failing-hook", "params": {"fail_in": fail_in}},  # runs first
            {"type": "session-affinity-scorer"},
            {"type": "token-load-scorer"},
            {"type": "token-imbalance-filter"},
            {"type": "best"},
        ],
        "profiles": [{"name": "default", "plugins": [
            {"ref": "token-imbalance-filter"},
            {"ref": "session-affinity-scorer", "weight": 2},
            {"ref": "token-load-scorer", "weight": 1},
            {"ref": "best"},
        ]}],
    }


@contextlib.asynccontextmanager
async def _gateway(fail_in: str = "none") -> AsyncIterator[tuple[KvgateApp, httpx.AsyncClient]]:
    sim = SimConfig(time_scale=0)
    async with serve_sim(sim) as a, serve_sim(sim) as b:
        registry = Registry(
            plugins={c.type_name: c for c in (SessionAffinityScorer, TokenLoadScorer,
                                              TokenImbalanceFilter, Best, Failing)},
            engines={"vllm": VllmAdapter},
        )
        app = create_app(parse_config(_config([a.url, b.url], fail_in), "test"), registry)
        transport = httpx.ASGITransport(app=app)
        async with app.running(), httpx.AsyncClient(
            transport=transport, base_url="http://gw"
        ) as client:
            yield app, client


def _body(i: int, stream: bool = False) -> dict[str, Any]:
    return {"model": "sim-model", "max_tokens": 4, "stream": stream,
            "messages": [{"role": "user", "content": f"turn {i}"}]}


async def test_session_sticks_echoes_and_releases_load() -> None:
    async with _gateway() as (app, client):
        engines = set()
        for i in range(6):
            resp = await client.post("/v1/chat/completions", json=_body(i, stream=i % 2 == 1),
                                     headers={"X-Session-Affinity": SES})
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-session-affinity"] == SES
            engines.add(resp.headers["x-kvgate-engine"])
        assert len(engines) == 1
        scorer = app.pipeline.plugins["token-load-scorer"]
        assert isinstance(scorer, TokenLoadScorer)
        assert len(scorer.tracker) == 0
        assert scorer.tracker.stats.charged == scorer.tracker.stats.released == 6


async def test_bad_session_header_is_400() -> None:
    async with _gateway() as (_, client):
        resp = await client.post("/v1/chat/completions", json=_body(0),
                                 headers={"x-session-id": "x" * 300})
        assert resp.status_code == 400
        error = resp.json()["error"]
        assert error["param"] == "x-session-id"
        assert error["type"] == "invalid_request_error"


async def test_no_session_header_no_echo() -> None:
    async with _gateway() as (_, client):
        resp = await client.post("/v1/chat/completions", json=_body(0))
        assert resp.status_code == 200
        assert "x-session-affinity" not in resp.headers


@pytest.mark.parametrize(("fail_in", "stream"), [("complete", False), ("complete", True)])
async def test_a_failing_hook_does_not_leak_token_load(fail_in: str, stream: bool) -> None:
    """Regression: a completion hook that raised (e.g. billing's ledger) skipped the completion
    hooks after it, so the token-load charge stayed until swept 15 minutes later. (A usage hook
    failing at the end of a stream: tests/integration/test_cache_aware_outcomes.py, over real
    HTTP, since the response cannot be completed then.)"""
    async with _gateway(fail_in) as (app, client):
        with contextlib.suppress(httpx.HTTPError):
            await client.post("/v1/chat/completions", json=_body(0, stream=stream))
        scorer = app.pipeline.plugins["token-load-scorer"]
        assert isinstance(scorer, TokenLoadScorer)
        assert scorer.tracker.stats.charged == scorer.tracker.stats.released == 1
        assert len(scorer.tracker) == 0
