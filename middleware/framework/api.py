"""Client-facing API adapters: one module per API, one request path for all of them.

An API (OpenAI chat completions, completions, Anthropic Messages, OpenAI Responses, embeddings,
tokenize ...) is an :class:`ApiAdapter`: it parses and validates its body, says what prompt
routing should match (:data:`Prompt`, rendered by the engine the way the tokenizer plugin
renders it), shapes the body for the engine, reads usage from the engine's answer (JSON or
SSE, :class:`UsageTap`), rewrites cached tokens under prefill/decode, and renders errors in
its own shape. The core (one request object, one dispatcher) never branches on the API; a new
API is one new module in ``apis/`` registered in the ``kvgate.apis`` entry-point group.

Adapters are pure: no I/O, no global state. Per-request state lives in the tap.

What the core does with an adapter (middleware/serving/gateway.py, middleware/serving/dispatch.py):

1. The app routes each of the adapter's ``routes``; two adapters (or an adapter and a core or
   plugin path) claiming the same ``(method, path)`` is a startup error.
2. The body is read (413 past ``server.max_body_bytes``) and parsed once with orjson (400 for
   malformed JSON or a non-object), then :meth:`ApiAdapter.parse` validates it. The request
   carries ``api = adapter.name`` and ``prompt = parsed.prompt``; plugins read those.
3. Auth, request hooks (catalog, allow-lists), producers, scheduling, dispatch hooks run as
   for any API; ``requires_state`` pins the request to the engine that created that state.
4. The body sent is the client's bytes unchanged, unless a plugin changed it
   (``InferenceRequest.update_body``) or :meth:`ApiAdapter.prepare_body` returned a new dict
   (then it is serialised once with orjson). The path is :meth:`ApiAdapter.upstream_path`.
5. The answer is read through one :class:`UsageTap` per dispatch: JSON whole (``on_json``;
   the engine's bytes are relayed unchanged unless a P/D usage rewrite changed them), SSE event
   by event (``on_event``; only events containing one of the tap's ``markers`` are parsed,
   the others are relayed untouched). Usage hooks run once per dispatch when the usage is
   final, before the bytes carrying it are sent; ``state_ids`` are remembered after a
   successful dispatch.
6. Every ``HTTPError`` raised after the adapter is known is rendered by
   :meth:`ApiAdapter.error_body`; a stream the engine breaks ends with
   :meth:`ApiAdapter.stream_error`. Engine 4xx answers (:class:`UpstreamHTTPError`) too:
   never the engine's bytes (its shape need not be the API's: vLLM answers ``/v1/messages``
   validation errors in OpenAI's shape; its body may quote paths or a traceback), but its
   status and its message, cleaned and capped (``err.message``, middleware/framework/redact.py).

**By-id routes.** A route whose path has an ``{id}`` segment (``GET /v1/responses/{id}``,
``POST /v1/responses/{id}/cancel``) is served without a body model: after authentication the
core looks the id up among the ``state_ids`` earlier answers produced, forwards the method,
path and query (and body, if any) to the engine that holds it and relays its answer as is
(status, content type, streamed bytes). An unknown id (or one created under another tenant)
is a 404 in the adapter's shape; its engine out of rotation, a 503. ``parse``, taps and
request hooks are not used for them.

**Optional attributes** (read with defaults, so older adapters keep working):
``ApiAdapter.billed`` (default True; False: the billing plugin records nothing, e.g.
tokenize), ``UsageTap.markers`` (default: every event is parsed) and ``UsageTap.sse_done``
(default False; True: the stream ends with ``data: [DONE]``, and one without it broke; False:
a stream is complete once the tap is ``final``).

**Options.** An adapter class may declare ``Params``, a pydantic model (``extra="forbid"``) of
its options: the config's ``apis.<name>`` section is validated against it at startup and the
values are passed to the class as keyword arguments (``MessagesAdapter(merge_inline_system=
True)``); without ``Params`` the adapter takes no options and is built with none.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

from kvgate.middleware.framework.errors import HTTPError
from kvgate.middleware.framework.immutable import immutable
from kvgate.middleware.framework.types import ChatPrompt, Prompt, TextPrompt, TokenPrompt, Usage

#: The path segment of a by-id route (``GET /v1/responses/{id}``), matching one path segment.
ID_SEGMENT = "{id}"


@immutable
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

    #: Optional ``markers: tuple[bytes, ...]``: only SSE events whose raw bytes contain one of
    #: these are parsed and given to :meth:`on_event` (e.g. ``(b'"usage"',)``); without the
    #: attribute every event is parsed (slower on long streams). Events given to
    #: :meth:`on_event` and kept are re-serialised with orjson (edits are relayed).

    def on_json(self, payload: dict[str, Any]) -> None:
        """A whole (non-streaming) answer. Must not edit it: the engine's bytes are relayed."""
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
    #: ``(method, path)`` the adapter serves; a path with an ``{id}`` segment is a *by-id
    #: route* (see the module docstring): no body model, forwarded to the engine holding id.
    routes: ClassVar[tuple[tuple[str, str], ...]]
    #: Whether prefill/decode two-hop serving applies (False: always one hop).
    disaggregable: ClassVar[bool]

    def parse(self, data: dict[str, Any], headers: Mapping[str, str]) -> ParsedRequest:
        """Validate the parsed JSON body (:class:`kvgate.middleware.framework.errors.BadRequest`
        with ``param``); shallow: fields the gateway relies on, the engine judges the rest."""
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

    def set_cached_tokens(self, payload: dict[str, Any], cached: int | None) -> bool:
        """Prefill/decode: make the usage in ``payload`` (an answer or a usage-carrying event's
        data) report ``cached`` cached prompt tokens, keeping its own conventions consistent
        (Anthropic: ``input_tokens`` excludes cache reads); ``None``: unknown (drop the decode
        engine's own figure, which counts the transferred KV). True if it changed anything."""
        ...

    def error_body(self, err: HTTPError) -> bytes:
        """The JSON error body in this API's shape (status is ``err.status``)."""
        ...

    def stream_error(self, message: str) -> bytes:
        """The SSE bytes that end a stream the engine broke, in this API's shape."""
        ...


def is_by_id(path: str) -> bool:
    """Whether a route path is a by-id route (has an ``{id}`` segment)."""
    return ID_SEGMENT in path.split("/")


def match_route(pattern: str, path: str) -> str | None:
    """The id a by-id ``pattern`` matches in ``path`` (one non-empty segment), else None."""
    want, got = pattern.split("/"), path.split("/")
    if len(want) != len(got):
        return None
    found: str | None = None
    for w, g in zip(want, got, strict=True):
        if w == ID_SEGMENT and g:
            found = g
        elif w != g:
            return None
    return found


__all__ = [
    "ID_SEGMENT",
    "ApiAdapter",
    "ChatPrompt",
    "ParsedRequest",
    "Prompt",
    "SseEvent",
    "TextPrompt",
    "TokenPrompt",
    "UsageTap",
    "is_by_id",
    "match_route",
]
