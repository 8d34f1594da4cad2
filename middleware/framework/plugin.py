"""Extension points: one small Protocol each. A plugin class inherits the ones it implements.

Scheduling (Filter, Scorer, Picker, ProfileHandler) is synchronous and does no I/O.
All I/O happens in the async hooks. See docs/architecture.md.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from pydantic import BaseModel, ConfigDict

from kvgate.middleware.framework.types import (
    CycleState,
    Endpoint,
    EndpointId,
    InferenceRequest,
    LoopbackResponse,
    Outcome,
    Principal,
    ProfileResult,
    Receive,
    RoutingDecision,
    Scope,
    ScoredEndpoint,
    Send,
    Usage,
)


class NoParams(BaseModel):
    """Params model for plugins without parameters: any key is an error."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class PluginLookup(Protocol):
    """Handle given to plugin constructors to find other plugin instances by name."""

    def lookup(self, name: str) -> object: ...


class Plugin:
    """Base class of every plugin.

    Subclasses set ``type_name`` (the config ``type``), ``Params`` (a pydantic model with
    ``extra="forbid"``), and ``produces`` / ``consumes`` (names of :class:`StateKey` s they write
    or read, checked at startup).
    """

    type_name: ClassVar[str] = ""
    Params: ClassVar[type[BaseModel]] = NoParams
    #: Valid params used by the contract tests and docs (must validate against ``Params``).
    example_params: ClassVar[Mapping[str, object]] = {}
    produces: ClassVar[frozenset[str]] = frozenset()
    consumes: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, name: str, params: BaseModel, plugins: PluginLookup) -> None:
        self.name = name
        self.params = params


@runtime_checkable
class Filter(Protocol):
    """Keep the endpoints that may serve this request (sync, no I/O)."""

    def filter(
        self, req: InferenceRequest, state: CycleState, eps: Sequence[Endpoint]
    ) -> Sequence[Endpoint]: ...


@runtime_checkable
class Scorer(Protocol):
    """A score in [0, 1] per endpoint (sync, no I/O). Missing ids score 0; the framework clamps."""

    def score(
        self, req: InferenceRequest, state: CycleState, eps: Sequence[Endpoint]
    ) -> Mapping[EndpointId, float]: ...


@runtime_checkable
class Picker(Protocol):
    """Order the scored endpoints best first (sync, no I/O). Exactly one per profile."""

    def pick(
        self, state: CycleState, scored: Sequence[ScoredEndpoint], rng: random.Random
    ) -> ProfileResult: ...


@runtime_checkable
class ProfileHandler(Protocol):
    """Which profiles run, and how their results combine into a decision (sync, no I/O).

    ``pick_profiles`` is called repeatedly with the results so far until it returns nothing.
    """

    def pick_profiles(
        self,
        req: InferenceRequest,
        state: CycleState,
        profiles: Sequence[str],
        results: Mapping[str, ProfileResult],
    ) -> Sequence[str]: ...

    def finalize(
        self, req: InferenceRequest, state: CycleState, results: Mapping[str, ProfileResult]
    ) -> RoutingDecision: ...


@runtime_checkable
class Authenticator(Protocol):
    """Checks the client's credentials before any other work (at most one per gateway): the
    ``Authorization`` header and Anthropic's ``x-api-key`` header (what the anthropic SDK and
    Claude Code send), both None when absent.

    Raises Unauthorized (401); the returned principal sets the request's tenant and key id.
    Route plugins may call it too (e.g. admin endpoints, :func:`authenticate`).
    """

    def authenticate(self, authorization: str | None, api_key: str | None = None) -> Principal:
        ...


@runtime_checkable
class PrincipalLookup(Protocol):
    """Optional for an Authenticator: the principal of a key id as it stands now (deferred
    jobs store the key id, never a secret, and run as that key's current principal; None: the
    key is gone, the job fails with 401)."""

    def principal_for(self, key_id: str) -> Principal | None: ...


