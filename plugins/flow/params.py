"""``flow-control``'s parameters: every one with its unit and why its default has its value
(docs/flow-control.md has the longer story and the measurements)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

#: Live priority bands, highest first; ``background`` (deferred work run through the loopback:
#: queued requests, background responses, batch lines) sits below all of them and is never
#: chosen by a client.
LIVE_BANDS: tuple[str, ...] = ("interactive", "standard", "batch")
BACKGROUND = "background"
BANDS: tuple[str, ...] = (*LIVE_BANDS, BACKGROUND)
#: Bands that never take an engine's reserved slots (sheddable and deferred work): the reserve
#: is for a light tenant's and an interactive turn's next request.
UNRESERVED_BANDS: frozenset[str] = frozenset(("batch", BACKGROUND))
LiveBand = Literal["interactive", "standard", "batch"]


class BandParams(BaseModel):
    """One band's queue bound. ``ttl_s`` [s]: longest wait in the gateway, then 429 (the
    tenant is over its fair share: its own excess) or 503 ``overloaded`` (the fleet is);
    ``max_queued`` [requests]: past it a new request is refused at once with 429."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    #: 60 s and 5,000 requests: llm-d's flow-control defaults; 60 s is past a typical burst
    #: and within the client timeouts of the OpenAI and Anthropic SDKs (600 s), and a queued
    #: request holds its parsed body (KBs): 5,000 of them are tens of MB at most.
    ttl_s: float = Field(60.0, gt=0, le=3600)
    max_queued: int = Field(5000, ge=1, le=1_000_000)


def _default_bands() -> dict[str, BandParams]:
    return {band: BandParams() for band in BANDS}


