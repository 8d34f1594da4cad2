"""SimConfig validation and derived values."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from kvgate.engines.sim.core.config import KvEventsConfig, SimConfig


@pytest.mark.parametrize("kwargs", [
    {"unknown": 1},
    {"block_size": 0},
    {"time_scale": -1},
    {"served_model_names": []},
    {"served_model_names": ["a", "a"]},
    {"capacity_blocks": 4, "block_size": 16, "max_model_len": 65},
    {"natural_output_len": (5, 2)},
    {"role": "router"},
    {"timing": {"weight_read_s": -1}},
    {"kv_events": {"endpoint": "tcp://*:1", "encoding": "json"}},
])
def test_rejects(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        SimConfig(**kwargs)


@pytest.mark.parametrize(("kwargs", "max_len"), [
    ({}, 32_768),
    ({"capacity_blocks": 64}, 1024),
    ({"capacity_blocks": 64, "max_model_len": 100}, 100),
    ({"capacity_blocks": 100_000}, 32_768),
])
def test_effective_max_model_len(kwargs: dict[str, Any], max_len: int) -> None:
    assert SimConfig(**kwargs).effective_max_model_len == max_len


@pytest.mark.parametrize(("kv", "topic"), [
    (None, "kv@e1@m"),
    (KvEventsConfig(endpoint="tcp://*:5557"), "kv@e1@m"),
    (KvEventsConfig(endpoint="tcp://*:5557", topic="x"), "x"),
])
def test_topic(kv: KvEventsConfig | None, topic: str) -> None:
    assert SimConfig(engine_id="e1", served_model_names=["m"], kv_events=kv).kv_events_topic == topic
