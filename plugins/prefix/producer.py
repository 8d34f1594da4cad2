"""Prefix-cache routing: which engine already holds the longest prefix of the prompt.

Two plugins:

``prefix-cache-producer`` (DataProducer + DispatchHook + UsageHook) reads TOKEN_IDS and writes
PREFIX_MATCH.

* ``precise`` mode: looks the prompt up in the ``kv-events`` plugin's index (what the engines
  reported through their KV events). The prompt is hashed per block size the engines use, with
  the extra keys vLLM would attach (the LoRA adapter's name when the model is one of
  ``lora_adapters``; the body's ``cache_salt`` on the first block), so it matches exactly the
  blocks the engine would reuse. When a request is dispatched, its full blocks are inserted
  *speculatively* for the target (and the prefill engine) with a short TTL, so that a burst of
  requests sharing a new prefix follows the first one instead of spreading before the engine's
  events arrive; a real ``BlockStored`` for the block supersedes the guess.
* ``approximate`` mode (no events): the gateway keeps its own record of which blocks it routed
  to which engine, in its own block size, with an LRU bound per engine (the engine's KV
  capacity when its metrics report it, else ``engine_capacity_blocks``), a global bound and a
  TTL. Keyed by the ``cache_salt`` the ``cache-salt`` plugin injected (state ``cache-salt``:
  the tenant's or its sharing group's scope, exactly what separates the engines' caches), else
  scoped by tenant (``scope_by_tenant``), since the record is the gateway's own guess.
* ``auto`` mode: both. Per engine, the KV-event index while that engine's state is ``exact``
  (plugins/prefix/events/health.py), else the gateway's own record, which auto mode therefore always
  keeps. Without a ``kv-events`` plugin every engine is ``approximate``.

In every mode with events, each request served by one engine compares the prediction for its
target (device + other tiers, capped like vLLM caps a hit: the last prompt token is always
recomputed) with the ``cached_tokens`` the engine reported; the states judge the results.

``prefix-cache-scorer`` (Scorer) turns PREFIX_MATCH into a score in [0, 1]:
``(device_tokens + other_tier_weight * other_tokens) / prompt_tokens``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import ClassVar

from prometheus_client.registry import Collector
from pydantic import BaseModel

from kvgate.middleware.framework.errors import ConfigError
from kvgate.middleware.framework.plugin import (
    DataProducer,
    DispatchHook,
    EndpointSetListener,
    Lifecycle,
    NoMetrics,
    Plugin,
    PluginLookup,
    UsageHook,
)
from kvgate.middleware.framework.types import (
    KV_CAPACITY_TOKENS,
    CycleState,
    Endpoint,
    EndpointId,
    InferenceRequest,
    RoutingDecision,
    Usage,
)
from kvgate.plugins.common.state import (
    CACHE_SALT,
    PREFIX_MATCH,
    PROMPT_CHAIN,
    TOKEN_IDS,
    TOKEN_IDS_INEXACT,
    PrefixMatch,
)
from kvgate.plugins.prefix.dispatch_state import (
    CHECK,
    EVENT_HASHES,
    PREDICTED,
    RECORD_HASHES,
    RUNS,
    SHARED_TIER,
    Check,
    Found,
    Hashes,
    record_expiry,
)
from kvgate.plugins.prefix.events.health import IndexHealth
from kvgate.plugins.prefix.events.subscriber import KvEventsSubscriber
from kvgate.plugins.prefix.index.index import HashingError, KvIndex, engine_of
from kvgate.plugins.prefix.producer_params import ProducerParams
from kvgate.plugins.prefix.record_chains import EVENTS, ChainMemo
from kvgate.plugins.prefix.shared_record import RecordMetrics, RecordShare, start_record_share
from kvgate.plugins.prefix.shared_tier import SHARED_HOLDER, fold_shared

#: No engine routed on KV events (the record-only match's ``precise_engines``).
_NO_ENGINES: frozenset[EndpointId] = frozenset()

log = logging.getLogger("kvgate.prefix_cache")


class PrefixCacheProducer(
    Plugin, DataProducer, DispatchHook, UsageHook, EndpointSetListener, Lifecycle,
):
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

    Params: ClassVar[type[ProducerParams]] = ProducerParams

    example_params: ClassVar[Mapping[str, object]] = {"mode": "approximate", "block_size": 64}

    def __init__(
        self, name: str, params: BaseModel, plugins: PluginLookup,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(name, params, plugins)
        assert isinstance(params, PrefixCacheProducer.Params)
        self.p = params
        self.clock = clock
        source = self._events_plugin(plugins) if params.mode != "approximate" else None
        #: The KV-event index (None without events).
        self.events: KvIndex | None = None if source is None else source.index
        #: The gateway's own record (None in precise mode).
        self.record: KvIndex | None = None if params.mode == "precise" else KvIndex(
            params.capacity_blocks, params.engine_capacity_blocks, params.block_size,
            prefix_closed=True)
        self._owns_health = source is None
        self._record_sizes = frozenset({params.block_size})
        #: Recent prompts' record chains: a session's next turn hashes only its new tail.
        self.chains = ChainMemo(params.chain_memo_bytes)
        #: The same for the KV-event index's chains (the engines' block layout and extra keys).
        self.event_chains = ChainMemo(params.chain_memo_bytes, EVENTS)
        #: The other replicas' record insertions (with ``redis_url``, once started).
        self.shared: RecordShare | None = None
        self.states = IndexHealth(policy=params.mode) if source is None else source.health_state
        self.states.set_policy(params.mode, params.fallback_after_s)
        if source is None and params.mode == "auto":
            self.states.no_events_reason = f"no kv-events plugin {params.events!r} is configured"
            log.warning("prefix-cache-producer %r: mode auto without a kv-events plugin named %r: "
                        "every engine is routed on the gateway's own record", name, params.events)

    def _events_plugin(self, plugins: PluginLookup) -> KvEventsSubscriber | None:
        try:
            source = plugins.lookup(self.p.events)
        except (ConfigError, KeyError):  # not declared (the pipeline's lookup: ConfigError)
            if self.p.mode == "auto":
                return None
            raise
        if not isinstance(source, KvEventsSubscriber):
            raise ConfigError(f"{self.p.events!r} is not a kv-events plugin")
        return source

    @property
    def index(self) -> KvIndex:
        """The index routing reads first: the KV-event index (precise) or the record."""
        index = self.events if self.p.mode == "precise" else self.record
        assert index is not None
        return index

    @property
    def precise(self) -> bool:
        return self.p.mode == "precise"

    def on_endpoints_changed(
        self, added: Sequence[Endpoint], removed: Sequence[Endpoint]
    ) -> None:
        """Forget the records of engines that left (the KV-event index: kv-events does)."""
        for ep in removed:
            if self.record is not None:
                self.record.reset_engine(ep.id)
            if self._owns_health:
                self.states.forget(ep.id)
        if self._owns_health:
            for ep in added:
                self.states.configure(ep.id, "none")

    # -- observability (only when this producer owns the states: no kv-events plugin) --------
    def health(self) -> Mapping[str, object]:
        own = self.states.health() if self._owns_health else {}
        return {**own, **self.shared.health()} if self.shared is not None else own

    # -- the record shared between replicas (plugins/prefix/shared_record.py)
    # ------------------------
    async def start(self) -> None:
        if self.p.redis_url is None or self.record is None or self.shared is not None:
            return
        self.shared = start_record_share(self.p.redis_url.get_secret_value(), self._apply_shared)

    async def stop(self) -> None:
        shared, self.shared = self.shared, None
        if shared is not None:
            await shared.stop()

    def _apply_shared(self, engine: EndpointId, hashes: list[int]) -> None:
        if self.record is not None:
            self.record.record(engine, hashes, record_expiry(self.clock(), self.p.record_ttl_s),
                               block_size=self.p.block_size, group_idx=self.p.group_idx)

    def collector(self) -> Collector:
        """The states' metrics in mode auto without a kv-events plugin (every engine
        ``approximate``: a fallback, so it is exported; mode approximate exports none: its
        states never change, and a second producer would register the same names), and with
        ``redis_url`` the shared record's ``kvgate_prefix_record_shared_*`` (once started)."""
        states = self.states.collector() if self._owns_health and self.p.mode == "auto" \
            else NoMetrics()
        return RecordMetrics(states, lambda: self.shared)

    # -- hashing and matching ---------------------------------------------------------------
    def prompt_hashes(
        self, req: InferenceRequest, tokens: Sequence[int], sizes: frozenset[int],
        *, scoped: bool | None = None, by_salt: bool = False,
    ) -> Hashes:
        """The prompt's own hashes for each block size in ``sizes``; ``scoped``: the gateway's
        record (default: not in precise mode), keyed by :mod:`kvgate.plugins.prefix.record_hash`
        (vectorised, its own values) under a scope of LoRA adapter, cache salt and tenant; else the
        KV-event index's hash (the engines' block layout,
        :mod:`kvgate.plugins.prefix.index.hashing`). ``by_salt``: the body's ``cache_salt`` is the
        gateway's injected isolation scope: the record is keyed by it alone, not by tenant (tenants
        of a sharing group share records, as engines do)."""
        if scoped is None:
            scoped = not self.precise
        if scoped:
            scope = self._record_scope(req, by_salt)
            return {size: self.chains.chain(tokens, size, group_idx=self.p.group_idx,
                                            scope=scope) for size in sizes}
        lora = req.model if req.model in self.p.lora_adapters else None
        salt = req.body.get("cache_salt")
        salt = salt if isinstance(salt, str) and salt else None
        return {size: self.event_chains.chain(tokens, size, group_idx=self.p.group_idx,
                                              scope=(lora, salt)) for size in sizes}

    def _record_scope(self, req: InferenceRequest, by_salt: bool) -> tuple[str | None, ...]:
        """The record's scope of ``req``: LoRA adapter, cache salt, tenant (strings or None:
        :func:`kvgate.plugins.prefix.record_hash.scope_of`'s tuple); see :meth:`prompt_hashes`."""
        lora = req.model if req.model in self.p.lora_adapters else None
        salt = req.body.get("cache_salt")
        salt = salt if isinstance(salt, str) and salt else None
        tenant = req.tenant if self.p.scope_by_tenant and not by_salt else None
        return (lora, salt, tenant)

    def _match(self, index: KvIndex, hashes: Hashes, wanted: set[str],
               runs: Found | None = None) -> Found:
        """Per engine, its best holder's match; ``runs``: filled per engine with the tokens
        confirmed by events and not learnt from usage within the match (each the best of its
        holders), found by the match's own walk."""
        holders = index.holders_of(wanted)
        found: Found = {}
        by_holder: dict[str, tuple[int, int]] | None = None if runs is None else {}
        for holder, (dev, oth) in index.match(hashes, self.clock(), self.p.group_idx,
                                               holders, by_holder).items():
            ep = engine_of(holder)
            if (dev, oth) > found.get(ep, (0, 0)):
                found[ep] = (dev, oth)
        if runs is not None and by_holder:
            for holder, (conf, unl) in by_holder.items():
                old = runs.get(engine_of(holder), (0, 0))
                runs[engine_of(holder)] = (max(old[0], conf), max(old[1], unl))
        return found

    def _learn_capacities(self, eps: Sequence[Endpoint]) -> None:
        """Bound each engine's record by its reported KV capacity (in record blocks)."""
        if self.record is None:
            return
        for ep in eps:
            tokens = ep.metrics.extra.get(KV_CAPACITY_TOKENS)
            if tokens is not None and tokens >= self.p.block_size:
                self.record.set_capacity(ep.id, int(tokens // self.p.block_size))

    async def prepare(
        self, req: InferenceRequest, state: CycleState, eps: Sequence[Endpoint]
    ) -> None:
        tokens = state.get(TOKEN_IDS)
        if tokens is None:
            return
        if self.events is None:
            self._prepare_on_record(req, state, eps, tokens)
            return
        self._learn_capacities(eps)
        exact_ids = state.get(TOKEN_IDS_INEXACT) is None
        wanted = {ep.id for ep in eps}
        precise: Found = {}
        approx: Found = {}
        shared = 0
        try:
            if self.events is not None and exact_ids:
                hashes = self.prompt_hashes(req, tokens, self.events.block_sizes(self.p.group_idx),
                                            scoped=False)
                state.put(EVENT_HASHES, hashes)
                runs: Found = {}
                precise = self._match(self.events, hashes, wanted, runs)
                state.put(RUNS, runs)
                shared = sum(self.events.match(hashes, self.clock(), self.p.group_idx,
                                               [SHARED_HOLDER]).get(SHARED_HOLDER, (0, 0)))
            if self.record is not None:
                # keyed by the injected salt when there is one (it is the tenant's or its
                # sharing group's scope, as on the engines), else by tenant
                hashes = self.prompt_hashes(req, tokens, self._record_sizes,
                                            scoped=True, by_salt=CACHE_SALT in state)
                state.put(RECORD_HASHES, hashes)
                approx = self._match(self.record, hashes, wanted)
        except HashingError:
            return
        state.put(PREDICTED, precise)
        chains = state.get(RECORD_HASHES) or state.get(EVENT_HASHES)
        if chains:
            size = min(chains)
            state.put(PROMPT_CHAIN, (size, chains[size]))
        if shared:
            state.put(SHARED_TIER, shared)
        # the fleet's shared tier (KV events with locality REMOTE) is reachable from every engine
        state.put(PREFIX_MATCH, fold_shared(
            self._combine(len(tokens), eps, precise, approx, exact_ids), shared, wanted))

    def _prepare_on_record(self, req: InferenceRequest, state: CycleState,
                           eps: Sequence[Endpoint], tokens: Sequence[int]) -> None:
        """:meth:`prepare` with no KV-event index (mode approximate, or auto without a
        kv-events plugin): every engine is routed on the record, none precisely, with no shared
        tier; the same match, without the events path's work per request."""
        record, size, group = self.record, self.p.block_size, self.p.group_idx
        assert record is not None  # only mode precise has none, and it requires events
        self._learn_capacities(eps)
        scope = self._record_scope(req, CACHE_SALT in state)
        try:
            hashes = {size: self.chains.chain(tokens, size, group_idx=group, scope=scope)}
        except HashingError:
            return
        state.put(RECORD_HASHES, hashes)
        state.put(PROMPT_CHAIN, (size, hashes[size]))
        # the record's holders are the engines themselves (it records engine ids, no ranks):
        # matched in the candidates' order, as the general path's
        found = record.match(hashes, self.clock(), group, [ep.id for ep in eps])
        device: dict[EndpointId, int] = {}
        other: dict[EndpointId, int] = {}
        for engine, held in found.items():
            device[engine], other[engine] = held
        state.put(PREFIX_MATCH, PrefixMatch(len(tokens), device, other, False, _NO_ENGINES))

    def _combine(self, n: int, eps: Sequence[Endpoint], precise: Found, approx: Found,
                 exact_ids: bool) -> PrefixMatch:
        if self.p.mode == "precise":
            by_events = {ep.id for ep in eps}
        elif self.p.mode == "approximate" or not exact_ids:
            by_events = set()
        else:
            by_events = {ep.id for ep in eps if self.states.precise(ep.id)}
        device: dict[EndpointId, int] = {}
        other: dict[EndpointId, int] = {}
        for ep in eps:
            found = (precise if ep.id in by_events else approx).get(ep.id)
            if found is not None:
                device[ep.id], other[ep.id] = found
        every = bool(eps) and len(by_events) == len(eps)
        return PrefixMatch(n, device, other, self.precise or every, frozenset(by_events))

    # -- dispatch: speculation, records, the prediction to check ------------------------------
    async def before_dispatch(
        self, req: InferenceRequest, state: CycleState, decision: RoutingDecision
    ) -> None:
        tokens = state.get(TOKEN_IDS)
        if tokens is None:
            return
        now = self.clock()
        inexact = state.get(TOKEN_IDS_INEXACT)
        targets = [decision.target] if decision.prefill is None else [
            decision.prefill, decision.target
        ]
        for ep in targets:
            self._speculate(req, state, ep, tokens, now)
            self._record(state, ep, now)
            if self.events is not None:
                self.states.token_ids_inexact(ep.id, None if inexact is None else (
                    f"token ids are not the engine's ({inexact}): KV events can never match"))
        if self.events is not None and decision.prefill in (None, decision.target):
            target = decision.target.id
            dev, oth = (state.get(PREDICTED) or {}).get(target, (0, 0))
            size = self.events.block_size(target, self.p.group_idx)
            # the engine loads the shared tier's prefix beyond its own, and reports it cached;
            # the tier is known from (the store's) events, not learnt from usage
            shared = state.get(SHARED_TIER) or 0
            predicted = max(dev + oth, shared)
            # tokens of the match known from events / not learnt from usage, found by its walk
            # (this dispatch's speculation changes neither within the predicted prefix)
            confirmed, unlearned = (state.get(RUNS) or {}).get(target, (0, 0))
            confirmed, unlearned = max(confirmed, shared), max(unlearned, shared)
            state.put(CHECK, Check(target, predicted, size, len(tokens), now,
                                     inexact is not None, min(confirmed, predicted),
                                     min(unlearned, predicted), self.events.removals.seq))

    def _speculate(self, req: InferenceRequest, state: CycleState, ep: Endpoint,
                   tokens: Sequence[int], now: float) -> None:
        """KV-event index: speculative entries, and the prompt for re-keying orphans."""
        hashes = state.get(EVENT_HASHES)
        if self.events is None or hashes is None:
            return
        size = self.events.block_size(ep.id, self.p.group_idx)
        if size not in hashes:  # an engine that has not reported its block size yet
            hashes.update(self.prompt_hashes(req, tokens, frozenset({size}), scoped=False))
        if self.p.speculative_ttl_s > 0:
            self.events.record(ep.id, hashes[size], now + self.p.speculative_ttl_s,
                               block_size=size, group_idx=self.p.group_idx)
        self.events.remember(ep.id, tokens, hashes[size], block_size=size,
                             group_idx=self.p.group_idx)

    def _evicted(self, state: CycleState, check: Check, reported: int, judged: int) -> bool:
        """Whether the engine removed, after the dispatch, a block the index predicted beyond
        what the engine reported (an eviction while the request was in flight)."""
        hashes = state.get(EVENT_HASHES)
        if self.events is None or hashes is None or judged <= reported:
            return False
        size = check.block_size
        blocks = hashes.get(size, ())[reported // size:judged // size]
        return self.events.removals.removed_after(check.target, blocks, check.removals)

    def _record(self, state: CycleState, ep: Endpoint, now: float) -> None:
        hashes = state.get(RECORD_HASHES)
        if self.record is None or hashes is None:
            return
        self.record.record(ep.id, hashes[self.p.block_size],
                           record_expiry(now, self.p.record_ttl_s),
                           block_size=self.p.block_size, group_idx=self.p.group_idx)
        if self.shared is not None:
            self.shared.publish(ep.id, hashes[self.p.block_size])

    # -- usage: predicted vs reported -----------------------------------------------------------
    async def on_usage(
        self, req: InferenceRequest, state: CycleState, target: Endpoint, usage: Usage
    ) -> None:
        """Compare the prediction with the engine's ``cached_tokens`` (skipped when it reported
        none). vLLM always recomputes the last prompt token and only caches whole blocks, so a
        hit is at most ``floor((prompt_tokens - 1) / block_size) * block_size`` tokens
        (``KVCacheManager.get_computed_blocks``: ``max_cache_hit_length = num_tokens - 1``); the
        prediction is capped the same way."""
        check = state.get(CHECK)
        if check is None or check.target != target.id:
            return
        size = check.block_size
        self._extend_speculation(state, target.id, size, check.dispatched_at)
        cap = max(0, (usage.prompt_tokens - 1) // size * size)
        predicted = min(check.predicted, cap)
        reported = usage.cached_tokens
        known = predicted if reported is None or check.inexact else reported
        self.states.served(target.id, check.dispatched_at, expects_event=known < cap)
        if reported is None or check.inexact:
            return
        judged = predicted if check.unlearned is None else min(predicted, check.unlearned)
        self.states.prediction(target.id, judged, reported, size,
                               tokens_agree=check.prompt_tokens == usage.prompt_tokens,
                               confirmed=min(check.confirmed, cap),
                               evicted=self._evicted(state, check, reported, judged),
                               recheck=lambda: self._evicted(state, check, reported, judged))
        if check.prompt_tokens == usage.prompt_tokens:
            self._learn(state, target.id, reported, size)

    def _extend_speculation(self, state: CycleState, engine: EndpointId, size: int,
                            dispatched_at: float) -> None:
        """The prompt's speculative entries live ``speculative_ttl_s`` past the end of the
        request, not only past its dispatch: a prefill longer than the TTL (a long prompt, a
        busy engine) would otherwise let them lapse before the engine stores the blocks and its
        events arrive, and the next turn would be placed as if nothing were cached. A request
        that took under a quarter of the TTL leaves them as they are (they still live at least
        3/4 of the TTL past its end): re-recording is a pass over every block of the prompt
        (~1 ms at 100k tokens in blocks of 16), the dearest step of a short request."""
        hashes = (state.get(EVENT_HASHES) or {}).get(size)
        ttl = self.p.speculative_ttl_s
        if self.events is None or not hashes or ttl <= 0:
            return
        now = self.clock()
        if now - dispatched_at < ttl / 4:
            return
        self.events.record(engine, hashes, now + ttl,
                           block_size=size, group_idx=self.p.group_idx)

    def _learn(self, state: CycleState, engine: EndpointId, reported: int, size: int) -> None:
        """What the engine says it held: its first ``reported // size`` blocks become learnt
        entries (``learned_ttl_s``); learnt entries beyond them are dropped (the engine no
        longer held those). Entries from its events, and speculation (the blocks this request
        is storing, until their events arrive), are left as they are."""
        hashes = (state.get(EVENT_HASHES) or {}).get(size)
        if self.events is None or not hashes or self.p.learned_ttl_s <= 0:
            return
        held = min(reported // size, len(hashes))
        now = self.clock()
        if held:
            self.events.record(engine, hashes[:held], now + self.p.learned_ttl_s,
                               block_size=size, group_idx=self.p.group_idx, learned=True,
                               chain=hashes)
            self.events.stats.learned_blocks += held
        self.events.stats.unlearned_blocks += self.events.forget_records(
            engine, hashes[held:], now + self.p.speculative_ttl_s)
