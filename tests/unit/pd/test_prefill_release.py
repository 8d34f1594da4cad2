"""The prefill engine's load is released when the prefill hop ends, not when decode does."""

from __future__ import annotations

import time

import pytest

from kvgate.middleware.framework.types import (
    Api,
    CycleState,
    Endpoint,
    InferenceRequest,
    Role,
    RoutingDecision,
)
from kvgate.plugins.load.loads import IDLE, Charge, EngineLoad, LoadTracker
from kvgate.plugins.load.token_load import TokenLoadScorer
from tests.plugin_helpers import NoLookup


@pytest.mark.parametrize(("charges", "endpoint", "released", "after"), [
    # two-hop: the prefill engine keeps the dispatch (requests) but no prefill tokens
    ([Charge("p", 100, 0), Charge("d", 0, 50)], "p", True,
     {"p": EngineLoad(0, 0, 1), "d": EngineLoad(0, 50, 1)}),
    # an engine with no prefill charge: nothing to release
    ([Charge("p", 100, 0), Charge("d", 0, 50)], "d", False,
     {"p": EngineLoad(100, 0, 1), "d": EngineLoad(0, 50, 1)}),
    # one-hop: the engine's own prefill part only
    ([Charge("e", 100, 50)], "e", True, {"e": EngineLoad(0, 50, 1)}),
])
def test_release_prefill(charges: list[Charge], endpoint: str, released: bool,
                         after: dict[str, EngineLoad]) -> None:
    tracker = LoadTracker(16, 900)
    ticket = tracker.charge("r", charges, 0.0)
    assert tracker.release_prefill(ticket, endpoint) is released
    assert {ep: tracker.load(ep) for ep in after} == after
    assert not tracker.release_prefill(ticket, endpoint)  # at most once
    assert tracker.release(ticket)
    assert all(tracker.load(ep) == IDLE for ep in after)  # the rest goes at completion
    assert not tracker.release_prefill(ticket, endpoint)  # unknown ticket


async def test_scorer_releases_on_prefill_done() -> None:
    scorer = TokenLoadScorer("t", TokenLoadScorer.Params(), NoLookup())
    pre = Endpoint("p", "http://p", "vllm", role=Role.PREFILL)
    dec = Endpoint("d", "http://d", "vllm", role=Role.DECODE)
    req = InferenceRequest("r", Api.CHAT, "m", {"max_tokens": 10}, {}, False, False, 500,
                           time.monotonic())
    state = CycleState()
    await scorer.before_dispatch(req, state, RoutingDecision(target=dec, prefill=pre))
    assert scorer.tracker.load("p").prefill_tokens == 500
    await scorer.on_prefill_done(req, state, pre, True)
    assert scorer.tracker.load("p").prefill_tokens == 0
    assert scorer.tracker.load("d").decode_tokens == 10
