"""Token-aware load: score engines by the prefill and decode work the gateway has in flight there.

Two plugin types share one bookkeeping object, :class:`LoadTracker`:

``token-load-scorer`` (Scorer, DispatchHook, CompletionHook, EndpointSetListener)
    At dispatch it charges the request to the engines it goes to:

    * prefill [tokens] — the *uncached* part of the prompt on the engine that prefills it: the
      prompt's tokens (``len(TOKEN_IDS)`` when the tokenizer produced it, else
      ``PREFIX_MATCH.prompt_tokens``, else the gateway's estimate) minus the tokens that engine
      already holds (``PREFIX_MATCH``: device plus slower tiers; 0 when there is no match data);
    * decode [tokens] — the expected output: ``max_completion_tokens`` or ``max_tokens`` capped
      at ``max_output_tokens``, else ``default_output_tokens``, times ``n``.

    With prefill/decode disaggregation the prefill charge goes to ``decision.prefill`` and the
    decode charge to the target; otherwise both go to the target. The prefill engine's charge
    is released as soon as the prefill hop ends (PrefillHook), not when the whole request does:
    its work is done by then. Every outcome releases the rest (CompletionHook); releasing is
    idempotent.

    Score of an engine, given this request::

        work(e)      = prefill(e) + decode_token_weight * decode(e)      # prefill-token equivalents
        projected(e) = work(e) + uncached tokens of *this* request on e
        score(e)     = 1 - projected(e) / max(saturation_tokens, max over candidates of projected)

    Counting this request's own uncached tokens folds the prefix-cache saving into the load
    signal: a busy engine holding the prefix can still beat an idle one that must prefill it all.
    ``saturation_tokens`` is the floor of the scale, so that small absolute differences on a
    quiet fleet (0 vs 300 tokens) do not swing the score from 1 to 0.

``token-imbalance-filter`` (Filter)
    The hard guard against hot spots: drops candidates whose load exceeds
    ``max_imbalance * mean + slack_tokens`` (mean over the candidates it is given). It is a
    filter, not a scorer term, because scores are a weighted sum: a strong prefix match would
    outweigh any bounded load term, so a hot shared prefix could still pull every request onto
    one engine. The engine with the least load always passes (it is at most the mean), so the
    filter never empties the candidate set.

Bounded state: one :class:`EngineLoad` per engine (removed with the engine) and one entry per
in-flight dispatch, at most ``max_entries`` (the oldest is released and counted as evicted when
full). Entries older than ``max_age_s`` are swept (released and counted) on each dispatch and
completion: a completion hook that never ran (a later dispatch hook raised) cannot leak load.
Entries are keyed by a per-dispatch ticket kept in the request's state (the request id is
recorded with it), so two concurrent requests that reuse a client ``x-request-id`` never release
each other's load, and a retried request is charged once per dispatch.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from importlib.util import find_spec
from typing import Any, ClassVar, Literal

from prometheus_client.registry import Collector
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from kvgate.middleware.framework.errors import ConfigError
from kvgate.middleware.framework.plugin import (
    CompletionHook,
    DispatchHook,
    EndpointSetListener,
    Filter,
    HealthSource,
    Lifecycle,
    MetricsSource,
    Plugin,
    PluginLookup,
    PrefillHook,
    Scorer,
)
from kvgate.middleware.framework.types import (
    CycleState,
    Endpoint,
    EndpointId,
    InferenceRequest,
    Outcome,
    RoutingDecision,
    StateKey,
)
from kvgate.plugins.common.state import PREFIX_MATCH, TOKEN_IDS, PrefixMatch
from kvgate.plugins.load.loads import Charge, EngineLoad, LoadTracker
from kvgate.plugins.load.shared_load import CounterShare, LoadCollector, LoadExchange, connect
from kvgate.pricing.usage_conventions import count


def prompt_tokens(req: InferenceRequest, state: CycleState) -> int:
    """The prompt's size in tokens: tokenizer output, else prefix-match's count, else estimate."""
    ids = state.get(TOKEN_IDS)
    if ids is not None:
        return len(ids)
    match = state.get(PREFIX_MATCH)
    if match is not None:
        return match.prompt_tokens
    return req.prompt_token_estimate


def uncached_tokens(prompt: int, match: PrefixMatch | None, endpoint: EndpointId) -> int:
    """Prompt tokens the engine must compute: those it does not hold on any tier."""
    if match is None:
        return prompt
    held = match.device.get(endpoint, 0) + match.other.get(endpoint, 0)
    return max(0, prompt - held)


def expected_output_tokens(body: Mapping[str, Any], default: int, cap: int) -> int:
    """Output tokens to expect: the client's limit capped at ``cap``, else ``default``; * n.
    (Read twice per request, by this scorer and the placement scorer: a body that sets none
    of the fields costs three dict lookups.)"""
    limit = count(body.get("max_completion_tokens"))
    if limit is None:
        limit = count(body.get("max_tokens"))
    per_choice = default if limit is None else min(limit, cap)
    n = body.get("n")
    return per_choice if n is None else per_choice * max(1, count(n) or 1)


def load_scores(
    projected: Mapping[EndpointId, float], saturation: float
) -> dict[EndpointId, float]:
    """1 - projected / max(saturation, largest projected)."""
    scale = max(saturation, max(projected.values(), default=0.0))
    return {ep: 1.0 - value / scale for ep, value in projected.items()}


def within_bound(loads: Mapping[EndpointId, float], factor: float, slack: float) -> set[EndpointId]:
    """Endpoints whose load is at most ``factor * mean + slack``."""
    if not loads:
        return set()
    bound = factor * (sum(loads.values()) / len(loads)) + slack
    return {ep for ep, load in loads.items() if load <= bound}


# -- plugins -----------------------------------------------------------------------------------


class TokenLoadScorer(
    Plugin, Scorer, DispatchHook, CompletionHook, PrefillHook, EndpointSetListener, Lifecycle,
    HealthSource, MetricsSource,
):
    """Scores engines by in-flight prefill + decode tokens (see the module docstring).

    Params (units in brackets):

    * ``decode_token_weight`` [prefill tokens per decode token] — 4: on the H100 calibration of
      the simulator (docs/simulator.md) one prefill token costs ~23 µs of compute, and one decode
      token at ~2k context ~23 µs of GEMM plus ~90 µs of KV reads (2k * 0.044 µs): ≈ 4.8.
      Rounded down because part of a decode step (the weight read) is shared by the batch.
    * ``default_output_tokens`` [tokens] — expected output when the client sets no limit (256:
      a typical chat answer).
    * ``max_output_tokens`` [tokens] — cap on a client's ``max_tokens`` as an expectation (4096:
      clients often send the model's maximum while answers stay far shorter).
    * ``saturation_tokens`` [prefill-token equivalents] — load scoring 0 on a quiet fleet
      (32768 ≈ 0.75 s of H100 prefill for an 8B model: a queue worth avoiding).
    * ``max_age_s`` [s] — charges older than this are swept (900: above the default 600 s
      request timeout, so only leaked charges are swept).
    * ``max_entries`` [dispatches] — cap on tracked in-flight dispatches (65536 ≈ 6 MB).
    * ``redis_url`` — share the load with the other replicas on this Redis (default: the
      config's ``shared_state``; may hold a password, never logged). Each replica's in-flight
      work is then its own plus the others' (plugins/load/shared_load.py).
    * ``share_interval_s`` [s] — publish/read period (0.2: a request's prefill on the
      simulated H100 fleet takes 0.05-2 s, so the view lags less than one typical prefill,
      for 10 small Redis commands per second per replica).
    * ``share_ttl_s`` [s] — a replica's published load expires after this (1.0: five missed
      rounds; a dead replica's load stops counting within a second).
    * ``redis_timeout_s`` [s] — bound on one exchange round, two round trips (0.5: LAN round
      trips are < 1 ms, but the bound also counts event-loop lag, which passed 0.1 s on a
      saturated 2-core host; a timed-out round drops the other replicas' load).
    * ``max_replicas`` [replicas] — other replicas read per round (64).
    * ``key_prefix`` — Redis key prefix.
    """

    type_name = "token-load-scorer"
    example_params: ClassVar[Mapping[str, object]] = {
        "decode_token_weight": 4.0,
        "saturation_tokens": 32768,
    }

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)

        decode_token_weight: float = Field(default=4.0, ge=0.0)
        default_output_tokens: int = Field(default=256, ge=0)
        max_output_tokens: int = Field(default=4096, ge=1)
        saturation_tokens: int = Field(default=32768, ge=1)
        max_age_s: float = Field(default=900.0, gt=0.0)
        max_entries: int = Field(default=65536, ge=1)
        redis_url: SecretStr | None = None
        share_interval_s: float = Field(default=0.2, gt=0.0)
        share_ttl_s: float = Field(default=1.0, gt=0.0)
        redis_timeout_s: float = Field(default=0.5, gt=0.0)
        max_replicas: int = Field(default=64, ge=1)
        key_prefix: str = Field(default="kvgate:load:", min_length=1)

    def __init__(self, name: str, params: BaseModel, plugins: PluginLookup) -> None:
        super().__init__(name, params, plugins)
        assert isinstance(params, TokenLoadScorer.Params)
        if params.redis_url is not None and find_spec("redis") is None:
            raise ConfigError("redis_url needs the 'redis' package (pip install 'kvgate[redis]')")
        self.p = params
        self.tracker = LoadTracker(params.max_entries, params.max_age_s)
        #: Monotonic clock; tests replace it.
        self.clock = time.monotonic
        self._ticket: StateKey[int] = StateKey(f"{name}/ticket")
        #: The other replicas' load (with ``redis_url``, once started).
        self.shared: LoadExchange | None = None
        self._counters: CounterShare | None = None

    def share_counters(self, share: CounterShare) -> None:
        """Exchange a plugin's per-engine counters with the other replicas too (placement's
        inserted tokens); called at construction, effective with ``redis_url``."""
        self._counters = share

    def load(self, endpoint: EndpointId) -> EngineLoad:
        """In-flight load on an engine: this replica's plus the others' last published."""
        own = self.tracker.load(endpoint)
        other = self.shared.remote.get(endpoint) if self.shared is not None else None
        if other is None:
            return own
        return EngineLoad(own.prefill_tokens + other.prefill_tokens,
                          own.decode_tokens + other.decode_tokens, own.requests + other.requests)

    def work(self, endpoint: EndpointId) -> float:
        """In-flight prefill-token equivalents on an engine (every replica's)."""
        return self.load(endpoint).work(self.p.decode_token_weight)

    def works(self, endpoints: Sequence[EndpointId]) -> dict[EndpointId, float]:
        """:meth:`work` of each engine in one call (the placement scorer reads every
        candidate's on every request); an engine without a replica's share reads its own."""
        weight = self.p.decode_token_weight
        remote = self.shared.remote if self.shared is not None else None
        if not remote:
            return self.tracker.works(endpoints, weight)
        return {e: self.load(e).work(weight) for e in endpoints}

    # Scorer
    def score(
        self, req: InferenceRequest, state: CycleState, eps: Sequence[Endpoint]
    ) -> Mapping[EndpointId, float]:
        prompt = prompt_tokens(req, state)
        match = state.get(PREFIX_MATCH)
        projected = {
            ep.id: self.work(ep.id) + uncached_tokens(prompt, match, ep.id) for ep in eps
        }
        return load_scores(projected, float(self.p.saturation_tokens))

    def charges(
        self, req: InferenceRequest, state: CycleState, decision: RoutingDecision
    ) -> tuple[Charge, ...]:
        """What this dispatch puts on which engine."""
        prompt = prompt_tokens(req, state)
        match = state.get(PREFIX_MATCH)
        decode = expected_output_tokens(
            req.body, self.p.default_output_tokens, self.p.max_output_tokens
        )
        target = decision.target.id
        prefill_ep = decision.prefill.id if decision.prefill is not None else target
        prefill = uncached_tokens(prompt, match, prefill_ep)
        if prefill_ep == target:
            return (Charge(target, prefill, decode),)
        return (Charge(prefill_ep, prefill, 0), Charge(target, 0, decode))

    # DispatchHook
    async def before_dispatch(
        self, req: InferenceRequest, state: CycleState, decision: RoutingDecision
    ) -> None:
        previous = state.get(self._ticket)
        if previous is not None:  # a retry whose first dispatch was not completed
            self.tracker.release(previous)
        charges = self.charges(req, state, decision)
        state.put(self._ticket, self.tracker.charge(req.request_id, charges, self.clock()))

    # CompletionHook
    async def on_complete(
        self, req: InferenceRequest, state: CycleState, target: Endpoint, outcome: Outcome
    ) -> None:
        ticket = state.get(self._ticket)
        if ticket is not None:
            self.tracker.release(ticket)
        self.tracker.sweep(self.clock())

    # PrefillHook
    async def on_prefill_done(
        self, req: InferenceRequest, state: CycleState, prefill: Endpoint, ok: bool
    ) -> None:
        ticket = state.get(self._ticket)
        if ticket is not None:
            self.tracker.release_prefill(ticket, prefill.id)

    # EndpointSetListener
    def on_endpoints_changed(
        self, added: Sequence[Endpoint], removed: Sequence[Endpoint]
    ) -> None:
        self.tracker.forget([ep.id for ep in removed])

    # Lifecycle
    async def start(self) -> None:
        if self.p.redis_url is None or self.shared is not None:
            return
        self.shared = LoadExchange(
            connect(self.p.redis_url.get_secret_value(), self.p.redis_timeout_s),
            self.tracker.loads, prefix=self.p.key_prefix, interval_s=self.p.share_interval_s,
            ttl_s=self.p.share_ttl_s, timeout_s=self.p.redis_timeout_s,
            max_replicas=self.p.max_replicas, counters=self._counters)
        self.shared.start()

    async def stop(self) -> None:
        shared, self.shared = self.shared, None
        if shared is not None:
            await shared.stop()

    # HealthSource, MetricsSource
    def health(self) -> Mapping[str, object]:
        return self.shared.health() if self.shared is not None else {}

    def collector(self) -> Collector:
        return LoadCollector(self.tracker.loads, lambda: self.shared)


class TokenImbalanceFilter(Plugin, Filter):
    """Drops engines loaded more than ``max_imbalance * mean + slack_tokens``.

    Reads the in-flight load of a ``token-load-scorer`` declared before it (``load_scorer``).

    Params (units in brackets):

    * ``load_scorer`` — name of that token-load-scorer instance.
    * ``measure`` — ``total`` (prefill + weighted decode: the engine's whole queue; default,
      because requests that hit a hot prefix carry little prefill and pile up as decode work) or
      ``prefill`` (uncached prefill tokens only: bounds the prefill-load imbalance alone).
    * ``max_imbalance`` [ratio ≥ 1] — 1.25: the same bound as bounded-load hashing in the
      session scorer; with N engines it caps the hottest at 25 % above the mean.
    * ``slack_tokens`` [prefill-token equivalents] — 4096: about one long prompt (≈ 0.1 s of H100
      prefill for an 8B model); below that, imbalance costs no noticeable latency, and a single
      request on an idle fleet must not trip the guard.
    """

    type_name = "token-imbalance-filter"
    example_params: ClassVar[Mapping[str, object]] = {
        "load_scorer": "token-load-scorer",
        "max_imbalance": 1.25,
        "slack_tokens": 4096,
    }

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)

        load_scorer: str = "token-load-scorer"
        measure: Literal["total", "prefill"] = "total"
        max_imbalance: float = Field(default=1.25, ge=1.0)
        slack_tokens: int = Field(default=4096, ge=0)

    def __init__(self, name: str, params: BaseModel, plugins: PluginLookup) -> None:
        super().__init__(name, params, plugins)
        assert isinstance(params, TokenImbalanceFilter.Params)
        self.p = params
        scorer = plugins.lookup(params.load_scorer)
        if not isinstance(scorer, TokenLoadScorer):
            raise ConfigError(f"load_scorer {params.load_scorer!r} is not a token-load-scorer")
        self.scorer = scorer

    def _load(self, endpoint: EndpointId) -> float:
        if self.p.measure == "prefill":
            return float(self.scorer.load(endpoint).prefill_tokens)
        return self.scorer.work(endpoint)

    def filter(
        self, req: InferenceRequest, state: CycleState, eps: Sequence[Endpoint]
    ) -> Sequence[Endpoint]:
        loads = {ep.id: self._load(ep.id) for ep in eps}
        keep = within_bound(loads, self.p.max_imbalance, float(self.p.slack_tokens))
        return [ep for ep in eps if ep.id in keep]
