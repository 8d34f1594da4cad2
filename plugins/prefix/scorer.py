"""``prefix-cache-scorer``: scores each endpoint by the share of the prompt the producer's
match says it holds (docs/plugins/prefix-cache.md)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field

from kvgate.middleware.framework.plugin import Plugin, PluginLookup, Scorer
from kvgate.middleware.framework.types import CycleState, Endpoint, EndpointId, InferenceRequest
from kvgate.plugins.common.state import PREFIX_MATCH


class PrefixCacheScorer(Plugin, Scorer):
    """Plugin ``prefix-cache-scorer``: the share of the prompt an engine already holds.

    ``score = (device_tokens + other_tier_weight * other_tokens) / prompt_tokens`` in [0, 1];
    engines without a match (or requests without PREFIX_MATCH) score 0.

    Why ``other_tier_weight`` defaults to 0.5: a block on a slower tier (CPU memory, disk, a
    remote store) still saves its prefill compute but must be copied to the GPU first. From CPU
    memory over PCIe that copy costs ~10 % of recomputing it; from disk or over the network
    30-70 %. One weight covers all non-device tiers, so the middle of that range is taken; a
    device hit is always worth more than the same hit on another tier.
    """

    type_name: ClassVar[str] = "prefix-cache-scorer"
    consumes: ClassVar[frozenset[str]] = frozenset({PREFIX_MATCH.name})

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)
        #: Value of a token matched on a non-device tier relative to one on the device (0..1).
        other_tier_weight: float = Field(0.5, ge=0, le=1)

    example_params: ClassVar[Mapping[str, object]] = {"other_tier_weight": 0.5}

    def __init__(self, name: str, params: BaseModel, plugins: PluginLookup) -> None:
        super().__init__(name, params, plugins)
        assert isinstance(params, PrefixCacheScorer.Params)
        self.other_tier_weight = params.other_tier_weight

    def score(
        self, req: InferenceRequest, state: CycleState, eps: Sequence[Endpoint]
    ) -> Mapping[EndpointId, float]:
        match = state.get(PREFIX_MATCH)
        if match is None or match.prompt_tokens <= 0:
            return {}
        total = float(match.prompt_tokens)
        weight = self.other_tier_weight
        return {
            ep.id: min(
                1.0,
                (match.device.get(ep.id, 0) + weight * match.other.get(ep.id, 0)) / total,
            )
            for ep in eps
        }
