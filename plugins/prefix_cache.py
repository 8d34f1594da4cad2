"""Prefix-cache routing: which engine already holds the longest prefix of the prompt.

Two plugins:

``prefix-cache-producer`` (DataProducer + DispatchHook) reads TOKEN_IDS and writes PREFIX_MATCH.

* ``precise`` mode: looks the prompt up in the ``kv-events`` plugin's index (what the engines
  reported through their KV events). The prompt is hashed per block size the engines use, with
  the extra keys vLLM would attach (the LoRA adapter's name when the model is one of
  ``lora_adapters``; the body's ``cache_salt`` on the first block), so it matches exactly the
  blocks the engine would reuse. When a request is dispatched, its full blocks are inserted
  *speculatively* for the target (and the prefill engine) with a short TTL, so that a burst of
  requests sharing a new prefix follows the first one instead of spreading before the engine's
  events arrive; a real ``BlockStored`` for the block supersedes the guess.
* ``approximate`` mode (no events): the gateway keeps its own record of which blocks it routed
  to which engine, in its own block size, with an LRU bound per engine (set it to the engine's
  KV capacity in blocks to mirror an LRU engine), a global bound and a TTL. Scoped by tenant
  (``scope_by_tenant``), since the record is the gateway's own guess.

``prefix-cache-scorer`` (Scorer) turns PREFIX_MATCH into a score in [0, 1]:
``(device_tokens + other_tier_weight * other_tokens) / prompt_tokens``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from middleware.errors import ConfigError
from middleware.plugin import (
    DataProducer,
    DispatchHook,
    EndpointSetListener,
    Plugin,
    PluginLookup,
    Scorer,
)
from middleware.types import (
    CycleState,
    Endpoint,
    EndpointId,
    InferenceRequest,
    RoutingDecision,
    StateKey,
)
from plugins.kv_events import KvEventsSubscriber
from plugins.kv_index import (
    HashingError,
    KvIndex,
    chain_hashes,
    engine_of,
    request_extra_keys,
)
from plugins.state import PREFIX_MATCH, TOKEN_IDS, PrefixMatch

#: The prompt's own block hashes per block size, computed by the producer for its dispatch hook.
_HASHES: StateKey[dict[int, list[int]]] = StateKey("prefix-cache-hashes")


class PrefixCacheProducer(Plugin, DataProducer, DispatchHook, EndpointSetListener):
    """Plugin ``prefix-cache-producer`` (see the module docstring and
    docs/plugins/prefix-cache.md).

    Speculative TTL (2 s): a speculative entry only has to bridge the time from dispatch until
    the engine's own ``BlockStored`` arrives, i.e. queueing + prefill of the prompt + event
    publishing (milliseconds). On a loaded H100 the p99 time to first token of a multi-thousand-
    token prompt stays around a second, so 2 s covers it while a wrong guess (the request failed,
    the blocks were evicted at once) steers traffic for at most 2 s.
    Record TTL (600 s) in approximate mode: a guess how long an engine keeps a prefix without
    its events; under steady load a block lives about KV capacity / prefill token rate, minutes
    on a busy GPU. The per-engine capacity bound is the better tool when the capacity is known.
    """

    type_name: ClassVar[str] = "prefix-cache-producer"
    produces: ClassVar[frozenset[str]] = frozenset({PREFIX_MATCH.name})
    consumes: ClassVar[frozenset[str]] = frozenset({TOKEN_IDS.name})

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)
        mode: Literal["precise", "approximate"] = "precise"
        #: precise: name of the ``kv-events`` plugin instance (declared before this one).
        events: str = "kv-events"
        #: precise: lifetime of speculative entries, seconds (0: no speculation).
        speculative_ttl_s: float = Field(2.0, ge=0)
        #: approximate: tokens per block of the gateway's own record. 64 keeps hashing a 10k-token
        #: prompt to ~160 blocks while losing at most 63 tokens of a match.
        block_size: int = Field(64, ge=1)
        #: approximate: (engine, block) pairs kept, all engines together (~200 bytes each).
        capacity_blocks: int = Field(262_144, ge=1)
        #: approximate: blocks kept per engine (its KV capacity in ``block_size`` blocks).
        engine_capacity_blocks: int | None = Field(None, ge=1)
        #: approximate: lifetime of a record after the last request that used it, seconds.
        record_ttl_s: float = Field(600.0, gt=0)
        #: approximate: a tenant's requests only match that tenant's records.
        scope_by_tenant: bool = True
        #: Models served as LoRA adapters (their blocks carry the adapter name as extra key).
        lora_adapters: frozenset[str] = frozenset()
        #: KV-cache group matched (0: the full-attention group of ordinary models).
        group_idx: int = Field(0, ge=0)

    example_params: ClassVar[Mapping[str, object]] = {"mode": "approximate", "block_size": 64}

    def __init__(
        self, name: str, params: BaseModel, plugins: PluginLookup,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(name, params, plugins)
        assert isinstance(params, PrefixCacheProducer.Params)
        self.p = params
        self.clock = clock
        self.index: KvIndex
        if params.mode == "precise":
            source = plugins.lookup(params.events)
            if not isinstance(source, KvEventsSubscriber):
                raise ConfigError(f"{params.events!r} is not a kv-events plugin")
            self.index = source.index
        else:
            self.index = KvIndex(
                params.capacity_blocks, params.engine_capacity_blocks, params.block_size
            )

    @property
    def precise(self) -> bool:
        return self.p.mode == "precise"

    def on_endpoints_changed(
        self, added: Sequence[Endpoint], removed: Sequence[Endpoint]
    ) -> None:
        """Approximate mode: forget the records of engines that left (precise: kv-events does)."""
        if not self.precise:
            for ep in removed:
                self.index.reset_engine(ep.id)

    def prompt_hashes(
        self, req: InferenceRequest, tokens: Sequence[int], sizes: frozenset[int]
    ) -> dict[int, list[int]]:
        """The prompt's own hashes for each block size in ``sizes`` (see module docstring)."""
        lora = req.model if req.model in self.p.lora_adapters else None
        salt = req.body.get("cache_salt")
        salt = salt if isinstance(salt, str) and salt else None
        if not self.precise and self.p.scope_by_tenant and req.tenant is not None:
            salt = f"{salt or ''}\x00tenant:{req.tenant}"
        out: dict[int, list[int]] = {}
        for size in sizes:
            extra = request_extra_keys(len(tokens) // size, lora, salt)
            out[size] = chain_hashes(tokens, size, group_idx=self.p.group_idx, extra_keys=extra)
        return out

    def _sizes(self) -> frozenset[int]:
        if self.precise:
            return self.index.block_sizes(self.p.group_idx)
        return frozenset({self.p.block_size})

    async def prepare(
        self, req: InferenceRequest, state: CycleState, eps: Sequence[Endpoint]
    ) -> None:
        tokens = state.get(TOKEN_IDS)
        if tokens is None:
            return
        try:
            hashes = self.prompt_hashes(req, tokens, self._sizes())
        except HashingError:
            return
        state.put(_HASHES, hashes)
        wanted = {ep.id for ep in eps}
        holders = [h for h in self.index.holders() if engine_of(h) in wanted]
        found = self.index.match(hashes, self.clock(), self.p.group_idx, holders)
        device: dict[EndpointId, int] = {}
        other: dict[EndpointId, int] = {}
        for holder, (dev, oth) in found.items():
            ep = engine_of(holder)
            if (dev, oth) > (device.get(ep, 0), other.get(ep, 0)):
                device[ep], other[ep] = dev, oth
        state.put(PREFIX_MATCH, PrefixMatch(len(tokens), device, other, self.precise))

    async def before_dispatch(
        self, req: InferenceRequest, state: CycleState, decision: RoutingDecision
    ) -> None:
        hashes = state.get(_HASHES)
        tokens = state.get(TOKEN_IDS)
        ttl = self.p.speculative_ttl_s if self.precise else self.p.record_ttl_s
        if hashes is None or tokens is None:
            return
        expires = self.clock() + ttl
        targets = [decision.target] if decision.prefill is None else [
            decision.prefill, decision.target
        ]
        for ep in targets:
            size = self.index.block_size(ep.id, self.p.group_idx) if self.precise else (
                self.p.block_size
            )
            if size not in hashes:  # an engine that has not reported its block size yet
                hashes.update(self.prompt_hashes(req, tokens, frozenset({size})))
            if ttl > 0:
                self.index.record(ep.id, hashes[size], expires, block_size=size,
                                  group_idx=self.p.group_idx)
            if self.precise:  # lets the index re-key events whose parent it lost
                self.index.remember(ep.id, tokens, hashes[size], block_size=size,
                                    group_idx=self.p.group_idx)


class PrefixCacheScorer(Plugin, Scorer):
    """Plugin ``prefix-cache-scorer``: the share of the prompt an engine already holds.

    ``score = (device_tokens + other_tier_weight * other_tokens) / prompt_tokens`` in [0, 1];
    engines without a match (or requests without PREFIX_MATCH) score 0.

    Why ``other_tier_weight`` defaults to 0.5: a block on a slower tier (CPU memory, disk, a
    remote store) still saves its prefill compute but must be copied to the GPU first. From CPU
    memory over PCIe that copy costs ~10 % of recomputing it; from disk or over the network
    30-70 %. One weight covers all non-device tiers, so the middle of that range is taken; a
    device hit is always worth more than the same hit on another tier.
    """

    type_name: ClassVar[str] = "prefix-cache-scorer"
    consumes: ClassVar[frozenset[str]] = frozenset({PREFIX_MATCH.name})

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)
        #: Value of a token matched on a non-device tier relative to one on the device (0..1).
        other_tier_weight: float = Field(0.5, ge=0, le=1)

    example_params: ClassVar[Mapping[str, object]] = {"other_tier_weight": 0.5}

    def __init__(self, name: str, params: BaseModel, plugins: PluginLookup) -> None:
        super().__init__(name, params, plugins)
        assert isinstance(params, PrefixCacheScorer.Params)
        self.other_tier_weight = params.other_tier_weight

    def score(
        self, req: InferenceRequest, state: CycleState, eps: Sequence[Endpoint]
    ) -> Mapping[EndpointId, float]:
        match = state.get(PREFIX_MATCH)
        if match is None or match.prompt_tokens <= 0:
            return {}
        total = float(match.prompt_tokens)
        weight = self.other_tier_weight
        return {
            ep.id: min(
                1.0,
                (match.device.get(ep.id, 0) + weight * match.other.get(ep.id, 0)) / total,
            )
            for ep in eps
        }
