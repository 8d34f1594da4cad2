"""The routing plugins composed by a config: validation, and a request routed end to end
through producers, scheduler and dispatch hooks (no HTTP)."""

from __future__ import annotations

from typing import Any

import pytest

from kvgate.engines.sim.core import tokenizer as sim_tokenizer
from kvgate.engines.vllm import VllmAdapter
from kvgate.middleware.framework.composition.config import parse_config
from kvgate.middleware.framework.composition.pipeline import Pipeline, build_pipeline
from kvgate.middleware.framework.composition.registry import Registry
from kvgate.middleware.framework.errors import ConfigError
from kvgate.middleware.framework.types import Api, CycleState, Endpoint, RoutingDecision
from kvgate.plugins.common.state import PREFIX_MATCH, PrefixMatch
from kvgate.plugins.prefix.events.subscriber import KvEventsSubscriber
from kvgate.plugins.prefix.producer import PrefixCacheProducer
from kvgate.plugins.prefix.scorer import PrefixCacheScorer
from kvgate.plugins.prefix.tokenizer import Tokenizer
from tests.unit.middleware.fakes import Best
from tests.unit.routing.helpers import endpoint, frames, request, stored

SIM = {"kind": "module", "module": "kvgate.engines.sim.core.tokenizer"}
PLUGINS: list[dict[str, Any]] = [
    {"type": "kv-events"},
    {"type": "tokenizer", "params": {"tokenizer": SIM}},
    {"type": "prefix-cache-producer", "params": {"mode": "precise"}},
    {"type": "prefix-cache-scorer"},
    {"type": "best"},
]
PROFILE = {"name": "p", "plugins": [{"ref": "prefix-cache-scorer", "weight": 3}, {"ref": "best"}]}


def _registry() -> Registry:
    classes = [KvEventsSubscriber, Tokenizer, PrefixCacheProducer, PrefixCacheScorer, Best]
    return Registry(plugins={c.type_name: c for c in classes}, engines={"vllm": VllmAdapter})


def _build(plugins: list[dict[str, Any]]) -> Pipeline:
    data = {"engines": [{"name": f"e{i}", "url": f"http://127.0.0.1:9/{i}"} for i in range(3)],
            "plugins": plugins, "profiles": [PROFILE]}
    return build_pipeline(parse_config(data, "test.yaml"), _registry())


@pytest.mark.parametrize(("case", "drop", "error"), [
    ("scorer without producer", "prefix-cache-producer", "consumes prefix-match"),
    ("producer without tokenizer", "tokenizer", "consumes token-ids"),
    ("precise without kv-events", "kv-events", "not declared before"),
])
def test_config_checks(case: str, drop: str, error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        _build([p for p in PLUGINS if p["type"] != drop])


def test_example_params_validate() -> None:
    for cls in (KvEventsSubscriber, Tokenizer, PrefixCacheProducer, PrefixCacheScorer):
        cls.Params.model_validate(cls.example_params)


async def _route(pipeline: Pipeline, eps: list[Endpoint],
                 messages: list[dict[str, str]]) -> tuple[str, PrefixMatch]:
    req = request(Api.CHAT, {"messages": messages}, model="sim-model")
    state = CycleState()
    for producer in pipeline.producers:
        await producer.prepare(req, state, eps)
    decision: RoutingDecision = pipeline.scheduler.schedule(req, state, eps)
    for hook in pipeline.dispatch_hooks:
        await hook.before_dispatch(req, state, decision)
    return decision.target.id, state.require(PREFIX_MATCH)


async def test_requests_follow_the_engine_holding_their_prefix() -> None:
    pipeline = _build(PLUGINS)
    for plugin in pipeline.lifecycles:
        if not isinstance(plugin, KvEventsSubscriber):  # no socket needed: frames fed below
            await plugin.start()
    sub = pipeline.plugins["kv-events"]
    assert isinstance(sub, KvEventsSubscriber)
    eps = [endpoint(f"e{i}") for i in range(3)]
    sub.on_endpoints_changed(eps, [])
    chat = [{"role": "system", "content": "You are a careful assistant. " * 40},
            {"role": "user", "content": "Summarize the plot of a long novel, please."}]
    ids = sim_tokenizer.chat_token_ids(chat)
    full = len(ids) // 16 * 16
    sub.handle_frames(frames("kv@e2@sim-model", 0, [
        stored(list(range(1, full // 16 + 1)), None, ids[:full], 16)]))
    target, match = await _route(pipeline, eps, chat)
    assert (target, dict(match.device)) == ("e2", {"e2": full})
    # a new conversation: no engine holds it; the first pick gets a speculative entry and
    # the burst's second request sees it before any event arrives
    other = [{"role": "user", "content": "A different question entirely " * 20}]
    first, match = await _route(pipeline, eps, other)
    assert not match.device
    second, match = await _route(pipeline, eps, other)
    assert second == first and match.device[first] == match.prompt_tokens // 16 * 16
    for plugin in pipeline.lifecycles:
        await plugin.stop()