#: Request headers carrying the client's credentials: never in ``InferenceRequest.headers``,
#: never logged or forwarded to an engine.
CREDENTIAL_HEADERS = frozenset({"authorization", "x-api-key"})


def authenticate(auth: Authenticator, headers: Mapping[str, str]) -> Principal:
    """``auth``'s principal for lower-cased request ``headers`` (their credential headers)."""
    return auth.authenticate(headers.get("authorization"), headers.get("x-api-key"))


def allowed_models(principal: Principal | None) -> frozenset[str] | None:
    """The principal's model allow-list (a ``models`` frozenset, as api-keys' keys carry);
    None: every model."""
    models = getattr(principal, "models", None)
    return models if isinstance(models, frozenset) else None


@runtime_checkable
class RequestHook(Protocol):
    """Runs first for every inference request: auth, catalog, admission. May raise HTTPError."""

    async def on_request(self, req: InferenceRequest, state: CycleState) -> None: ...


@runtime_checkable
class DataProducer(Protocol):
    """Computes data the scorers consume (tokenization, prefix lookup) before scheduling."""

    async def prepare(
        self, req: InferenceRequest, state: CycleState, eps: Sequence[Endpoint]
    ) -> None: ...


@runtime_checkable
class DispatchHook(Protocol):
    """Runs after scheduling, before the request is sent (e.g. speculative index insertion)."""

    async def before_dispatch(
        self, req: InferenceRequest, state: CycleState, decision: RoutingDecision
    ) -> None: ...


@runtime_checkable
class UsageHook(Protocol):
    """Receives the engine's usage once it is known, before the client's response ends (JSON:
    before it starts; streams: before the event carrying the usage and ``[DONE]`` are relayed),
    so what the hook makes durable survives a crash after the client got its answer."""

    async def on_usage(
        self, req: InferenceRequest, state: CycleState, target: Endpoint, usage: Usage
    ) -> None: ...


@runtime_checkable
class CompletionHook(Protocol):
    """Runs exactly once per dispatched request, on every outcome."""

    async def on_complete(
        self, req: InferenceRequest, state: CycleState, target: Endpoint, outcome: Outcome
    ) -> None: ...


@runtime_checkable
class RequestEndHook(Protocol):
    """Runs exactly once for every inference request whose request hooks started, once its
    answer (or error) has been sent, on every path: dispatched or not (a later hook refused
    it, no engine, deferred, client gone). ``status`` is what the client got (499: it left).
    Releases what a request hook took (quota slots, reservations); must not raise."""

    async def on_request_end(self, req: InferenceRequest, state: CycleState,
                             status: int) -> None: ...


@runtime_checkable
class AdmissionGate(Protocol):
    """Decides *when* a request may be scheduled (flow control): asked by the dispatcher after
    the request hooks, before the data producers and the scheduler run. Returns None when the
    request may go on now (the common case, no await), else the wait (a coroutine) that the
    dispatcher races against the client's disconnect (a client that leaves cancels it) and
    that returns once the request may go on (late binding: the engine is picked after the
    wait); raises HTTPError, at once or from the wait, to refuse it (429 / 503 with
    ``Retry-After``). ``eps``: the engines the request may use. ``queued``: live requests
    waiting in the gate now (the async queue's headroom gate stays closed while any wait:
    deferred work sits below every live request)."""

    def admit(self, req: InferenceRequest, state: CycleState,
              eps: Sequence[Endpoint]) -> Coroutine[Any, Any, None] | None: ...

    def queued(self) -> int: ...


@runtime_checkable
class PrefillHook(Protocol):
    """Told when the prefill hop of a two-hop (prefill/decode) request has ended, before the
    request completes (e.g. to release in-flight prefill load early). ``ok``: the prefill
    answered; False: it failed or was cancelled (the request may then be decoded locally)."""

    async def on_prefill_done(
        self, req: InferenceRequest, state: CycleState, prefill: Endpoint, ok: bool
    ) -> None: ...


