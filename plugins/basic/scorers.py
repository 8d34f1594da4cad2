"""Basic scorers. Pure and synchronous; no state."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict

from kvgate.middleware.framework.plugin import Plugin, PluginLookup, Scorer
from kvgate.middleware.framework.types import CycleState, Endpoint, EndpointId, InferenceRequest


class LeastInFlightScorer(Plugin, Scorer):
    """``least-in-flight-scorer``: prefers endpoints with less work in flight through this gateway.

    Algorithm: ``score = 1 - x / max(x)`` over the candidates, where ``x`` is the endpoint's
    in-flight requests (``by: requests``) or estimated in-flight prompt tokens
    (``by: tokens``); when all are equal (including all idle) every endpoint scores 1.0.
    Normalising by the maximum (not the sum) keeps the idlest engine at 1.0 and the busiest at
    0.0 whatever the absolute load, so the scorer's weight means the same at any traffic level.
    Params: ``by`` (``requests`` | ``tokens``, default ``requests``).
    """

    type_name = "least-in-flight-scorer"

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)
        by: Literal["requests", "tokens"] = "requests"

    example_params = {"by": "tokens"}

    def __init__(self, name: str, params: BaseModel, plugins: PluginLookup) -> None:
        super().__init__(name, params, plugins)
        assert isinstance(params, LeastInFlightScorer.Params)
        self.by_tokens = params.by == "tokens"

    def score(
        self, req: InferenceRequest, state: CycleState, eps: Sequence[Endpoint]
    ) -> Mapping[EndpointId, float]:
        loads = {
            ep.id: float(ep.in_flight_tokens if self.by_tokens else ep.in_flight_requests)
            for ep in eps
        }
        top = max(loads.values(), default=0.0)
        if top <= 0:
            return dict.fromkeys(loads, 1.0)
        return {ep_id: 1.0 - load / top for ep_id, load in loads.items()}
