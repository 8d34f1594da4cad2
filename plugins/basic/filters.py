"""Basic filters: health, model, role. Pure and synchronous; no state."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict

from kvgate.middleware.framework.plugin import Filter, Plugin, PluginLookup
from kvgate.middleware.framework.types import CycleState, Endpoint, InferenceRequest, Role


class HealthFilter(Plugin, Filter):
    """``health-filter``: keeps the endpoints the pool considers healthy.

    Algorithm: keep ``ep.healthy``. Health comes from the pool's probes (``GET /health`` every
    ``pool.health_interval_s``), from connection errors on the request path, and from the
    engine's circuit breaker (middleware/fleet/breaker.py: open, or half-open with its one trial
    request in flight, is not healthy). No params.
    If nothing is left the scheduler answers 503.
    """

    type_name = "health-filter"

    def filter(
        self, req: InferenceRequest, state: CycleState, eps: Sequence[Endpoint]
    ) -> Sequence[Endpoint]:
        return [ep for ep in eps if ep.healthy]


class ModelFilter(Plugin, Filter):
    """``model-filter``: keeps the endpoints that serve the requested model.

    Algorithm: keep endpoints whose ``models`` contain ``req.model``. Params:
    ``keep_unknown`` (bool, default true): also keep endpoints whose model list is still empty
    (not yet discovered from ``/v1/models``) — true because an engine that was down at startup
    should get traffic once healthy, and the engine itself answers 404 for a model it lacks.
    """

    type_name = "model-filter"

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)
        keep_unknown: bool = True

    example_params = {"keep_unknown": False}

    def __init__(self, name: str, params: BaseModel, plugins: PluginLookup) -> None:
        super().__init__(name, params, plugins)
        assert isinstance(params, ModelFilter.Params)
        self.keep_unknown = params.keep_unknown

    def filter(
        self, req: InferenceRequest, state: CycleState, eps: Sequence[Endpoint]
    ) -> Sequence[Endpoint]:
        model = req.model
        return [
            ep for ep in eps
            if model in ep.models or (self.keep_unknown and not ep.models)
        ]


class RoleFilter(Plugin, Filter):
    """``role-filter``: keeps endpoints of one prefill/decode role.

    Params: ``role`` (``prefill`` | ``decode`` | ``both``, required); ``include_both`` (bool,
    default true): also keep ``both`` endpoints, which can serve either side of a split.
    """

    type_name = "role-filter"

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)
        role: Role
        include_both: bool = True

    example_params = {"role": "decode"}

    def __init__(self, name: str, params: BaseModel, plugins: PluginLookup) -> None:
        super().__init__(name, params, plugins)
        assert isinstance(params, RoleFilter.Params)
        roles = {params.role}
        if params.include_both:
            roles.add(Role.BOTH)
        self.roles = frozenset(roles)

    def filter(
        self, req: InferenceRequest, state: CycleState, eps: Sequence[Endpoint]
    ) -> Sequence[Endpoint]:
        return [ep for ep in eps if ep.role in self.roles]
