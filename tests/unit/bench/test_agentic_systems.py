"""The KV-pressure benchmark's systems (bench/agentic_systems.py): command lines and configs."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.agentic_systems import (
    PIN_LOAD_FACTOR,
    SYSTEMS,
    Fleet,
    argv_for,
    config,
    counter_deltas,
    lookup,
    serve_argv,
    variant_config,
)
from kvgate.middleware.framework.composition.config import parse_config
from kvgate.middleware.framework.composition.pipeline import build_pipeline
from kvgate.middleware.framework.composition.registry import Registry

FLEET = Fleet(("http://127.0.0.1:8001", "http://127.0.0.1:8002"),
              ("tcp://127.0.0.1:5001", "tcp://127.0.0.1:5002"), Path("/models/tiny"), "tiny")


def test_default_is_exactly_the_quick_start() -> None:
    argv = serve_argv("kvgate-default", FLEET, 9000)
    assert argv[1:] == ["serve", "--engine", FLEET.urls[0], "--engine", FLEET.urls[1],
                        "--host", "127.0.0.1", "--port", "9000"]


def test_precise_names_each_engines_events_in_engine_order_and_the_tokenizer() -> None:
    argv = serve_argv("kvgate-precise", FLEET, 9000)
    events = [argv[i + 1] for i, a in enumerate(argv) if a == "--kv-events"]
    assert events == list(FLEET.kv_events)
    assert argv[argv.index("--tokenizer") + 1] == "/models/tiny"


@pytest.mark.parametrize("name", ["random", "session-pin", "least-loaded"])
def test_config_systems_build_a_pipeline(name: str) -> None:
    doc = config(name, FLEET, 9000)
    assert [e["name"] for e in doc["engines"]] == ["engine-0", "engine-1"]
    build_pipeline(parse_config(doc, f"{name}.json"), Registry.from_entry_points())


def test_random_has_no_scorer_and_ties_go_to_the_seeded_picker() -> None:
    refs = [r["ref"] for r in config("random", FLEET, 9000)["profiles"][0]["plugins"]]
    assert refs == ["health-filter", "model-filter", "max-score-picker"]


def test_least_loaded_scores_requests_in_flight_only() -> None:
    refs = [r["ref"] for r in config("least-loaded", FLEET, 9000)["profiles"][0]["plugins"]]
    assert refs == ["health-filter", "model-filter", "least-in-flight-scorer", "max-score-picker"]


@pytest.mark.parametrize(("name", "policy", "modes"), [
    ("vllm-router-cache_aware", "cache_aware", ("no-headers",)),
    ("vllm-router-consistent_hash", "consistent_hash", ("headers",)),
])
def test_vllm_router_systems_pass_their_policy(tmp_path: Path, name: str, policy: str,
                                                modes: tuple[str, ...],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("bench.venvs.ensure", lambda *a, **k: tmp_path)
    argv = argv_for(SYSTEMS[name], FLEET, 9000, tmp_path, tmp_path)
    assert argv[argv.index("--policy") + 1] == policy
    assert argv[argv.index("--worker-urls") + 1:argv.index("--policy")] == list(FLEET.urls)
    assert SYSTEMS[name].modes == modes


def test_session_pin_never_reaches_its_load_bound() -> None:
    plugins = config("session-pin", FLEET, 9000)["plugins"]
    pin = next(p for p in plugins if p["type"] == "session-affinity-scorer")
    assert pin["params"]["load_factor"] == PIN_LOAD_FACTOR >= 100
    assert SYSTEMS["session-pin"].modes == ("headers",)


def test_counter_deltas() -> None:
    before = {"vllm:request_success_total": 3, "vllm:prompt_tokens_total": 1000,
              "vllm:prompt_tokens_cached_total": 256, "vllm:num_preemptions_total": 0}
    after = {"vllm:request_success_total": 5, "vllm:prompt_tokens_total": 3000,
             "vllm:prompt_tokens_cached_total": 1280, "vllm:num_preemptions_total": 1}
    assert counter_deltas(before, after) == {"requests": 2, "prefill_tokens": 976,
                                             "preemptions": 1}


@pytest.mark.parametrize(("name", "params"), [
    ("kvgate-precise+pressure_floor=0.07", {"pressure_floor": 0.07}),
    ("kvgate-default+pressure_floor=0.1+load_weight=0", {"pressure_floor": 0.1,
                                                         "load_weight": 0.0}),
])
def test_a_variant_is_its_quick_start_with_placement_params(
        tmp_path: Path, name: str, params: dict[str, float]) -> None:
    """``<kvgate system>+param=value``: the same quick start as a config file, the
    placement scorer's params updated (precise keeps its events and tokenizer)."""
    system = lookup(name)
    assert system.kind == "variant" and system.modes == ("headers", "no-headers")
    argv = argv_for(system, FLEET, 9000, tmp_path, tmp_path)
    assert argv[1:3] == ["serve", "--config"]
    doc = variant_config(name, FLEET, 9000)
    placement = next(p for p in doc["plugins"] if p["type"] == "kv-placement-scorer")
    assert placement["params"] == {"load": "token-load-scorer", **params}
    events = [e.get("kv_events") for e in doc["engines"]]
    assert events == (list(FLEET.kv_events) if "precise" in name else [None, None])
    parsed = parse_config(doc, f"{name}.json")
    if "precise" not in name:  # precise's tokenizer needs the model's folder (FLEET's is fake)
        build_pipeline(parsed, Registry.from_entry_points())


@pytest.mark.parametrize(("name", "error"), [
    ("random+pressure_floor=1", KeyError),         # not a kvgate system
    ("kvgate-precise+", ValueError),               # no parameter
    ("kvgate-precise+pressure_floor", ValueError),  # no value
    ("kvgate-precise+pressure_floor=x", ValueError),
])
def test_a_malformed_variant_is_refused(name: str, error: type[Exception]) -> None:
    with pytest.raises(error):
        lookup(name)
