"""The parameters of ``prefix-cache-producer``, with their units and why their values."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr


class ProducerParams(BaseModel):
    """``prefix-cache-producer``'s parameters (docs/plugins/prefix-cache.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    mode: Literal["precise", "approximate", "auto"] = "precise"
    #: precise / auto: name of the ``kv-events`` plugin instance (declared before this one;
    #: optional in auto mode).
    events: str = "kv-events"
    #: precise / auto: lifetime of speculative entries, seconds (0: no speculation).
    speculative_ttl_s: float = Field(2.0, ge=0)
    #: precise / auto: lifetime of what an engine's reported ``cached_tokens`` taught the
    #: index (prefixes it held that no event announced: cached before the gateway started
    #: or before its subscription caught up), seconds; refreshed by every later report,
    #: dropped by a lower one. 300: longer than a coding agent's think time between turns,
    #: short enough that a prefix the engine evicted silently is not chased for long.
    learned_ttl_s: float = Field(300.0, ge=0)
    #: approximate / auto: tokens per block of the gateway's own record. 64 keeps hashing a
    #: 10k-token prompt to ~160 blocks while losing at most 63 tokens of a match.
    block_size: int = Field(64, ge=1)
    #: approximate / auto: (engine, block) pairs kept, all engines together (~200 B each).
    capacity_blocks: int = Field(262_144, ge=1)
    #: approximate / auto: blocks kept per engine when its metrics do not report its KV
    #: capacity (``kv_capacity_tokens``); null: only the global bound.
    engine_capacity_blocks: int | None = Field(None, ge=1)
    #: approximate / auto: lifetime of a record after the last request that used it, s.
    record_ttl_s: float = Field(600.0, gt=0)
    #: Bytes of recent prompts' token ids and hashes kept so that a prompt extending one of
    #: them is hashed only past it (plugins/prefix/record_chains.py), per chain (the
    #: record's, the KV-event index's); 32 MiB: ~160 agent prompts of 200 KiB; 0: off.
    chain_memo_bytes: int = Field(32 * 1024 * 1024, ge=0)
    #: approximate / auto: a tenant's requests only match that tenant's records.
    scope_by_tenant: bool = True
    #: Models served as LoRA adapters (their blocks carry the adapter name as extra key).
    lora_adapters: frozenset[str] = frozenset()
    #: KV-cache group matched (0: the full-attention group of ordinary models).
    group_idx: int = Field(0, ge=0)
    #: auto: seconds an engine stays ``degraded`` before it is reported ``approximate``.
    fallback_after_s: float = Field(10.0, ge=0)
    #: approximate / auto: share the record's insertions with the other replicas through
    #: this Redis (default: ``shared_state.redis_url``; plugins/prefix/shared_record.py).
    redis_url: SecretStr | None = None
