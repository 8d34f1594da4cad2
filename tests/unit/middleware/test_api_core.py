"""The API core without HTTP: hooks ordered by produces/consumes, the route table of the API
adapters, by-id route matching, the bounded state-id map, the body parsed once."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from kvgate.apis.openai import ChatCompletions, Completions
from kvgate.apis.pooling import Embeddings, Tokenize
from kvgate.engines.sim.core import tokenizer as sim_tokenizer
from kvgate.engines.vllm import VllmAdapter
from kvgate.middleware.framework.api import ApiAdapter, match_route
from kvgate.middleware.framework.composition.config import parse_config
from kvgate.middleware.framework.composition.pipeline import build_pipeline, order_by_state
from kvgate.middleware.framework.composition.registry import Registry, load_apis
from kvgate.middleware.framework.errors import BadRequest, ConfigError
from kvgate.middleware.framework.plugin import Plugin, RequestHook
from kvgate.middleware.framework.types import Api, CycleState, InferenceRequest
from kvgate.middleware.serving.gateway import ApiRoutes
from kvgate.middleware.serving.requests import load_body
from kvgate.middleware.serving.states import StateMap, StateMapCollector
from kvgate.plugins.common.state import PREFIX_MATCH
from kvgate.plugins.prefix.events.subscriber import KvEventsSubscriber
from kvgate.plugins.prefix.producer import PrefixCacheProducer
from kvgate.plugins.prefix.scorer import PrefixCacheScorer
from kvgate.plugins.prefix.tokenizer import Tokenizer
from tests.plugin_helpers import NoLookup
from tests.unit.middleware.fakes import Best
from tests.unit.routing.helpers import endpoint, frames, request, stored


def _hook(name: str, produces: set[str], consumes: set[str]) -> Plugin:
    class Hook(Plugin, RequestHook):
        type_name = name

        async def on_request(self, req: InferenceRequest, state: CycleState) -> None:
            return None

    Hook.produces, Hook.consumes = frozenset(produces), frozenset(consumes)
    return Hook(name, Plugin.Params(), NoLookup())


ORDERS = [
    # case, plugins (name, produces, consumes) in config order, expected order
    ("independent keep config order", [("a", set(), set()), ("b", set(), set())], "ab"),
    ("consumer declared first runs second", [("c", set(), {"x"}), ("p", {"x"}, set())], "pc"),
    ("chain", [("c", set(), {"y"}), ("b", {"y"}, {"x"}), ("a", {"x"}, set())], "abc"),
    ("stable ties", [("z", set(), {"x"}), ("a", set(), set()), ("p", {"x"}, set())], "apz"),
    ("self-consuming is no cycle", [("s", {"x"}, {"x"})], "s"),
]


@pytest.mark.parametrize(("case", "plugins", "expected"), ORDERS, ids=[c[0] for c in ORDERS])
def test_hooks_ordered_by_produces_consumes(
    case: str, plugins: list[tuple[str, set[str], set[str]]], expected: str,
) -> None:
    built = {name: _hook(name, p, c) for name, p, c in plugins}
    assert "".join(p.name for p in order_by_state("t", built)) == expected


def test_state_key_cycle_refused() -> None:
    built = {"a": _hook("a", {"x"}, {"y"}), "b": _hook("b", {"y"}, {"x"})}
    with pytest.raises(ConfigError, match="cycle"):
        order_by_state("t.yaml", built)


SIM = {"kind": "module", "module": "kvgate.engines.sim.core.tokenizer"}
#: The prefix producer declared before the tokenizer whose token ids it consumes: accepted,
#: and (since producers run in produces/consumes order) prefix routing works.
PRODUCER_FIRST: list[dict[str, Any]] = [
    {"type": "kv-events"},
    {"type": "prefix-cache-producer", "params": {"mode": "precise"}},
    {"type": "tokenizer", "params": {"tokenizer": SIM}},
    {"type": "prefix-cache-scorer"},
    {"type": "best"},
]


async def test_prefix_producer_declared_before_the_tokenizer_still_routes_on_prefix() -> None:
    classes = [KvEventsSubscriber, Tokenizer, PrefixCacheProducer, PrefixCacheScorer, Best]
    registry = Registry(plugins={c.type_name: c for c in classes}, engines={"vllm": VllmAdapter})
    data = {"engines": [{"name": f"e{i}", "url": f"http://127.0.0.1:9/{i}"} for i in range(3)],
            "plugins": PRODUCER_FIRST, "profiles": [
                {"name": "p", "plugins": [{"ref": "prefix-cache-scorer", "weight": 3},
                                          {"ref": "best"}]}]}
    pipeline = build_pipeline(parse_config(data, "test.yaml"), registry)
    assert [type(p) for p in pipeline.producers] == [Tokenizer, PrefixCacheProducer]
    tokenizer = pipeline.plugins["tokenizer"]
    assert isinstance(tokenizer, Tokenizer)
    await tokenizer.start()
    try:
        sub = pipeline.plugins["kv-events"]
        assert isinstance(sub, KvEventsSubscriber)
        eps = [endpoint(f"e{i}") for i in range(3)]
        sub.on_endpoints_changed(eps, [])
        chat = [{"role": "system", "content": "You are a careful assistant. " * 40},
                {"role": "user", "content": "Summarize a long novel, please."}]
        ids = sim_tokenizer.chat_token_ids(chat)
        full = len(ids) // 16 * 16
        sub.handle_frames(frames("kv@e1@sim-model", 0, [
            stored(list(range(1, full // 16 + 1)), None, ids[:full], 16)]))
        req = request(Api.CHAT, {"messages": chat}, model="sim-model")
        state = CycleState()
        for producer in pipeline.producers:
            await producer.prepare(req, state, eps)
        assert dict(state.require(PREFIX_MATCH).device) == {"e1": full}
        assert pipeline.scheduler.schedule(req, state, eps).target.id == "e1"
    finally:
        await tokenizer.stop()


class _Dup(ChatCompletions):
    name: ClassVar[str] = "dup"


class _ById(ChatCompletions):
    name: ClassVar[str] = "by-id"
    routes: ClassVar[tuple[tuple[str, str], ...]] = (
        ("GET", "/v1/things/{id}"), ("POST", "/v1/things/{id}/cancel"))


ROUTES: list[tuple[str, list[ApiAdapter], frozenset[str], str | None]] = [
    ("shipped adapters", [ChatCompletions(), Completions(), Embeddings(), Tokenize()],
     frozenset(), None),
    ("two adapters, one route", [ChatCompletions(), _Dup()], frozenset(), "already taken"),
    ("adapter on a core path", [Embeddings()], frozenset({"/v1/embeddings"}), "already taken"),
    ("by-id twice", [_ById(), _ById()], frozenset(), "already taken"),
]


@pytest.mark.parametrize(("case", "adapters", "taken", "error"), ROUTES,
                         ids=[c[0] for c in ROUTES])
def test_route_table(case: str, adapters: list[ApiAdapter], taken: frozenset[str],
                     error: str | None) -> None:
    if error is not None:
        with pytest.raises(ConfigError, match=error):
            ApiRoutes(adapters, taken)
        return
    routes = ApiRoutes(adapters, taken)
    found = routes.match("POST", "/v1/chat/completions")
    assert found is not None and found[0].name == "chat" and found[1] is None
    assert routes.match("GET", "/v1/chat/completions") is None
    assert routes.allows_path("/v1/chat/completions")


def test_by_id_routes_match_one_segment() -> None:
    routes = ApiRoutes([_ById()])
    assert routes.match("GET", "/v1/things/abc") is not None
    found = routes.match("POST", "/v1/things/abc/cancel")
    assert found is not None and found[1] == "abc"
    assert routes.match("GET", "/v1/things/") is None
    assert routes.match("GET", "/v1/things/a/b") is None
    assert routes.allows_path("/v1/things/x") and not routes.allows_path("/v1/other/x")
    assert match_route("/v1/things/{id}", "/v1/things/resp_1") == "resp_1"


def test_shipped_adapters_are_entry_points_named_as_their_class() -> None:
    apis = load_apis()
    for name in ("chat", "completions", "embeddings", "tokenize", "detokenize"):
        assert apis[name]().name == name


def test_state_map_is_bounded_lru_and_per_tenant() -> None:
    states = StateMap(capacity=2)
    states.remember("a", "e0", "t1")
    states.remember("b", "e1", "t1")
    assert states.holder("a", "t1") is not None  # refreshes a: b is now the oldest
    states.remember("c", "e2", "t1")
    assert len(states) == 2 and states.evictions == 1
    assert states.holder("b", "t1") is None
    assert states.holder("a", "t2") is None and states.lookups["forbidden"] == 1
    holder = states.holder("c", "t1")
    assert holder is not None and holder.engine == "e2"
    families = {f.name: f for f in StateMapCollector(states).collect()}
    assert families["kvgate_state_ids"].samples[0].value == 2
    assert families["kvgate_state_ids_evicted"].samples[0].value == 1


@pytest.mark.parametrize(("raw", "message"), [
    (b"", "empty"), (b"{nope", "not valid JSON"), (b"\xff\xfe", "not valid JSON"),
    (b"[1, 2]", "JSON object"), (b'"text"', "JSON object"),
])
def test_body_parsed_once_with_clear_400s(raw: bytes, message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        load_body(raw)
