"""Builders shared by the routing/load plugin tests."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

from kvgate.middleware.framework.types import Api, Endpoint, InferenceRequest, Role
from kvgate.plugins.load.session_affinity import SessionAffinityScorer
from kvgate.plugins.load.token_load import TokenImbalanceFilter, TokenLoadScorer
from tests.plugin_helpers import prompt_of


class Lookup:
    """The plugin-lookup handle, over a plain mapping."""

    def __init__(self, plugins: Mapping[str, object] | None = None) -> None:
        self.plugins = dict(plugins or {})

    def lookup(self, name: str) -> object:
        return self.plugins[name]


def ep(
    name: str, in_flight: int = 0, healthy: bool = True, role: Role = Role.BOTH
) -> Endpoint:
    return Endpoint(
        id=name, url=f"http://{name}", kind="vllm", role=role, healthy=healthy,
        in_flight_requests=in_flight, models=frozenset({"m"}),
    )


def fleet(n: int) -> list[Endpoint]:
    return [ep(f"e{i}") for i in range(n)]


def req(
    headers: Mapping[str, str] | None = None, *, tenant: str | None = None, model: str = "m",
    body: dict[str, Any] | None = None, estimate: int = 100, rid: str = "r1",
) -> InferenceRequest:
    return InferenceRequest(
        request_id=rid, api=Api.CHAT, model=model, body=dict(body or {}),
        headers=dict(headers or {}), stream=False, client_wants_usage=False,
        prompt_token_estimate=estimate, received_at=time.monotonic(), tenant=tenant,
        prompt=prompt_of(Api.CHAT, body),
    )


def session_scorer(**params: Any) -> SessionAffinityScorer:
    p = SessionAffinityScorer.Params.model_validate(params)
    return SessionAffinityScorer("session-affinity-scorer", p, Lookup())


def load_scorer(**params: Any) -> TokenLoadScorer:
    p = TokenLoadScorer.Params.model_validate(params)
    return TokenLoadScorer("token-load-scorer", p, Lookup())


def imbalance_filter(scorer: TokenLoadScorer, **params: Any) -> TokenImbalanceFilter:
    p = TokenImbalanceFilter.Params.model_validate(params)
    return TokenImbalanceFilter(
        "token-imbalance-filter", p, Lookup({"token-load-scorer": scorer})
    )


class FakeClock:
    """A monotonic clock the test advances by hand."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


async def until(check: object, limit_s: float = 5.0) -> None:
    """Wait (polling every 20 ms) until ``check()`` holds; AssertionError after ``limit_s``."""
    assert callable(check)
    for _ in range(int(limit_s / 0.02)):
        if check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")
