"""Contract over every plugin registered through entry points (future plugins included).

Construction uses ``example_params`` and a lookup that builds any other registered plugin on
demand (so plugins that need a partner, like the imbalance filter, can be built). Scheduling
slots are called with an empty CycleState: a plugin must not crash on missing optional state.
"""

from __future__ import annotations

import math
import random
import time
from typing import Any

import pydantic
import pytest

from kvgate.middleware.framework.composition.registry import Registry
from kvgate.middleware.framework.errors import NoEndpointAvailable
from kvgate.middleware.framework.plugin import Filter, Picker, Plugin, Scorer, slots_of
from kvgate.middleware.framework.types import (
    Api,
    CycleState,
    Endpoint,
    InferenceRequest,
    ScoredEndpoint,
)

REGISTRY = Registry.from_entry_points()
TYPES = sorted(REGISTRY.plugins)


class _Lookup:
    """Builds the requested plugin type with its example params (name == type)."""

    def lookup(self, name: str) -> object:
        cls = REGISTRY.plugins[name]
        return cls(name, cls.Params.model_validate(dict(cls.example_params)), self)


def _build(type_name: str) -> Any:
    return _Lookup().lookup(type_name)


def _endpoints(rng: random.Random) -> list[Endpoint]:
    return [
        Endpoint(id=f"e{i}", url=f"http://e{i}", kind="vllm", healthy=rng.random() > 0.2,
                 models=frozenset({"m"}) if rng.random() > 0.3 else frozenset(),
                 in_flight_requests=rng.randrange(10), in_flight_tokens=rng.randrange(5000))
        for i in range(5)
    ]


def _req() -> InferenceRequest:
    return InferenceRequest(
        request_id="r", api=Api.CHAT, model="m", body={"messages": []}, headers={},
        stream=False, client_wants_usage=False, prompt_token_estimate=100,
        received_at=time.monotonic(),
    )


def test_registry_is_not_empty() -> None:
    assert len(TYPES) >= 7


@pytest.mark.parametrize("type_name", TYPES)
def test_declaration(type_name: str) -> None:
    cls: type[Plugin] = REGISTRY.plugins[type_name]
    assert cls.type_name == type_name
    assert (cls.__doc__ or "").strip(), "plugins document their algorithm"
    cls.Params.model_validate(dict(cls.example_params))
    with pytest.raises(pydantic.ValidationError):
        cls.Params.model_validate({**cls.example_params, "definitely_unknown_key": 1})
    assert slots_of(_build(type_name)), "implements at least one extension point"


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_scheduling_slots(type_name: str, seed: int) -> None:
    plugin, rng = _build(type_name), random.Random(seed)
    eps = _endpoints(rng)
    ids = {ep.id for ep in eps}
    if isinstance(plugin, Filter):
        kept = plugin.filter(_req(), CycleState(), eps)
        assert {ep.id for ep in kept} <= ids
    if isinstance(plugin, Scorer):
        scores = plugin.score(_req(), CycleState(), eps)
        assert set(scores) <= ids
        assert all(math.isfinite(v) and 0.0 <= v <= 1.0 for v in scores.values())
    if isinstance(plugin, Picker):
        scored = [ScoredEndpoint(ep, rng.random()) for ep in eps]
        result = plugin.pick(CycleState(), scored, random.Random(seed))
        assert sorted(ep.id for ep in result.endpoints) == sorted(ids)
        with pytest.raises(NoEndpointAvailable):
            plugin.pick(CycleState(), [], random.Random(seed))