class FlowParams(BaseModel):
    """See the module docstring of plugins/flow/plugin.py for the algorithm."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    # -- saturation (per engine) ---------------------------------------------------------
    #: [requests] The most requests this gateway keeps in flight on one engine before it
    #: learns the engine's real batch size: vLLM's long-standing ``max_num_seqs`` (256).
    #: Lowered per engine as soon as the engine reports a waiting queue (see ``learn``).
    max_in_flight_per_engine: int = Field(256, ge=1, le=100_000)
    #: [requests] The limit an engine starts with (slow start): doubled on every scrape that
    #: shows the engine full without a queue, until its first queue; then +1 per probe. 32:
    #: twice a small engine's batch (16 sequences), so a flood at startup overfills it by 16
    #: at most instead of by ``max_in_flight_per_engine``, and a 256-sequence engine is
    #: reached in 3 scrapes.
    initial_in_flight_per_engine: int = Field(32, ge=1, le=100_000)
    #: [requests] Floor of a learned limit: an engine always gets this many.
    min_in_flight_per_engine: int = Field(1, ge=1, le=100_000)
    #: [requests] Requests an engine may queue itself (``vllm:num_requests_waiting``) before
    #: it counts as full: 0, a request queued in an engine waits for a slot whoever is behind
    #: it; queued in the gateway it can still be reordered and sent where its prefix is.
    max_engine_waiting: int = Field(0, ge=0, le=100_000)
    #: [fraction 0..1] KV-cache usage (``vllm:kv_cache_usage_perc``) at which an engine takes
    #: no new request until the next scrape: past ~0.95 vLLM preempts running sequences.
    max_kv_usage: float = Field(0.95, gt=0, le=1)
    #: [tokens] Prompt tokens in flight per engine (the gateway's estimate); None: the engine's
    #: KV capacity (``vllm:cache_config_info``) x ``max_kv_usage`` when it reports one, else no
    #: token bound. More prompt tokens in flight than the cache holds means preemption.
    max_in_flight_tokens_per_engine: int | None = Field(None, ge=1)
    #: Learn each engine's limit from its scraped running / waiting counts (AIMD): on a scrape
    #: showing more than ``max_engine_waiting`` queued, limit = in flight here x
    #: (running + allowed waiting) / (running + waiting) (this replica's share of what the
    #: engine runs: N replicas converge on the engine's batch size together); on a scrape
    #: showing this gateway at its limit and no queue: x2 before the first cut (slow start),
    #: +1 while the engine runs fewer than it did when it last queued, else +1 at most every
    #: ``probe_interval_s``.
    learn: bool = True
    #: [s] Probe past the engine's observed batch size (+1) at most this often: the probe
    #: queues one request in the engine for a scrape period, so rarely: 300 s (below the
    #: observed size the limit rises on every scrape that shows a free seat).
    probe_interval_s: float = Field(300.0, gt=0)
    #: [s] Scraped metrics older than this are ignored (gateway counters only), with a WARNING,
    #: ``/health`` and ``kvgate_flow_stale_engines``: 5 scrape periods at the 2 s default.
    metrics_stale_s: float = Field(10.0, gt=0)
    # -- queue ---------------------------------------------------------------------------
    bands: dict[str, BandParams] = Field(default_factory=_default_bands)
    #: The band of a request that names none and whose key sets none.
    default_band: LiveBand = "standard"
    #: The highest band a request may ask for when its key sets no ``max_priority`` (and when
    #: no api-keys plugin runs).
    max_band: LiveBand = "interactive"
    #: Request header naming the band (``interactive``, ``standard``, ``batch``); capped by the
    #: key's ``max_priority``; echoed on the answer with the band used.
    header: str = Field("x-kvgate-priority", min_length=1, max_length=64)
    #: [fraction 0..1] Of each engine's limit (rounded down), the last slots go only to tenants
    #: under their fair share: a flooding tenant cannot take the slots a light tenant's next
    #: turn needs on the engine that holds its session (no preemption: a slot frees only when a
    #: request ends). 1/8: 2 of 16 slots per engine, enough for a few interactive streams.
    #: The same fraction of its token bound and of ``max_kv_usage`` (an engine full by tokens
    #: before it is full by requests).
    reserve_fraction: float = Field(0.125, ge=0, lt=1)
    #: [s] A tenant over its fair share enters each engine at most once per this interval
    #: (0: no pacing). Its requests otherwise enter in waves: equal requests admitted
    #: together end together, and their slots refill at once with ~a batch of prompts to
    #: prefill, which a light tenant's turn arriving then shares its prefill steps with.
    #: Pacing spreads the refills (and so, over time, the ends): on the simulated H100
    #: fleet B's TTFT p99 under A's flood went from 2.1x B alone to 1.0x (docs/flow-control.md).
    #: 0.02 s: at most 50 such admissions per second per engine, more than an engine's request
    #: rate for all but very short requests, so a tenant over its share loses little
    #: throughput (A's answers -3 % in that run); 0.05 s did as well for B and cost A -5 %.
    #: Only a tenant over its share is paced: alone, a tenant is never over it.
    over_share_pace_s: float = Field(0.02, ge=0, le=10)
    # -- fairness ------------------------------------------------------------------------
    #: [weight] Per tenant (default 1): a tenant's share of a saturated fleet is its weight
    #: over the active tenants' sum.
    tenant_weights: dict[str, float] = Field(default_factory=dict)
    #: [ratio] An output token's cost in the virtual token counter against a prompt token's:
    #: 2, the ratio VTC (Sheng et al., OSDI '24) and most price books use.
    output_weight: float = Field(2.0, ge=0, le=100)
    #: [s] A tenant counts as active (its share reserved) this long after its last request:
    #: an agent's think time between turns is seconds; 10 s covers it.
    active_window_s: float = Field(10.0, gt=0)
    #: [tokens/s] Aging of least-attained-service order within a tenant: a queued request's
    #: rank is its session's served tokens minus its wait x this rate, so a long session's
    #: next turn waits at most (served tokens / rate) behind newcomers: 16,384 -> 2 s for a
    #: 32k-token session, 6 s for a 100k-token one. Also the bound on how far apart replicas
    #: each ordering its own queue let sessions' service drift (docs/flow-control.md,
    #: "Agent sessions through replicas": 4,096 left long sessions 1.4-2.3x one gateway's p99).
    aging_tokens_per_s: float = Field(16384.0, gt=0)
    #: Order within a tenant: ``las`` (least attained service by session, aged) or ``fifo``
    #: (arrival order; for comparison: bench/flow_control.py).
    session_order: Literal["las", "fifo"] = "las"
    #: Request headers naming the session (agent) of a request, first present wins: the ones
    #: session affinity reads. None of them: the request is its own session.
    session_headers: tuple[str, ...] = ("x-session-affinity", "x-session-id")
    # -- bounds --------------------------------------------------------------------------
    #: [entries] Tenants whose fairness counters are kept (least recently active evicted:
    #: one that comes back starts at the active tenants' minimum, as VTC's lift does anyway).
    max_tenants: int = Field(10_000, ge=1)
    #: [entries] Sessions whose served tokens are kept (least recently active evicted: an
    #: evicted session restarts at 0, i.e. as a newcomer).
    max_sessions: int = Field(100_000, ge=1)
    #: [labels] Tenants with their own ``tenant`` label on the shed counter (first come); the
    #: rest count under ``other``, so the series stay bounded.
    max_tenant_labels: int = Field(20, ge=0, le=1000)
    #: [s] The waiters' re-check period: TTL expiry and fresh scrapes (a request's end wakes
    #: them at once).
    poll_s: float = Field(0.05, gt=0, le=5)
    #: [s] Sent as ``Retry-After`` (whole seconds, at least 1).
    retry_after_s: float = Field(1.0, gt=0)

    # -- replicas (plugins/flow/shared.py) -------------------------------------------------
    #: Share the tenants' served tokens with the other replicas on this Redis (default: the
    #: config's ``shared_state``, i.e. ``kvgate serve --redis``; may hold a password, never
    #: logged).
    redis_url: SecretStr | None = None
    redis_prefix: str = Field("kvgate:flow:", min_length=1, max_length=64)
    #: With ``redis_url``: tell the other replicas each session's served tokens, so a session
    #: whose turns spread over replicas ranks by its whole service (least attained service).
    share_sessions: bool = True
    #: With ``redis_url`` (and ``learn``): learn each engine's limit for the fleet of replicas
    #: and keep this replica's share of it in proportion to its demand (requests waiting and
    #: in flight), told through the tenants' exchange (plugins/flow/peers.py). Off: each
    #: replica learns its own share from the engine's queue and keeps it whatever the queues.
    share_limits: bool = True
    #: [s] Publish/read period: 0.2 s, as the token-load exchange (a fairness decision lags
    #: the other replicas by less than one typical request).
    share_interval_s: float = Field(0.2, gt=0, le=60)
    #: [s] A replica's figures expire after this: five missed rounds.
    share_ttl_s: float = Field(1.0, gt=0, le=600)
    #: [s] Bound on one exchange round (two round trips plus event-loop lag).
    redis_timeout_s: float = Field(0.5, gt=0, le=30)

    @field_validator("bands")
    @classmethod
    def _bands(cls, value: dict[str, BandParams]) -> dict[str, BandParams]:
        unknown = sorted(set(value) - set(BANDS))
        if unknown:
            raise ValueError(f"unknown band(s) {unknown}; the bands are {list(BANDS)}")
        return {band: value.get(band, BandParams()) for band in BANDS}

    @field_validator("tenant_weights")
    @classmethod
    def _weights(cls, value: dict[str, float]) -> dict[str, float]:
        bad = sorted(t for t, w in value.items() if not w > 0)
        if bad:
            raise ValueError(f"tenant weights must be > 0 (not: {bad})")
        return value

    @model_validator(mode="after")
    def _limits(self) -> FlowParams:
        if not (self.min_in_flight_per_engine <= self.initial_in_flight_per_engine
                <= self.max_in_flight_per_engine) and self.learn:
            raise ValueError("need min_in_flight_per_engine <= initial_in_flight_per_engine "
                             "<= max_in_flight_per_engine")
        if self.min_in_flight_per_engine > self.max_in_flight_per_engine:
            raise ValueError("min_in_flight_per_engine exceeds max_in_flight_per_engine")
        if BANDS.index(self.default_band) < BANDS.index(self.max_band):
            raise ValueError("default_band is above max_band")
        return self


def band_rank(band: str) -> int:
    """0 for the highest band."""
    return BANDS.index(band)


__all__ = ["BACKGROUND", "BANDS", "LIVE_BANDS", "BandParams", "FlowParams", "band_rank"]
