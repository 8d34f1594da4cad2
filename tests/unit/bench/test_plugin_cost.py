"""bench/plugin_cost.py: the variants it derives from the default preset, its summary, and one
real (tiny) run against the fake engine."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from bench import plugin_cost

_DATA: dict[str, Any] = {
    "engines": [{"name": "engine-0", "url": "http://127.0.0.1:1"}],
    "plugins": [
        {"type": "tokenizer"},
        {"type": "token-load-scorer"},
        {"type": "kv-placement-scorer", "params": {"load": "token-load-scorer", "x": 1}},
        {"type": "health-filter"},
        {"type": "max-score-picker", "name": "picker"},
    ],
    "profiles": [{"name": "default", "plugins": [
        {"ref": "health-filter"}, {"ref": "kv-placement-scorer", "weight": 1.0},
        {"ref": "picker"}]}],
}


def _names(data: dict[str, Any]) -> list[str]:
    return [plugin_cost.plugin_name(e) for e in data["plugins"]]


def _refs(data: dict[str, Any]) -> list[str]:
    return [r["ref"] for r in data["profiles"][0]["plugins"]]


@pytest.mark.parametrize(("name", "plugins", "refs", "placement_params"), [
    ("token-load-scorer",
     ["tokenizer", "kv-placement-scorer", "health-filter", "picker"],
     ["health-filter", "kv-placement-scorer", "picker"], {"x": 1}),
    ("kv-placement-scorer",
     ["tokenizer", "token-load-scorer", "health-filter", "picker"],
     ["health-filter", "picker"], None),
    ("picker",
     ["tokenizer", "token-load-scorer", "kv-placement-scorer", "health-filter"],
     ["health-filter", "kv-placement-scorer"], {"load": "token-load-scorer", "x": 1}),
])
def test_without(name: str, plugins: list[str], refs: list[str],
                 placement_params: dict[str, Any] | None) -> None:
    out = plugin_cost.without(_DATA, name)
    assert _names(out) == plugins
    assert _refs(out) == refs
    placement = [e for e in out["plugins"] if e["type"] == "kv-placement-scorer"]
    assert (placement[0]["params"] if placement else None) == placement_params
    assert len(_DATA["plugins"]) == 5  # the input is left as it was


def test_variants_and_routing_off() -> None:
    got = plugin_cost.variants(_DATA, {"health-filter", "picker"})
    assert list(got) == ["default", "without tokenizer", "without token-load-scorer",
                         "without kv-placement-scorer", "without health-filter",
                         "without picker", "routing off"]
    assert got["default"] == _DATA
    assert _names(got["routing off"]) == ["health-filter", "picker"]
    assert _refs(got["routing off"]) == ["health-filter", "picker"]


@pytest.mark.parametrize(("trial", "expect"), [
    (0, ["a", "b", "c"]), (1, ["b", "c", "a"]), (5, ["c", "a", "b"])])
def test_rotated(trial: int, expect: list[str]) -> None:
    assert plugin_cost.rotated(["a", "b", "c"], trial) == expect


def test_summary_and_table() -> None:
    summary = plugin_cost.summarise({"default": [100.0, 90.0, 110.0], "without x": [80.0, 70.0],
                                     "empty": []})
    assert summary == {"default": {"cpu_us_per_request": 100.0, "minus_default_us": 0.0},
                       "without x": {"cpu_us_per_request": 75.0, "minus_default_us": -25.0}}
    text = plugin_cost.table(summary, {"without y": "refused"})
    assert "| without x | 75.0 | +25.0 |" in text
    assert "| without y | skipped | refused |" in text
    no_base = plugin_cost.summarise({"without x": [1.0]})
    assert math.isnan(no_base["without x"]["minus_default_us"])


def test_default_preset_variants_validate_or_say_why() -> None:
    """The real default preset: every variant but those whose removal breaks a dependency
    validates; routing off keeps only the profile's filters and picker."""
    data = plugin_cost.preset_data(["http://127.0.0.1:1"])
    keep = plugin_cost.profile_keep(data)
    assert keep == {"health-filter", "model-filter", "flow-control", "max-score-picker"}
    refused = {name: plugin_cost.refusal(v)
               for name, v in plugin_cost.variants(data, keep).items()}
    assert refused["default"] is None and refused["routing off"] is None
    assert refused["without token-load-scorer"] is None  # the placement scorer's load param dropped
    assert "token-ids" in str(refused["without tokenizer"])
    assert "picker" in str(refused["without max-score-picker"])


_METRICS = """\
# HELP kvgate_plugin_hook_duration_seconds Plugin hook call duration
kvgate_plugin_hook_duration_seconds_bucket{hook="prepare",le="1e-05",plugin="tokenizer"} 3.0
kvgate_plugin_hook_duration_seconds_count{hook="prepare",plugin="tokenizer"} 4.0
kvgate_plugin_hook_duration_seconds_sum{hook="prepare",plugin="tokenizer"} 0.004
kvgate_plugin_hook_duration_seconds_sum{hook="score",plugin="kv-placement-scorer"} 0.01
kvgate_requests_total{api="chat",model="m",status="200"} 7.0
"""


def test_hook_sums_and_per_hook_us() -> None:
    sums = plugin_cost.hook_sums(_METRICS)
    assert sums == {"tokenizer prepare": 0.004, "kv-placement-scorer score": 0.01}
    before = {"tokenizer prepare": 0.002}
    got = plugin_cost.per_hook_us(before, sums, 1000)
    assert list(got) == ["kv-placement-scorer score", "tokenizer prepare"]  # largest first
    assert got == pytest.approx({"kv-placement-scorer score": 10.0, "tokenizer prepare": 2.0})
    text = plugin_cost.hooks_table(got, 150.0)
    assert "| kv-placement-scorer score | 10.00 |" in text
    assert "all hooks (of 150.0 µs/request with every call timed) | 12.00 |" in text


def test_a_tiny_real_run(tmp_path: Path) -> None:
    """The whole benchmark, briefly: two fake engines, one worker per variant, the JSON, and
    the default once more with every hook call timed."""
    out = tmp_path / "cost.json"
    assert plugin_cost.main(["--requests", "40", "--warmup", "10", "--concurrency", "4",
                             "--trials", "1", "--engines", "2", "--out", str(out), "--hooks",
                             "--variants", "default, routing off,without token-load-scorer,"
                                           "without tokenizer"]) == 0
    doc = json.loads(out.read_text())
    assert [e["name"] for e in doc["preset"]["engines"]] == ["engine-0", "engine-1"]
    summary = doc["summary"]
    assert set(summary) == {"default", "routing off", "without token-load-scorer"}
    assert all(row["cpu_us_per_request"] > 0 for row in summary.values())
    assert summary["default"]["minus_default_us"] == 0.0
    assert set(doc["skipped"]) == {"without tokenizer"}
    hooks = doc["hooks"]["hooks"]  # each of the default's hooks ran on every request
    for hook in ("tokenizer prepare", "prefix-cache-producer prepare",
                 "kv-placement-scorer score", "token-load-scorer before_dispatch",
                 "max-score-picker pick"):
        assert hooks[hook] > 0, hook
    assert sum(hooks.values()) < doc["hooks"]["cpu_us_per_request"]
