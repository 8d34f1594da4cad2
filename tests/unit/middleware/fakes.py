"""Small in-test plugins for exercising the framework without the shipped plugins."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import ClassVar

from pydantic import BaseModel, ConfigDict

from kvgate.middleware.framework.composition.registry import Registry
from kvgate.middleware.framework.engine import EngineAdapter
from kvgate.middleware.framework.plugin import (
    Filter,
    Picker,
    Plugin,
    PluginLookup,
    ProfileHandler,
    Scorer,
)
from kvgate.middleware.framework.types import (
    CycleState,
    Endpoint,
    EndpointId,
    InferenceRequest,
    ProfileResult,
    RoutingDecision,
    ScoredEndpoint,
)


class KeepAll(Plugin, Filter):
    """Keeps every endpoint."""

    type_name = "keep-all"

    def filter(
        self, req: InferenceRequest, state: CycleState, eps: Sequence[Endpoint]
    ) -> Sequence[Endpoint]:
        return eps


class DropAll(Plugin, Filter):
    """Keeps nothing."""

    type_name = "drop-all"

    def filter(
        self, req: InferenceRequest, state: CycleState, eps: Sequence[Endpoint]
    ) -> Sequence[Endpoint]:
        return []


class FixedScorer(Plugin, Scorer):
    """Scores listed endpoints with fixed values."""

    type_name = "fixed-scorer"

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)
        scores: dict[str, float] = {}

    def __init__(self, name: str, params: BaseModel, plugins: PluginLookup) -> None:
        super().__init__(name, params, plugins)
        assert isinstance(params, FixedScorer.Params)
        self.scores = params.scores

    def score(
        self, req: InferenceRequest, state: CycleState, eps: Sequence[Endpoint]
    ) -> Mapping[EndpointId, float]:
        return {ep.id: self.scores.get(ep.id, 0.0) for ep in eps}


class Best(Plugin, Picker):
    """Highest score first, ties by id."""

    type_name = "best"

    def pick(
        self, state: CycleState, scored: Sequence[ScoredEndpoint], rng: random.Random
    ) -> ProfileResult:
        ordered = sorted(scored, key=lambda s: (-s.score, s.endpoint.id))
        return ProfileResult(tuple(s.endpoint for s in ordered))


class Consumer(Plugin, Filter):
    """Consumes a state key nobody produces."""

    type_name = "consumer"
    consumes: ClassVar[frozenset[str]] = frozenset({"prefix-match"})

    def filter(
        self, req: InferenceRequest, state: CycleState, eps: Sequence[Endpoint]
    ) -> Sequence[Endpoint]:
        return eps


class TwoProfiles(Plugin, ProfileHandler):
    """Runs every profile once; target from the first, prefill from the second."""

    type_name = "two-profiles"

    def pick_profiles(
        self, req: InferenceRequest, state: CycleState, profiles: Sequence[str],
        results: Mapping[str, ProfileResult],
    ) -> Sequence[str]:
        return [p for p in profiles if p not in results]

    def finalize(
        self, req: InferenceRequest, state: CycleState, results: Mapping[str, ProfileResult]
    ) -> RoutingDecision:
        first, second = list(results.values())
        return RoutingDecision(target=first.target, prefill=second.target, profiles=results)


class Empty(Plugin):
    """Implements nothing."""

    type_name = "empty"


class Failing(Plugin, Filter):
    """Its constructor looks up a plugin that must exist."""

    type_name = "needs-other"

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)
        other: str

    def __init__(self, name: str, params: BaseModel, plugins: PluginLookup) -> None:
        super().__init__(name, params, plugins)
        assert isinstance(params, Failing.Params)
        plugins.lookup(params.other)

    def filter(
        self, req: InferenceRequest, state: CycleState, eps: Sequence[Endpoint]
    ) -> Sequence[Endpoint]:
        return eps


def registry(adapter: type[EngineAdapter]) -> Registry:
    classes: list[type[Plugin]] = [
        KeepAll, DropAll, FixedScorer, Best, Consumer, TwoProfiles, Empty, Failing,
    ]
    return Registry(plugins={c.type_name: c for c in classes}, engines={"vllm": adapter})
