"""Client-facing API adapters: one module per API, one request path for all of them.

An API (OpenAI chat completions, completions, Anthropic Messages, OpenAI Responses, embeddings,
tokenize ...) is an :class:`ApiAdapter`: it parses and validates its body, says what prompt
routing should match (:data:`Prompt`, rendered by the engine the way the tokenizer plugin
renders it), shapes the body for the engine, reads usage from the engine's answer (JSON or
SSE, :class:`UsageTap`), rewrites cached tokens under prefill/decode, and renders errors in
its own shape. The core (one request object, one dispatcher) never branches on the API; a new
API is one new module in ``apis/`` registered in the ``kvgate.apis`` entry-point group.

Adapters are pure: no I/O, no global state. Per-request state lives in the tap.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

from middleware.errors import HTTPError
from middleware.types import Usage


@dataclass(frozen=True, slots=True)
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


@dataclass(frozen=True, slots=True)
class TextPrompt:
    """Plain text the engine tokenizes as is (completions, embeddings of a string)."""

    text: str
    add_special_tokens: bool = True


@dataclass(frozen=True, slots=True)
class TokenPrompt:
    """Token ids the client sent: the engine's own, exact without a tokenizer."""

    ids: Sequence[int]


#: What prefix-aware routing matches; ``None`` in :class:`ParsedRequest`: nothing to match.
Prompt = ChatPrompt | TextPrompt | TokenPrompt


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """What the core needs from a body; the body itself stays the client's (bytes forwarded
    unchanged unless a plugin or :meth:`ApiAdapter.prepare_body` changes it)."""

    model: str
    stream: bool
    prompt: Prompt | None
    #: Prompt tokens before any tokenizer ran (bytes / 4 for text), for token load.
    prompt_token_estimate: int
    #: Whether the client's own stream asked for usage (OpenAI ``stream_options``); APIs whose
    #: streams always carry usage (Messages, Responses) say True.
    client_wants_usage: bool = True
    #: State held by one engine that this request needs (Responses ``previous_response_id``):
    #: the core sends the request to the engine that answered that id, if it still serves.
    requires_state: str | None = None


@dataclass(frozen=True, slots=True)
class SseEvent:
    """One server-sent event: ``event:`` name (None when absent) and the ``data:`` JSON."""

    name: str | None
    data: dict[str, Any]


@runtime_checkable
class UsageTap(Protocol):
    """Reads one dispatch's usage from the engine's answer; may edit what the client sees.

    One tap per dispatch (:meth:`ApiAdapter.new_tap`). ``usage`` is the normalised
    :class:`Usage` (``prompt_tokens`` includes cached and cache-written tokens;
    ``cached_tokens`` None when the engine did not say) once known, else None. ``final`` is True
    once no later event can change it: the core runs usage hooks (the durable ledger record)
    before relaying the event that made it final.
    """

    usage: Usage | None
    final: bool
    #: Ids of state the answer created on the engine (Responses ``id``), for ``requires_state``.
    state_ids: list[str]

    def on_json(self, payload: dict[str, Any]) -> None:
        """A whole (non-streaming) answer."""
        ...

    def on_event(self, event: SseEvent) -> bool:
        """One SSE event whose data is JSON. Return False to drop it from the client's stream
        (a usage chunk the client did not ask for); edits to ``event.data`` are relayed."""
        ...


@runtime_checkable
class ApiAdapter(Protocol):
    """One client-facing API. Found through the ``kvgate.apis`` entry-point group."""

    #: Metric label, ledger ``api`` field, error-shape key (``chat``, ``messages`` ...).
    name: ClassVar[str]
    #: ``(method, path)`` the adapter serves; a ``{id}`` segment matches one path segment.
    routes: ClassVar[tuple[tuple[str, str], ...]]
    #: Whether prefill/decode two-hop serving applies (False: always one hop).
    disaggregable: ClassVar[bool]

    def parse(self, data: dict[str, Any], headers: Mapping[str, str]) -> ParsedRequest:
        """Validate the parsed JSON body (:class:`middleware.errors.BadRequest` with
        ``param``); shallow: fields the gateway relies on, the engine judges the rest."""
        ...

    def upstream_path(self, path: str) -> str:
        """The engine path for a client path (usually the same)."""
        ...

    def prepare_body(self, body: dict[str, Any], stream: bool) -> dict[str, Any] | None:
        """Changes the engine needs (e.g. force a stream's usage chunk): a new dict, or None
        to forward the client's bytes unchanged."""
        ...

    def new_tap(self, client_wants_usage: bool) -> UsageTap:
        ...

    def set_cached_tokens(self, payload: dict[str, Any], cached: int) -> bool:
        """Prefill/decode: make the usage in ``payload`` (an answer or a usage-carrying event's
        data) report ``cached`` cached prompt tokens, keeping its own conventions consistent
        (Anthropic: ``input_tokens`` excludes cache reads). True if it changed anything."""
        ...

    def error_body(self, err: HTTPError) -> bytes:
        """The JSON error body in this API's shape (status is ``err.status``)."""
        ...

    def stream_error(self, message: str) -> bytes:
        """The SSE bytes that end a stream the engine broke, in this API's shape."""
        ...


__all__ = [
    "ApiAdapter",
    "ChatPrompt",
    "ParsedRequest",
    "Prompt",
    "SseEvent",
    "TextPrompt",
    "TokenPrompt",
    "UsageTap",
]
