"""Config loading and pipeline validation: every rejection names file, instance and problem."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvgate.engines.vllm import VllmAdapter
from kvgate.middleware.framework.composition.config import load_config, parse_config
from kvgate.middleware.framework.composition.pipeline import build_pipeline
from kvgate.middleware.framework.composition.quickstart import config_from_engines
from kvgate.middleware.framework.errors import ConfigError
from tests.unit.middleware.fakes import TwoProfiles, registry

ENGINE = {"name": "e0", "url": "http://127.0.0.1:9000"}
GOOD: dict[str, Any] = {
    "engines": [ENGINE],
    "plugins": [{"type": "keep-all"}, {"type": "fixed-scorer", "params": {"scores": {"e0": 1}}},
                {"type": "best"}],
    "profiles": [{"name": "default", "plugins": [
        {"ref": "keep-all"}, {"ref": "fixed-scorer", "weight": 2}, {"ref": "best"}]}],
}


def _with(**changes: Any) -> dict[str, Any]:
    return {**GOOD, **changes}


def _profile(*refs: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"name": "default", "plugins": list(refs)}]


def test_good_config_builds() -> None:
    pipeline = build_pipeline(parse_config(GOOD, "g.yaml"), registry(VllmAdapter))
    assert set(pipeline.plugins) == {"keep-all", "fixed-scorer", "best"}
    profile = pipeline.scheduler.profiles["default"]
    assert [w.weight for w in profile.scorers] == [2.0]


SCHEMA_REJECTIONS = [
    ("top-level list", [1, 2], "top level must be a mapping"),
    ("unknown top key", _with(engins=[]), "engins"),
    ("bad url", _with(engines=[{"name": "e0", "url": "ftp://x"}]), "engines[0] (name 'e0').url"),
    ("bad engine name", _with(engines=[{"name": "a b", "url": "http://x"}]), "engines[0]"),
    ("unknown engine key", _with(engines=[{**ENGINE, "weight": 1}]), "weight"),
    ("unknown plugin key", _with(plugins=[{"type": "best", "parmas": {}}]),
     "plugins[0] (type 'best').parmas"),
    ("bad role", _with(engines=[{**ENGINE, "role": "both-ish"}]), "role"),
    ("negative weight", _with(profiles=_profile({"ref": "best", "weight": -1})), "weight"),
    ("bad port", _with(server={"port": 70000}), "server.port"),
    ("tiny body limit", _with(server={"max_body_bytes": 10}), "max_body_bytes"),
    ("unknown server key", _with(server={"prot": 1}), "server.prot"),
    ("bad pool interval", _with(pool={"health_interval_s": 0}), "pool.health_interval_s"),
]


@pytest.mark.parametrize(("case", "data", "needle"), SCHEMA_REJECTIONS, ids=[c[0] for c in SCHEMA_REJECTIONS])
def test_schema_rejections(case: str, data: Any, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(data, "bad.yaml")
    assert "bad.yaml" in str(info.value)
    assert needle in str(info.value)


PIPELINE_REJECTIONS = [
    ("unknown type", _with(plugins=[*GOOD["plugins"], {"type": "nope"}]), "unknown plugin type"),
    ("duplicate name", _with(plugins=[*GOOD["plugins"], {"type": "best"}]),
     "duplicate plugin name 'best'"),
    ("bad params", _with(plugins=[{"type": "keep-all", "params": {"x": 1}}, *GOOD["plugins"][1:]]),
     "plugins[0] (name 'keep-all', type 'keep-all'): bad params"),
    ("wrong param type", _with(plugins=[*GOOD["plugins"][:1],
                                        {"type": "fixed-scorer", "params": {"scores": 3}},
                                        GOOD["plugins"][2]]), "bad params: scores"),
    ("dangling ref", _with(profiles=_profile({"ref": "ghost"}, {"ref": "best"})),
     "profile 'default': refers to undeclared plugin 'ghost'"),
    ("no picker", _with(profiles=_profile({"ref": "keep-all"})), "exactly one picker, has 0"),
    ("two pickers", _with(plugins=[*GOOD["plugins"], {"type": "best", "name": "best2"}],
                          profiles=_profile({"ref": "best"}, {"ref": "best2"})),
     "exactly one picker, has 2"),
    ("weight on filter", _with(profiles=_profile({"ref": "keep-all", "weight": 1}, {"ref": "best"})),
     "'keep-all' is not a scorer"),
    ("wrong slot", _with(plugins=[*GOOD["plugins"], {"type": "two-profiles"}],
                         profiles=_profile({"ref": "two-profiles"}, {"ref": "best"})),
     "not a filter, scorer or picker"),
    ("no profiles", _with(profiles=[]), "at least one profile"),
    ("duplicate profile", _with(profiles=GOOD["profiles"] * 2), "duplicate profile name"),
    ("two profiles without handler", _with(profiles=[
        GOOD["profiles"][0], {**GOOD["profiles"][0], "name": "other"}]), "need a profile_handler"),
    ("handler undeclared", _with(profile_handler="ghost"), "profile_handler 'ghost'"),
    ("handler wrong slot", _with(profile_handler="best"), "is not one"),
    ("unproduced key", _with(plugins=[*GOOD["plugins"], {"type": "consumer"}]),
     "consumes prefix-match but no configured plugin produces it"),
    ("implements nothing", _with(plugins=[*GOOD["plugins"], {"type": "empty"}]),
     "implements no extension point"),
    ("lookup before declared", _with(plugins=[
        {"type": "needs-other", "params": {"other": "best"}}, *GOOD["plugins"]]),
     "'best' is referenced but not declared before it"),
    ("unknown engine kind", _with(engines=[{**ENGINE, "kind": "tgi"}]), "unknown engine kind 'tgi'"),
    ("duplicate engine", _with(engines=[ENGINE, ENGINE]), "duplicate engine name"),
]


@pytest.mark.parametrize(("case", "data", "needle"), PIPELINE_REJECTIONS,
                         ids=[c[0] for c in PIPELINE_REJECTIONS])
def test_pipeline_rejections(case: str, data: Any, needle: str) -> None:
    config = parse_config(data, "bad.yaml")
    with pytest.raises(ConfigError) as info:
        build_pipeline(config, registry(VllmAdapter))
    assert "bad.yaml" in str(info.value)
    assert needle in str(info.value)


def test_profile_handler_config_builds() -> None:
    data = _with(
        plugins=[*GOOD["plugins"], {"type": "two-profiles"}],
        profiles=[GOOD["profiles"][0], {**GOOD["profiles"][0], "name": "prefill"}],
        profile_handler="two-profiles",
    )
    pipeline = build_pipeline(parse_config(data, "g.yaml"), registry(VllmAdapter))
    assert pipeline.scheduler.handler is not None
    assert isinstance(pipeline.scheduler.handler, TwoProfiles)


@pytest.mark.parametrize(("text", "needle"), [
    ("engines: [\n", "not valid YAML"),
    ("- 1\n", "top level must be a mapping"),
])
def test_load_config_file_errors(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value)
    assert needle in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "absent.yaml")


def test_empty_file_gives_defaults_but_needs_profile(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("")
    config = load_config(path)
    assert config.server.port == 8080
    with pytest.raises(ConfigError, match="at least one profile"):
        build_pipeline(config, registry(VllmAdapter))


def test_quick_start_config() -> None:
    config = config_from_engines(["http://a:1/", "http://b:2"], host="0.0.0.0", port=9)
    assert [e.url for e in config.engines] == ["http://a:1", "http://b:2"]
    assert (config.server.host, config.server.port) == ("0.0.0.0", 9)
    assert [p.name for p in config.profiles] == ["default"]


def test_shared_state_redis_url_is_the_default_of_plugins_redis_url_params() -> None:
    from kvgate.middleware.framework.composition.config import with_shared_state
    from kvgate.middleware.framework.composition.registry import Registry
    from kvgate.plugins.load.session_affinity import SessionAffinityScorer as SessionAffinity

    reg = registry(VllmAdapter)
    reg = Registry(plugins={**reg.plugins, SessionAffinity.type_name: SessionAffinity},
                   engines=reg.engines)
    plugins = [*GOOD["plugins"], {"type": "session-affinity-scorer"},
               {"type": "session-affinity-scorer", "name": "own",
                "params": {"redis_url": "redis://other:6379/1"}}]
    config = with_shared_state(parse_config(_with(plugins=plugins), "g.yaml"),
                               "redis://shared:6379/0")
    assert config.shared_state is not None
    built = build_pipeline(config, reg).plugins
    urls = {name: built[name].p.redis_url.get_secret_value()  # type: ignore[attr-defined]
            for name in ("session-affinity-scorer", "own")}
    assert urls == {"session-affinity-scorer": "redis://shared:6379/0", "own": "redis://other:6379/1"}
    # without shared state nothing is injected; a malformed URL is a config error
    plain = build_pipeline(parse_config(_with(plugins=plugins[:-1]), "g.yaml"), reg).plugins
    assert plain["session-affinity-scorer"].p.redis_url is None  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="shared_state"):
        parse_config(_with(shared_state={"redis_url": "http://x"}), "g.yaml")
