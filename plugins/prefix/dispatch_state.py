"""What the prefix-cache producer keeps per request between its hooks (the prompt's hashes, the
prediction it checks against the engine's usage) and the record's expiry rounding."""

from __future__ import annotations

import math

from kvgate.middleware.framework.immutable import immutable
from kvgate.middleware.framework.types import EndpointId, StateKey

Hashes = dict[int, list[int]]
Found = dict[EndpointId, tuple[int, int]]

#: The prompt's own block hashes per block size: for the KV-event index (no tenant scope) and
#: for the gateway's record (tenant-scoped), computed by the producer for its dispatch hook.
EVENT_HASHES: StateKey[Hashes] = StateKey("prefix-cache-event-hashes")
RECORD_HASHES: StateKey[Hashes] = StateKey("prefix-cache-record-hashes")
#: What the KV-event index predicted per engine (device, other), before this dispatch.
PREDICTED: StateKey[Found] = StateKey("prefix-cache-predicted")
#: Of each engine's prediction, the tokens confirmed by events and not learnt from usage.
RUNS: StateKey[Found] = StateKey("prefix-cache-runs")
#: Leading prompt tokens in the fleet's shared tier (plugins/prefix/shared_tier.py), when any.
SHARED_TIER: StateKey[int] = StateKey("prefix-cache-shared-tier")


@immutable
class Check:
    """A dispatch to one engine whose usage will be compared with the prediction."""

    target: EndpointId
    predicted: int
    block_size: int
    prompt_tokens: int
    dispatched_at: float
    inexact: bool
    #: Of ``predicted``, the tokens known from the engine's own events (the rest: speculative).
    confirmed: int = 0
    #: Of ``predicted``, the tokens the index knew without learning them from usage: what the
    #: health check judges (learnt entries route well but must not hide missing events).
    unlearned: int | None = None
    #: The KV-event index's removal sequence at dispatch (evictions after it: in flight).
    removals: int = 0


CHECK: StateKey[Check] = StateKey("prefix-cache-check")
#: Record expiries are rounded up to a whole multiple of this many seconds, so the requests of
#: one second that repeat or share a chain find its tail already held until that expiry and
#: only refresh its LRU order (KvIndex's prefix-closed fast path) instead of rewriting every
#: block's expiry. A record lives at most this much longer than ``record_ttl_s`` (600 s).
RECORD_EXPIRY_STEP_S = 1.0


def record_expiry(now: float, ttl_s: float) -> float:
    """``now + ttl_s`` rounded up to a multiple of :data:`RECORD_EXPIRY_STEP_S`."""
    return math.ceil((now + ttl_s) / RECORD_EXPIRY_STEP_S) * RECORD_EXPIRY_STEP_S
