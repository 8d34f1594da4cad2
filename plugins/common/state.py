"""State keys shared between plugins (the names are what ``produces`` / ``consumes`` declare).

A plugin that can work without a key reads it with ``state.get`` and does not declare it in
``consumes``; one that cannot declares it, and the config loader checks a producer exists.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import field

from kvgate.middleware.framework.immutable import immutable
from kvgate.middleware.framework.types import EndpointId, StateKey

#: The request's prompt as the engine will tokenize it (chat template applied), or the client's
#: token-id prompt as given. Produced by the tokenization producer.
#: The prompt's token ids: a tuple, or an ``array("I")`` from a pseudo-tokenizer (read-only).
TOKEN_IDS: StateKey[Sequence[int]] = StateKey("token-ids")


@immutable
class PrefixMatch:
    """Per endpoint, how many leading prompt tokens the engine holds (by tier)."""

    prompt_tokens: int
    #: endpoint id -> matched tokens on the fast tier (GPU / device memory)
    device: Mapping[EndpointId, int]
    #: endpoint id -> matched tokens on slower tiers (CPU, disk, remote), beyond ``device``
    other: Mapping[EndpointId, int]
    #: True when the numbers come from the engines' KV events; False: the gateway's own record
    #: (mode ``auto``: True only when every candidate engine's numbers come from KV events)
    precise: bool
    #: The engines whose numbers come from KV events (the others': the gateway's own record).
    precise_engines: frozenset[EndpointId] = field(default_factory=frozenset)


#: Set by a tokenizer whose TOKEN_IDS are not the engine's own token ids (a pseudo-tokenizer),
#: to a short reason naming it. Such ids can key the gateway's own record but never match the
#: engines' KV events: the prefix-cache producer then reports those engines degraded and, in
#: mode ``auto``, routes them on its record. Absent: the ids are the engine's.
TOKEN_IDS_INEXACT: StateKey[str] = StateKey("token-ids-inexact")

#: Longest cached prefix per endpoint. Produced by the prefix-cache producer.
PREFIX_MATCH: StateKey[PrefixMatch] = StateKey("prefix-match")

#: The session key of the request (tenant, model, session header value), when it has one.
SESSION_KEY: StateKey[str] = StateKey("session-key")

#: The engine the session's last request went to, on any replica (the shared session table in
#: Redis, read by the session-affinity scorer with ``redis_url``). Absent: no shared pin known.
SESSION_PIN: StateKey[EndpointId] = StateKey("session-pin")

#: The ``cache_salt`` the gateway put in the engine body (derived from the tenant, or from its
#: opt-in sharing group; plugins/tenancy/cache_salt.py): the request's cache-isolation scope.
#: Produced by the ``cache-salt`` request hook, so it is known before any data producer hashes the
#: prompt; the prefix-cache producer keys its own record by it instead of by tenant. Absent:
#: no salt was injected (no authentication, or an API the engine takes no salt on).
CACHE_SALT: StateKey[str] = StateKey("cache-salt")

#: The prompt's chain of full-block hashes, as (block size [tokens], one hash per full block,
#: each depending on every token before it): a later turn of a conversation holds its earlier
#: prompt's hashes at the same positions. Produced by the prefix-cache producer (the hashes it
#: computes anyway); the placement scorer recognises conversations without session headers by
#: it (plugins/placement/conversations.py). Absent: no producer, or the prompt could not be hashed.
PROMPT_CHAIN: StateKey[tuple[int, Sequence[int]]] = StateKey("prompt-chain")