@runtime_checkable
class EndpointSetListener(Protocol):
    """Told when endpoints join or leave the pool (e.g. to drop their index entries)."""

    def on_endpoints_changed(
        self, added: Sequence[Endpoint], removed: Sequence[Endpoint]
    ) -> None: ...


@runtime_checkable
class Lifecycle(Protocol):
    """Plugins owning background work: the app's lifespan starts and stops them."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


@runtime_checkable
class Persistent(Protocol):
    """Plugins whose routing state is worth keeping across a restart (session pins, cache
    pressure): the app writes :meth:`snapshot` to ``server.routing_state_dir`` periodically and
    at shutdown, and hands it back to :meth:`restore` at startup, before the first request
    (middleware/serving/routing_state.py)."""

    def snapshot(self) -> dict[str, object]:
        """A JSON-able copy of the state, taken on the event loop (cheap: it is bounded)."""
        ...

    def restore(self, data: dict[str, object]) -> int:
        """Take back a snapshot (possibly from an older build: validate, raise ValueError /
        TypeError / KeyError when it cannot be used); returns the entries restored."""
        ...


@dataclass(frozen=True, slots=True)
class HttpRequest:
    """A non-inference request routed to a plugin. ``headers`` are lower-cased and *include*
    the credential headers (``authorization``, ``x-api-key``: route handlers authenticate
    themselves, :func:`authenticate`); never log them."""

    method: str
    path: str
    query: Mapping[str, Sequence[str]]
    headers: Mapping[str, str]
    body: bytes


@dataclass(frozen=True, slots=True)
class HttpResponse:
    status: int
    body: bytes
    content_type: str = "application/json"
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Route:
    """``method`` + exact ``path`` served by ``handler`` (which may raise HTTPError)."""

    method: str
    path: str
    handler: Callable[[HttpRequest], Awaitable[HttpResponse]]


@runtime_checkable
class RouteProvider(Protocol):
    """Plugins serving extra HTTP endpoints (usage API, admin). Paths must be unique."""

    def routes(self) -> Sequence[Route]: ...


@runtime_checkable
class MetricsSource(Protocol):
    """Plugins exporting Prometheus metrics: the app registers the collector in its registry."""

    def collector(self) -> Collector: ...


class NoMetrics(Collector):
    """A collector with nothing to export (for a :class:`MetricsSource` with nothing to say in
    its current configuration)."""

    def collect(self) -> Iterator[Metric]:
        return iter(())


@runtime_checkable
class HealthSource(Protocol):
    """Plugins reporting their own state on ``GET /health``: the app puts what ``health()``
    returns (JSON-serializable; an empty mapping adds nothing) under ``plugins.<plugin name>``.
    Called on every ``/health`` request: cheap and synchronous, no I/O. It never changes the
    status code (``/health`` stays 200 while engines serve)."""

    def health(self) -> Mapping[str, object]: ...


@runtime_checkable
class ModelCatalog(Protocol):
    """At most one per gateway: the public model list (``GET /v1/models``, ``/v1/models/{id}``)
    and the backends behind it. ``check`` runs at startup with what the config declares and
    raises ConfigError on a dangling reference."""

    def check(self, engines: Mapping[str, frozenset[str]], profiles: frozenset[str],
              backends: frozenset[str]) -> None:
        """``engines``: engine name -> configured models (empty: discovered at run time)."""
        ...

    def backend_kinds(self) -> frozenset[str]:
        """The in-process backend kinds its models use (started with the app)."""
        ...

    def list_models(self, principal: Principal | None) -> Sequence[Mapping[str, object]]:
        """The models ``principal`` may use, as OpenAI model objects."""
        ...

    def get_model(self, model_id: str, principal: Principal | None) -> Mapping[str, object]:
        """One model object by name or alias; ModelNotFound (with close names) otherwise."""
        ...


class AsgiApp(Protocol):
    """An ASGI application (e.g. a FastAPI sub-application)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None: ...


