"""The ``catalog`` plugin: every rejection at startup (through the real pipeline build), alias
resolution and the plan it hands to the gateway, /v1/models cards, allow-lists."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvgate.middleware.framework.backend import MODEL_PLAN, BackendStep, PoolStep
from kvgate.middleware.framework.composition.config import parse_config
from kvgate.middleware.framework.composition.pipeline import build_pipeline
from kvgate.middleware.framework.composition.registry import Registry
from kvgate.middleware.framework.errors import ConfigError, ModelNotFound
from kvgate.middleware.framework.types import Api, CycleState, InferenceRequest
from kvgate.plugins.catalog.plugin import CATALOG_ENTRY, Catalog
from kvgate.plugins.tenancy.auth import ApiKey

POOL: dict[str, Any] = {"name": "sim-model", "aliases": ["sim"], "pool": {"engines": ["e0"]}}
PROV: dict[str, Any] = {"name": "claude", "provider": {"model": "anthropic/claude-x", "api_key_env": "KVG_T_KEY"}}
PRICES = """
models:
  sim-model: {input_per_mtok: "0.60", cached_input_per_mtok: "0.10", output_per_mtok: "3.00"}
  claude: {input_per_mtok: "1", output_per_mtok: "5"}
"""


def _config(tmp_path: Path, models: Any, engines: list[dict[str, Any]] | None = None,
            prices: bool = False) -> dict[str, Any]:
    path = tmp_path / "catalog.yaml"
    path.write_text(models if isinstance(models, str) else yaml.safe_dump({"models": models}))
    params: dict[str, Any] = {"file": str(path)}
    if prices:
        (tmp_path / "prices.yaml").write_text(PRICES)
        params["prices"] = str(tmp_path / "prices.yaml")
    return {
        "engines": engines if engines is not None else [{"name": "e0", "url": "http://x:1"}],
        "plugins": [{"type": "catalog", "params": params}, {"type": "max-score-picker"}],
        "profiles": [{"name": "default", "plugins": [{"ref": "max-score-picker"}]}],
    }


def _build(data: dict[str, Any]) -> Catalog:
    pipeline = build_pipeline(parse_config(data, "gw.yaml"), Registry.from_entry_points())
    catalog = pipeline.catalog
    assert isinstance(catalog, Catalog)
    return catalog


def _with(entry: dict[str, Any], **changes: Any) -> dict[str, Any]:
    return {**entry, **changes}


REJECTIONS: list[tuple[str, Any, str]] = [
    ("unknown key", [_with(POOL, colour="red")], "models[0] (name 'sim-model'): colour: Extra"),
    ("both backends", [_with(POOL, provider=PROV["provider"])], "exactly one of pool or provider"),
    ("no backend", [{"name": "x"}], "models[0] (name 'x'): entry: Value error, needs exactly one"),
    ("duplicate name", [POOL, _with(POOL, aliases=[])],
     "models[1] (name 'sim-model'): 'sim-model' is already the name or an alias of 'sim-model'"),
    ("alias = other name", [POOL, _with(PROV, aliases=["sim-model"])],
     "models[1] (name 'claude'): 'sim-model' is already"),
    ("alias twice", [POOL, _with(PROV, aliases=["sim"])], "'sim' is already the name or an alias"),
    ("fallback unknown", [_with(POOL, fallbacks=["nope"])], "fallback 'nope' is not another"),
    ("fallback self", [_with(POOL, fallbacks=["sim-model"])], "fallback 'sim-model' is not"),
    ("fallback alias", [POOL, _with(PROV, fallbacks=["sim"])], "fallback 'sim' is not another"),
    ("env var unset", [_with(PROV, provider={**PROV["provider"], "api_key_env": "KVG_T_UNSET"})],
     "models[0] (name 'claude'): environment variable KVG_T_UNSET (api_key_env) is not set"),
    ("extra env var unset",
     [_with(PROV, provider={**PROV["provider"], "env": ["KVG_T_KEY", "KVG_T_UNSET"]})],
     "models[0] (name 'claude'): environment variable KVG_T_UNSET (env) is not set"),
    ("extra env var name bad", [_with(PROV, provider={**PROV["provider"], "env": ["a b"]})],
     "provider.env.0: String should match pattern"),
    ("env var name bad", [_with(PROV, provider={**PROV["provider"], "api_key_env": "sk-123"})],
     "provider.api_key_env: String should match pattern"),
    ("provider no slash", [_with(PROV, provider={"model": "claude-x"})],
     "provider.model: String should match pattern"),
    ("dangling engine", [_with(POOL, pool={"engines": ["e9"]})],
     "models[0] (name 'sim-model'): pool engine 'e9' is not in the gateway config"),
    ("dangling profile", [_with(POOL, pool={"profile": "fast"})],
     "routing profile 'fast' is not in the gateway config"),
    ("unknown backend kind", [_with(PROV, provider={**PROV["provider"], "backend": "nope"})],
     "provider backend 'nope' is not installed"),
    ("http engine as backend", [_with(PROV, provider={**PROV["provider"], "backend": "vllm"})],
     "provider backend 'vllm' is not installed"),
    ("no models", [], "models: Tuple should have at least 1 item"),
    ("fallback_on 200", [_with(POOL, fallback_on=[200])], "fallback_on holds HTTP error"),
    ("bad modality", [_with(POOL, modalities=["smell"])], "modalities.0: Input should be"),
    ("bad yaml", "models: [", "invalid YAML"),
]


@pytest.mark.parametrize(("case", "models", "message"), REJECTIONS, ids=[r[0] for r in REJECTIONS])
def test_rejected_at_startup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str,
                             models: Any, message: str) -> None:
    monkeypatch.setenv("KVG_T_KEY", "sk-test")
    monkeypatch.delenv("KVG_T_UNSET", raising=False)
    with pytest.raises(ConfigError) as info:
        _build(_config(tmp_path, models))
    text = str(info.value)
    assert message in text
    assert str(tmp_path / "catalog.yaml") in text


def test_engine_serving_other_models_rejected(tmp_path: Path) -> None:
    engines = [{"name": "e0", "url": "http://x:1", "models": ["other"]}]
    with pytest.raises(ConfigError, match="engine 'e0' is configured to serve \\['other'\\]"):
        _build(_config(tmp_path, [POOL], engines))


def test_missing_file(tmp_path: Path) -> None:
    data = _config(tmp_path, [POOL])
    data["plugins"][0]["params"]["file"] = str(tmp_path / "absent.yaml")
    with pytest.raises(ConfigError, match=r"absent\.yaml: cannot read catalog"):
        _build(data)


def test_engine_kind_backend_refused_as_http_engine(tmp_path: Path) -> None:
    data = _config(tmp_path, [POOL], [{"name": "e0", "url": "http://x:1", "kind": "litellm"}])
    with pytest.raises(ConfigError, match="'litellm' is not an HTTP engine"):
        _build(data)


def _req(model: str, principal: Any = None) -> InferenceRequest:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    return InferenceRequest(request_id="r1", api=Api.CHAT, model=model, body=body, headers={},
                            stream=False, client_wants_usage=False, prompt_token_estimate=2,
                            received_at=time.monotonic(), raw_body=b"{}", principal=principal)


RESOLVE = [("sim-model", "sim-model", False), ("sim", "sim-model", True),
           ("claude", "claude", False), ("sonnet", "claude", True)]


@pytest.mark.parametrize(("asked", "canonical", "rewritten"), RESOLVE)
async def test_alias_resolution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, asked: str,
                                canonical: str, rewritten: bool) -> None:
    monkeypatch.setenv("KVG_T_KEY", "sk-test")
    catalog = _build(_config(tmp_path, [_with(POOL, fallbacks=["claude"]),
                                        _with(PROV, aliases=["sonnet"])]))
    req, state = _req(asked), CycleState()
    await catalog.on_request(req, state)
    assert req.model == canonical
    assert req.body["model"] == canonical
    assert (req.raw_body is None) is rewritten  # the body is re-serialized only when changed
    assert state.require(CATALOG_ENTRY).name == canonical
    plan = state.require(MODEL_PLAN)
    first = plan.steps[0]
    if canonical == "sim-model":
        assert first == PoolStep("sim-model", frozenset({"e0"}), None)
        assert isinstance(plan.steps[1], BackendStep)
        assert plan.steps[1].target == "anthropic/claude-x"
    else:
        assert isinstance(first, BackendStep) and len(plan.steps) == 1
        assert first.options["api_key_env"] == "KVG_T_KEY"
        assert "sk-test" not in repr(first)  # names of variables only, never the key


async def test_unknown_model_404_names_close_ones(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVG_T_KEY", "sk-test")
    catalog = _build(_config(tmp_path, [POOL, PROV]))
    with pytest.raises(ModelNotFound) as info:
        await catalog.on_request(_req("sim-modle"), CycleState())
    assert info.value.status == 404
    assert "'sim-modle' does not exist; did you mean 'sim-model'" in info.value.message
    assert "claude" not in info.value.message


def test_cards_with_prices_and_allow_list(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVG_T_KEY", "sk-test")
    catalog = _build(_config(tmp_path, [_with(POOL, context_length=4096), PROV], prices=True))
    cards = {c["id"]: c for c in catalog.list_models(None)}
    assert list(cards) == ["sim-model", "claude"]
    sim = cards["sim-model"]
    assert {k: sim[k] for k in ("object", "owned_by", "aliases", "context_length", "backend")} == {
        "object": "model", "owned_by": "kvgate", "aliases": ["sim"], "context_length": 4096,
        "backend": "pool"}
    assert isinstance(sim["created"], int)
    assert sim["pricing"] == {"currency": "USD", "input_per_mtok": "0.6",
                              "cached_input_per_mtok": "0.1", "output_per_mtok": "3"}
    assert sim["cached_tokens_discounted"] is True
    assert cards["claude"]["cached_tokens_discounted"] is False  # cached = input price
    assert cards["claude"]["owned_by"] == "anthropic"
    key = ApiKey("k1", "acme", frozenset({"claude"}), False, None)
    assert [c["id"] for c in catalog.list_models(key)] == ["claude"]
    assert catalog.get_model("sim", None)["id"] == "sim-model"
    with pytest.raises(ModelNotFound):
        catalog.get_model("sim-model", key)  # not the key's: looks like it does not exist
