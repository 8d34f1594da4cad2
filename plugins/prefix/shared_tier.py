"""Shared-tier awareness for routing: what a prefix in a fleet-wide KV store (Mooncake Store,
an LMCache remote backend) is worth to each engine, and how it enters the prefix match.

A block in the shared tier is reachable from *every* engine, at the cost of moving it over the
tier's link; a block in an engine's GPU cache costs nothing; a block nowhere costs its prefill.
So a shared-tier token is worth, as a fraction of a GPU hit::

    credit = 1 - load_s_per_token / prefill_s_per_token
    load_s_per_token = kv_bytes_per_token / link_bytes_per_s

clipped to [0, 1]. With the calibrated 8B model (131,072 KV bytes per token), one 200 Gb/s
RDMA NIC (25 GB/s) and the measured H100 prefill of an 8,192-token prompt (263 ms, 32.1 µs per
token; shared/design/H100_TIMING.md): load 5.24 µs per token, credit 0.84. Dynamo credits host
memory 0.75 and disk 0.25 by convention; this derives the number from the fleet's own link and
prefill speed, and falls with a slower link (PCIe from local NVMe at ~6 GB/s: 0.32).

:func:`fold_shared` puts the tier into a :class:`~kvgate.plugins.common.state.PrefixMatch`: every
engine gets the tier's prefix beyond what its own GPU cache holds as a slower-tier (``other``)
match, so the placement scorer (``other_tier_weight`` set to the credit) sees a prefix in the store
as reachable everywhere - an engine's local copy is then worth only its margin over the store,
which lets load and cache pressure decide where a shared prefix is computed next. Without a
tier (``shared_tokens == 0``) the match is returned unchanged: routing without a tier does not
change. Pure functions, no state. Docs: docs/shared-tier.md.

Where the gateway learns the tier: KV events with ``locality: "REMOTE"`` (vLLM 0.32's marker
for a tier that is not the publisher's own) are filed by the ``kv-events`` subscriber under the
index holder :data:`SHARED_HOLDER` instead of the publishing engine (:func:`holder_for`), and
the ``prefix-cache-producer`` folds that holder's match into every engine's.
"""

from __future__ import annotations

from collections.abc import Iterable

from pydantic import BaseModel, ConfigDict, Field

from kvgate.middleware.framework.types import EndpointId
from kvgate.plugins.common.state import PrefixMatch

#: The KV index holder of the fleet's shared tier (not an engine id: ``@`` is not in engine
#: names, so no engine's holder or topic can collide with it).
SHARED_HOLDER = "@shared-tier"
#: The ``locality`` value of a KV event about a store shared by the fleet.
REMOTE = "REMOTE"


def holder_for(holder: str, locality: str | None, medium: str | None = None,
               shared_media: frozenset[str] = frozenset()) -> str:
    """The index holder of an event the publisher ``holder`` sent: the shared tier's for a
    ``REMOTE`` block or one on a medium of ``shared_media``, else the publisher's own."""
    if locality == REMOTE or (medium is not None and medium in shared_media):
        return SHARED_HOLDER
    return holder


class TierLink(BaseModel):
    """The shared tier's link and the prefill speed it competes with."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: KV bytes per token of the served model: 2 (K, V) * layers * KV heads * head dim * bytes
    #: per element; 131,072 for the calibrated Llama-3.1-8B shape (32 * 8 * 128, bf16).
    kv_bytes_per_token: int = Field(default=131_072, ge=1)
    #: Tier-to-GPU bandwidth, bytes/s; 25 GB/s: one 200 Gb/s RDMA NIC at line rate.
    link_bytes_per_s: float = Field(default=25e9, gt=0)
    #: Prefill time per uncached token, seconds; 32.1 µs: the measured 8,192-token H100 prefill
    #: (263 ms), the traces' typical uncached size.
    prefill_s_per_token: float = Field(default=263e-3 / 8192, gt=0)

    @property
    def credit(self) -> float:
        """What one token in the tier is worth relative to one in GPU memory, in [0, 1]."""
        load = self.kv_bytes_per_token / self.link_bytes_per_s
        return min(1.0, max(0.0, 1.0 - load / self.prefill_s_per_token))


def fold_shared(match: PrefixMatch, shared_tokens: int,
                engines: Iterable[EndpointId]) -> PrefixMatch:
    """``match`` with the shared tier's ``shared_tokens`` (leading prompt tokens held in the
    tier) added to the ``other`` of every one of ``engines`` beyond its ``device`` tokens."""
    if shared_tokens <= 0:
        return match
    other = dict(match.other)
    for e in engines:
        other[e] = max(other.get(e, 0), shared_tokens - match.device.get(e, 0))
    return PrefixMatch(match.prompt_tokens, dict(match.device), other, match.precise,
                       match.precise_engines)