@runtime_checkable
class AsgiMount(Protocol):
    """Plugins serving a whole sub-application: each ``(prefix, app)`` gets every request whose
    path is ``prefix`` or starts with ``prefix + "/"`` (the scope unchanged: the app sees the
    full path). Checked after the API routes (their hot path is unchanged); a prefix covering
    a core, API or plugin route, or another mount's, is refused at startup."""

    def mounts(self) -> Sequence[tuple[str, AsgiApp]]: ...


class LoopbackCaller(Protocol):
    """The gateway's in-process caller as a plugin sees it (middleware/framework/loopback.py)."""

    def endpoints(self) -> Sequence[Endpoint]:
        """The engine pool's current snapshot."""
        ...

    def live_queued(self) -> int:
        """Live requests waiting in the gateway's flow control now (0 without one)."""
        ...

    def authenticate(self, headers: Mapping[str, str]) -> Principal | None:
        """The gateway's authenticator on lower-cased headers (None: no authenticator)."""
        ...

    @property
    def has_auth(self) -> bool: ...

    def principal_for(self, key_id: str | None) -> Principal | None:
        """The principal of a key id as the authenticator knows it now, if it can say."""
        ...

    async def call(
        self, method: str, path: str, body: bytes, *, principal: Principal | None = None,
        request_id: str | None = None, tier: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> LoopbackResponse:
        """Run one API request through the gateway's whole request path."""
        ...


@runtime_checkable
class NeedsLoopback(Protocol):
    """Plugins that run API requests through the gateway's own request path later (deferred
    jobs): the app hands them its :class:`LoopbackCaller` before startup."""

    def bind_loopback(self, loopback: LoopbackCaller) -> None: ...


@dataclass(frozen=True, slots=True)
class Deferred:
    """The answer sent instead of dispatching a request that a :class:`RequestDeferral` took
    over (e.g. 202 with a queued request's id)."""

    status: int
    body: bytes
    headers: Mapping[str, str] = field(default_factory=dict)
    content_type: str = "application/json"


@runtime_checkable
class RequestDeferral(Protocol):
    """Consulted after the request hooks (auth context, catalog, allow-lists have run), before
    dispatch: a :class:`Deferred` is sent as the answer and nothing is dispatched; None lets the
    request go on. ``path`` is the route's path (``/v1/chat/completions``). May raise
    HTTPError (a bad queue header is a 400)."""

    async def defer(self, req: InferenceRequest, adapter_name: str,
                    path: str) -> Deferred | None: ...


@runtime_checkable
class StateResolver(Protocol):
    """Answers by-id routes (``GET /v1/responses/{id}``) for ids the engines do not hold yet
    (a background response still queued): consulted after authentication, before the StateMap
    lookup. None: not one of its ids (the StateMap decides)."""

    async def resolve(self, adapter_name: str, method: str, state_id: str,
                      principal: Principal | None) -> HttpResponse | None: ...


SLOTS: Mapping[str, type] = {
    "filter": Filter,
    "scorer": Scorer,
    "picker": Picker,
    "profile-handler": ProfileHandler,
    "authenticator": Authenticator,
    "request-hook": RequestHook,
    "data-producer": DataProducer,
    "dispatch-hook": DispatchHook,
    "usage-hook": UsageHook,
    "completion-hook": CompletionHook,
    "request-end-hook": RequestEndHook,
    "prefill-hook": PrefillHook,
    "admission-gate": AdmissionGate,
    "endpoint-set-listener": EndpointSetListener,
    "lifecycle": Lifecycle,
    "metrics-source": MetricsSource,
    "health-source": HealthSource,
    "route-provider": RouteProvider,
    "model-catalog": ModelCatalog,
    "asgi-mount": AsgiMount,
    "needs-loopback": NeedsLoopback,
    "request-deferral": RequestDeferral,
    "state-resolver": StateResolver,
}


def slots_of(obj: object) -> frozenset[str]:
    """The extension points an object implements."""
    return frozenset(name for name, proto in SLOTS.items() if isinstance(obj, proto))
