"""Framework data types shared by the core, plugins and engine adapters.

Everything here is plain data: no I/O, no global state.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar, cast

from kvgate.middleware.framework.immutable import immutable

#: Raw ASGI, which the gateway speaks directly (middleware/transport/asgi.py).
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

EndpointId = str
T = TypeVar("T")


class Role(enum.StrEnum):
    """What an engine does: everything, or one side of a prefill/decode split."""

    BOTH = "both"
    PREFILL = "prefill"
    DECODE = "decode"


class Api(enum.StrEnum):
    """Names of the two OpenAI APIs (``InferenceRequest.api`` is any adapter's name, a str;
    these constants remain for code and tests that build requests by hand)."""

    CHAT = "chat"
    COMPLETIONS = "completions"


@immutable
class ChatPrompt:
    """A conversation the engine renders with the model's chat template (OpenAI chat shape:
    ``{"role", "content", "tool_calls"?, ...}`` messages), which is how vLLM serves chat,
    Anthropic Messages and Responses alike: adapters of those APIs convert to this view."""

    messages: Sequence[Mapping[str, Any]]
    tools: Sequence[Mapping[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    #: Extra template variables (``chat_template_kwargs``, ``documents``).
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)


@immutable
class TextPrompt:
    """Plain text the engine tokenizes as is (completions, embeddings of a string)."""

    text: str
    add_special_tokens: bool = True


@immutable
class TokenPrompt:
    """Token ids the client sent: the engine's own, exact without a tokenizer."""

    ids: Sequence[int]


#: What prefix-aware routing matches (``InferenceRequest.prompt``; None: nothing to match).
Prompt = ChatPrompt | TextPrompt | TokenPrompt


#: ``EngineMetrics.extra`` key of an engine's KV capacity in tokens (adapters that know it set
#: it, e.g. vLLM's ``num_gpu_blocks x block_size``; routing plugins read it).
KV_CAPACITY_TOKENS = "kv_capacity_tokens"


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """What the pool last scraped from an engine's ``/metrics`` (``None``: not reported)."""

    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None  # fraction of KV cache in use, 0..1
    prefix_cache_hits: float | None = None  # tokens, cumulative
    prefix_cache_queries: float | None = None  # tokens, cumulative
    scraped_at: float | None = None  # time.monotonic() of the scrape
    extra: Mapping[str, float] = field(default_factory=dict)


@immutable
class Endpoint:
    """An immutable snapshot of one engine, handed to scheduling plugins per request."""

    id: EndpointId
    url: str
    kind: str
    role: Role = Role.BOTH
    models: frozenset[str] = frozenset()
    healthy: bool = True
    in_flight_requests: int = 0
    in_flight_tokens: int = 0
    metrics: EngineMetrics = field(default_factory=EngineMetrics)
    labels: Mapping[str, str] = field(default_factory=dict)
    kv_events: str | None = None
    kv_events_replay: str | None = None


@dataclass(slots=True)
class InferenceRequest:
    """One client request as the pipeline sees it.

    ``headers`` are lower-cased and never contain the credential
    headers (``authorization``, ``x-api-key``).
    ``body`` is the parsed JSON body; plugins may add engine fields before dispatch.
    ``api`` is the name of the client API's adapter (``chat``, ``completions``, ``messages``
    ...; see middleware/framework/api.py); ``prompt`` what routing matches, in the adapter's view
    (plugins read it instead of the body, so they work for every API).
    """

    request_id: str
    api: str
    model: str
    body: dict[str, Any]
    headers: Mapping[str, str]
    stream: bool
    client_wants_usage: bool
    prompt_token_estimate: int
    received_at: float
    tenant: str | None = None
    key_id: str | None = None
    #: The client's body bytes, forwarded as-is unless the body was changed (see update_body).
    raw_body: bytes | None = None
    #: The authenticated caller (None when no Authenticator is configured).
    principal: Principal | None = None
    #: The client's ``x-request-id`` (None when it sent none); ``request_id`` is kvgate's own.
    client_request_id: str | None = None
    #: What prefix-aware routing matches (None: nothing; e.g. tokenize, embeddings).
    prompt: Prompt | None = None
    #: False for requests that are not billed (tokenize, detokenize): no ledger record.
    billed: bool = True
    #: The pricing tier of a deferred run (``batch``, ``queued``, ``background``: the job's
    #: kind, set through middleware/framework/loopback.py); None for live traffic.
    service_tier: str | None = None

    @property
    def api_name(self) -> str:
        """The client API's adapter name (same as ``api``)."""
        return str(self.api)

    def update_body(self, **fields: Any) -> None:
        """Set body fields for the engine; the body is re-serialized before dispatch."""
        self.body.update(fields)
        self.raw_body = None


