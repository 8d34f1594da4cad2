"""KV-transfer connector extension point: how a request is split over a prefill and a decode
engine (two-hop dispatch, prefill/decode disaggregation).

A connector is pure request shaping: it turns the client's body into the prefill hop's body and
the decode hop's body, and reads the prefill side's cache hit from the prefill answer. The
gateway (:mod:`kvgate.middleware.serving.disagg`) does all the I/O. Connectors live in ``engines/``
and are
found through the ``kvgate.connectors`` entry-point group (``name`` -> class); the core and the
routing plugins name none of them. The config's ``disaggregation.connector`` picks one.

Two shapes exist:

* sequential (``concurrent = False``, e.g. vLLM NixlConnector): the prefill hop runs first and
  its JSON answer (its ``kv_transfer_params``) shapes the decode hop;
* concurrent (``concurrent = True``, e.g. vLLM MooncakeConnector, SGLang): both hops are sent at
  once with a shared rendezvous (transfer id or room, bootstrap address) and the decode engine
  pulls the KV when the prefill is done; ``decode_body`` then gets no prefill answer.

Before either hop, :meth:`Connector.prepare` may do the I/O a protocol needs to set the
rendezvous up (vLLM Mooncake: ask the prefill engine's bootstrap server for its engine id); it
is the connector's only I/O, and :meth:`Connector.hop_failed` tells it when a hop failed so it
can drop what it cached.

Usage accounting: the client's (and billing's) ``prompt_tokens_details.cached_tokens`` is the
prefill engine's *local* cache hit, never the KV the decode engine received (see
:func:`rewrite_usage`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

import aiohttp
from pydantic import BaseModel

from kvgate.middleware.framework.errors import TransferUnavailable
from kvgate.middleware.framework.types import Endpoint, InferenceRequest

__all__ = ["Connector", "DecodeCachedConvention", "HopContext", "PrefillHit",
           "TransferUnavailable", "reported_cached", "rewrite_usage"]

#: How a decode engine reports ``cached_tokens`` after receiving transferred KV: ``prefill-hit``
#: (vLLM >= 0.32 reports the prefill side's own hit, ``remote_prefill_cached_tokens``) or
#: ``transferred`` (older engines count the received KV as cached: about the whole prompt).
DecodeCachedConvention = Literal["prefill-hit", "transferred"]


@dataclass(frozen=True, slots=True)
class HopContext:
    """What both hops of one request share.

    ``request_id`` goes out as ``X-Request-Id`` on both hops; ``room`` is a random integer in
    [0, 2^63 - 1] drawn by the gateway's seeded RNG for each attempt (SGLang's
    ``bootstrap_room``; part of vLLM Mooncake's ``transfer_id``). ``prefill_engine_id`` is the
    prefill engine's own KV-transfer id when :meth:`Connector.prepare` learned one.
    """

    request_id: str
    prefill: Endpoint
    decode: Endpoint
    room: int
    prefill_engine_id: str | None = None


@runtime_checkable
class Connector(Protocol):
    """Shapes the two hops of a disaggregated request. Shaping is pure (no I/O, no clock);
    :meth:`prepare` is the one place for I/O.

    ``Params`` is the pydantic model of ``disaggregation.params``; the class is built as
    ``cls(params)``.
    """

    name: ClassVar[str]
    Params: ClassVar[type[BaseModel]]
    #: Both hops at once (True) or prefill first, then decode with its answer (False).
    concurrent: ClassVar[bool]
    #: How the decode engine counts transferred KV in its own ``cached_tokens``.
    decode_reports: DecodeCachedConvention

    def prefill_body(
        self, req: InferenceRequest, body: dict[str, Any], ctx: HopContext
    ) -> dict[str, Any]:
        """The prefill hop's body, from the client's body (a non-streaming JSON request)."""
        ...

    def decode_body(
        self, req: InferenceRequest, body: dict[str, Any], ctx: HopContext,
        prefill_answer: Mapping[str, Any] | None,
    ) -> dict[str, Any]:
        """The decode hop's body, from the body the engine adapter shaped. Sequential
        connectors get the prefill hop's JSON answer; raise :class:`TransferUnavailable` when
        it lacks what decode needs (the gateway then decodes locally)."""
        ...

    def prefill_hit(self, prefill_answer: Mapping[str, Any]) -> int | None:
        """Prompt tokens the prefill engine found in its own cache (``None``: not reported).
        The gateway asks only when the answer's usage, read through the request's API adapter,
        reports no cached count (kvgate.middleware.serving.disagg.prefill_hit)."""
        ...

    async def prepare(self, session: aiohttp.ClientSession, ctx: HopContext) -> HopContext:
        """Called before either hop is sent; returns the context both hops are shaped with
        (most connectors return ``ctx`` unchanged). Raise :class:`TransferUnavailable` when the
        transfer cannot be set up: the gateway then decodes locally (counted as a fallback)."""
        ...

    def hop_failed(self, ctx: HopContext) -> None:
        """A hop of the request shaped with ``ctx`` failed: drop whatever :meth:`prepare`
        cached for its prefill engine, so the next request asks again."""
        ...


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def reported_cached(payload: Mapping[str, Any]) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of an OpenAI answer or chunk."""
    usage = payload.get("usage")
    if not isinstance(usage, Mapping):
        return None
    details = usage.get("prompt_tokens_details")
    return _int(details.get("cached_tokens")) if isinstance(details, Mapping) else None


@dataclass(slots=True)
class PrefillHit:
    """The prefill side's cache hit, filled in when the prefill hop answers.

    ``known`` False: the prefill hop has not answered (yet). ``tokens`` None: it answered without
    reporting a hit.
    """

    known: bool = False
    tokens: int | None = None

    def set(self, tokens: int | None) -> None:
        self.known, self.tokens = True, tokens

    def for_client(self, decode_reported: int | None, convention: DecodeCachedConvention) -> (
        int | None
    ):
        """The ``cached_tokens`` to show: the prefill hit when known, else the decode engine's
        number if its convention already is the prefill hit, else unknown (``None``)."""
        if self.known and self.tokens is not None:
            return self.tokens
        return decode_reported if convention == "prefill-hit" else None


def _cache_writes(details: object) -> int:
    """Cache-written prompt tokens in ``prompt_tokens_details`` (vLLM ``created_cache_tokens``,
    OpenAI ``cache_write_tokens``), 0 when not reported."""
    if not isinstance(details, Mapping):
        return 0
    for key in ("created_cache_tokens", "cache_write_tokens"):
        n = _int(details.get(key))
        if n is not None and n >= 0:
            return n
    return 0


def rewrite_usage(payload: dict[str, Any], cached: int | None) -> bool:
    """Set ``usage.prompt_tokens_details.cached_tokens`` to ``cached`` in an answer or chunk
    (``prompt_tokens`` stays the decode engine's). Drops ``kv_transfer_params`` so the client
    sees a plain OpenAI object. Returns whether the payload changed."""
    changed = "kv_transfer_params" in payload
    payload.pop("kv_transfer_params", None)
    usage = payload.get("usage")
    if not isinstance(usage, dict):
        return changed
    prompt = _int(usage.get("prompt_tokens"))
    details = usage.get("prompt_tokens_details")
    if cached is not None and prompt is not None:  # reads and writes within the prompt
        cached = max(0, min(cached, prompt - _cache_writes(details)))
    if not isinstance(details, dict):
        if cached is None:
            return changed
        details = {}
        usage["prompt_tokens_details"] = details
    if details.get("cached_tokens") != cached or "cached_tokens" not in details:
        details["cached_tokens"] = cached
        return True
    return changed
