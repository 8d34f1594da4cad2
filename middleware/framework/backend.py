"""Model plans and non-HTTP backends: the seam between a model catalog and the gateway.

A request hook (the ``catalog`` plugin) may put a :class:`ModelPlan` in the request's state:
an ordered list of steps, the first tried first, each later one a fallback taken when the
previous step failed before the client's response started with a status in
``fallback_on``. A step is either

* a :class:`PoolStep`: the usual scheduling over the configured engines, restricted to some
  engine names and optionally run with one named routing profile; or
* a :class:`BackendStep`: a call to an in-process :class:`Backend` (e.g. third-party providers
  through LiteLLM), found by ``kind`` in the ``kvgate.engines`` entry-point group. The core
  never imports a backend by name.

Backends answer with plain OpenAI-shaped dicts; the gateway does the HTTP (headers, SSE
framing, usage and completion hooks), so accounting is the same as for self-hosted engines.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

from kvgate.middleware.framework.types import Endpoint, InferenceRequest, StateKey, Usage

#: Statuses after which a plan moves on to its next step: rate limited (429), engine/provider
#: failure (502), nothing available or saturated (503), timeout (504).
DEFAULT_FALLBACK_ON = frozenset({429, 502, 503, 504})


@dataclass(frozen=True, slots=True)
class PoolStep:
    """Serve ``model`` on self-hosted engines (``engines`` None: any engine)."""

    model: str
    engines: frozenset[str] | None = None
    profile: str | None = None


@dataclass(frozen=True, slots=True)
class BackendStep:
    """Serve ``model`` through the backend ``kind`` as ``target`` (e.g.
    ``anthropic/claude-sonnet-4-5``); ``options`` are the backend's own (validated by the
    plugin that built the plan)."""

    model: str
    kind: str
    target: str
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def endpoint(self) -> Endpoint:
        """The pseudo-endpoint hooks and the ledger see (``engine`` = ``kind:target``)."""
        ident = f"{self.kind}:{self.target}"
        return Endpoint(id=ident, url=ident, kind=self.kind, models=frozenset({self.model}))


Step = PoolStep | BackendStep


@dataclass(frozen=True, slots=True)
class ModelPlan:
    """Where a request goes: ``steps`` in order; ``fallback_on`` statuses move to the next."""

    steps: tuple[Step, ...]
    fallback_on: frozenset[int] = DEFAULT_FALLBACK_ON


#: Set by a request hook (the catalog); read by the gateway right after the request hooks.
MODEL_PLAN: StateKey[ModelPlan] = StateKey("model-plan")


@dataclass(frozen=True, slots=True)
class BackendReply:
    """A backend's answer: a whole JSON body, or a stream of OpenAI ``chat.completion.chunk``
    dicts (the first already received, so failures before it could still fall back)."""

    payload: dict[str, Any] | None = None
    chunks: AsyncIterator[dict[str, Any]] | None = None


@runtime_checkable
class Backend(Protocol):
    """A model backend called in-process (no engine URL, no health probes).

    ``open`` raises an ``HTTPError`` (kvgate.middleware.framework.errors) for failures before any
    data (429, 5xx ``UpstreamError`` ... -- what plans fall back on); the chunk iterator raises one
    when the provider breaks off mid-stream. Construction must be cheap and do no I/O.
    """

    kind: ClassVar[str]

    async def open(self, req: InferenceRequest, step: BackendStep) -> BackendReply: ...

    def extract_usage(self, payload: Mapping[str, Any]) -> Usage | None:
        """Usage of a JSON answer or chunk (``cached_tokens`` None when unknown)."""
        ...