class Principal(Protocol):
    """Who is calling, as established by the Authenticator plugin."""

    @property
    def tenant(self) -> str: ...

    @property
    def key_id(self) -> str: ...


class StateKey(str, Generic[T]):
    """A typed key into :class:`CycleState`; plugins declare the names they produce/consume.

    A ``str`` (its name): the state's dict hashes and compares it in C, so
    :meth:`CycleState.get` and :meth:`CycleState.put` are the dict's own methods, with no
    Python frame per call (~35 calls per request)."""

    __slots__ = ()

    @property
    def name(self) -> str:
        return str.__str__(self)

    def __repr__(self) -> str:
        return f"StateKey({self.name!r})"


class _StateGet(Protocol):
    def __call__(self, key: StateKey[T], default: T | None = None, /) -> T | None: ...


class _StatePut(Protocol):
    def __call__(self, key: StateKey[T], value: T, /) -> None: ...


class CycleState:
    """Per-request scratch space shared by plugins; dropped when the request ends.

    ``get(key, default=None)`` and ``put(key, value)`` are the bound methods of the state's
    dict (typed through :class:`StateKey`): plugins call them ~35 times per request."""

    __slots__ = ("_data", "get", "put")

    def __init__(self) -> None:
        data: dict[str, object] = {}
        self._data = data
        self.get: _StateGet = data.get  # type: ignore[assignment]
        self.put: _StatePut = data.__setitem__

    def require(self, key: StateKey[T]) -> T:
        if key not in self._data:
            raise KeyError(f"cycle state has no {key.name!r}")
        return cast(T, self._data[key])

    def __contains__(self, key: StateKey[Any]) -> bool:
        return key in self._data


#: Headers plugins want on the client's response (e.g. the session header echoed, the cost).
#: Set by request/producer/dispatch/usage hooks; for streams only what is set before the first
#: byte is sent; for JSON answers usage hooks run before the response starts.
RESPONSE_HEADERS: StateKey[dict[str, str]] = StateKey("response-headers")


def add_response_header(state: CycleState, name: str, value: str) -> None:
    """Ask the gateway to send ``name: value`` on this request's response."""
    headers = state.get(RESPONSE_HEADERS)
    if headers is None:
        headers = {}
        state.put(RESPONSE_HEADERS, headers)
    headers[name.lower()] = value


#: Fields plugins add to the request's access-log line (short strings or numbers; never a
#: secret). A core field of the same name wins (middleware/observe/access_log.py).
LOG_FIELDS: StateKey[dict[str, object]] = StateKey("access-log-fields")


def add_log_field(state: CycleState, name: str, value: object) -> None:
    """Put ``name: value`` on this request's access-log line (JSON-serializable values)."""
    fields = state.get(LOG_FIELDS)
    if fields is None:
        fields = {}
        state.put(LOG_FIELDS, fields)
    fields[name] = value


@immutable
class ScoredEndpoint:
    endpoint: Endpoint
    score: float


@immutable
class ProfileResult:
    """A profile's choice: endpoints best first (the first is the target, the rest fallbacks)."""

    endpoints: tuple[Endpoint, ...]

    @property
    def target(self) -> Endpoint:
        return self.endpoints[0]


@immutable
class RoutingDecision:
    """Where a request goes: ``target`` serves the response; ``prefill`` runs a first hop if set."""

    target: Endpoint
    alternates: tuple[Endpoint, ...] = ()
    prefill: Endpoint | None = None
    profiles: Mapping[str, ProfileResult] = field(default_factory=dict)


@immutable
class Usage:
    """Token usage as reported by an engine. ``cached_tokens`` is ``None`` when not reported."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = None
    #: Prompt tokens written to a provider's prompt cache (Anthropic's
    #: ``cache_creation_input_tokens``), part of ``prompt_tokens``, billed at the cache-write
    #: rate; 0 for engines, which report none.
    cache_write_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class OutcomeKind(enum.StrEnum):
    DONE = "done"
    UPSTREAM_ERROR = "upstream_error"
    CLIENT_DISCONNECT = "client_disconnect"


@immutable
class Outcome:
    """How a dispatched request ended. Completion hooks receive it on every path."""

    kind: OutcomeKind
    status: int
    usage: Usage | None = None
    ttft_s: float | None = None
    total_s: float = 0.0
    error: str | None = None
    #: The gateway retries this request on another engine (this attempt's outcome is final
    #: for this dispatch only).
    will_retry: bool = False
    #: SSE data events relayed to the client (streams), a lower bound on tokens generated.
    chunks_relayed: int = 0


@dataclass(frozen=True, slots=True)
class LoopbackResponse:
    """The answer of one in-process call through the gateway (middleware/framework/loopback.py)."""

    status: int
    #: Lower-cased response header names.
    headers: Mapping[str, str]
    body: bytes

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "application/json")
