"""Capacity-aware placement (plugin ``kv-placement-scorer``): where a request's KV should live.

The problem it solves. Under KV pressure every engine's cache is full all the time, so "how
full" says nothing; what matters is how fast each cache is being *rewritten*. In an LRU cache a
block survives about ``capacity / insertion rate``; a session's prefix is found again only if
its engine inserted less than its capacity since the session's last turn. One pooled LRU of the
whole fleet's capacity is the reference: if the gateway makes every engine's insertion rate
proportional to its capacity, and never stores a prefix twice, every engine's blocks live as
long as in the pooled cache. A router that ranks engines by the share of the prompt they hold
does neither: every engine that holds a shared system prompt looks equally good, and the one
that cached it first wins every new session until it thrashes.

The algorithm. For each candidate engine ``e`` the scorer estimates what choosing ``e`` costs,
in prefill-token equivalents::

    miss(e)     = prompt - held(e)                          tokens e must compute and insert
    queue(e)    = in-flight work on e (token-load-scorer)   tokens computed before this one
    pressure(e) = recent insertions into e / capacity(e)    share of e's cache rewritten
    turnover(e) = 1 + (pressure(e) - min over candidates of pressure) / floor
    J(e)        = miss(e) * turnover(e) ** pressure_exponent + load_weight * queue(e)
                  - pin_tokens  if e is the engine the request's session used last

and gives the engine with the lowest ``J`` score 1, the others ``1 - (J - J_min) / spread``.

* Inserting a token costs its recompute, scaled by how fast the engine's cache turns over
  relative to the slowest-turning candidate: in an LRU cache a block's lifetime is inversely
  proportional to the insertion rate, so a token inserted where blocks live half as long
  displaces a block twice as likely to be wanted again.
* Tokens every engine holds (a shared system prompt) are not in anyone's ``miss``: what decides
  is what one engine holds *beyond* the others, weighed against the pressure there.
* A request whose prefix no engine holds (a new session, a cold prompt) has equal ``miss``
  everywhere: it goes where the cache turns over slowest (and queues least) - the fleet's
  working set is spread by footprint against capacity.
* A request whose prefix lives on one engine inserts only its new tokens there, so it stays
  ("sticky") until that engine turns over ``1 + unique prefix / new tokens`` times faster than
  another, or its queue outweighs the prefix ("until saturated"). A session whose prefix was
  evicted has nothing to stick to and is placed like cold work.
* A session's own recent insertions (with a session key) are left out of its engine's pressure
  for its next turn: its growth evicts nothing it wants back
  (plugins/placement/insertion_ledger.py).
* Recent insertions decay by the fleet's own insertions, not by wall time: half of the weight
  is gone after the fleet inserted ``half_life_caches`` x its total capacity. What was inserted
  a fleet-turnover ago has mostly been evicted, and an idle fleet (which evicts nothing) keeps
  its pressures. The signal is therefore the same at any request rate or trace speed-up.

Several replicas (``redis_url`` on the token-load scorer named by ``load``): each replica's
charged insertions are shared with the others through Redis every ``share_interval_s`` and
added to their ledgers, so every replica's pressure counts the whole fleet's insertions (a
replica alone would see only the requests it routed: a noisier sample of the same rates).
With its own ``redis_url`` (``--redis`` sets both), its memory of each session is told to the
other replicas too (plugins/placement/shared.py): a replica may see one turn in N.

Insertions are charged at dispatch from what the scheduler knew (``miss`` on the engine that
prefills, the prompt minus its hit on a decode engine that receives transferred KV, plus the
expected output, whose full blocks the engine caches too).

Inputs: ``PREFIX_MATCH`` (precise or approximate; optional: without it every engine misses
everything and only pressure, queue and pin decide), ``TOKEN_IDS`` (prompt size),
``SESSION_KEY`` (optional; the pin is ``SESSION_PIN``, the shared session table's engine, when
the session-affinity scorer has one from Redis, else this process's own), each engine's
capacity from its ``/metrics`` (``EngineMetrics.extra["kv_capacity_tokens"]``, vLLM's
``vllm:cache_config_info``) or the params, the token-load scorer's in-flight work
(optional). Bounded state: one pressure entry and one inserted-token total per engine (dropped
with it) and at most ``max_sessions`` session pins (least recently used
evicted first). Parameters and why their values: docs/plugins/placement.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from importlib.util import find_spec
from typing import Any, ClassVar

from prometheus_client.registry import Collector
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from kvgate.middleware.framework.errors import ConfigError
from kvgate.middleware.framework.plugin import (
    DispatchHook,
    EndpointSetListener,
    HealthSource,
    Lifecycle,
    MetricsSource,
    Persistent,
    Plugin,
    PluginLookup,
    Scorer,
)
from kvgate.middleware.framework.types import (
    KV_CAPACITY_TOKENS,
    CycleState,
    Endpoint,
    EndpointId,
    InferenceRequest,
    RoutingDecision,
    StateKey,
    add_log_field,
)
from kvgate.plugins.common.broadcast import Broadcast
from kvgate.plugins.common.state import (
    PREFIX_MATCH,
    PROMPT_CHAIN,
    SESSION_KEY,
    SESSION_PIN,
    TOKEN_IDS,
    PrefixMatch,
)
from kvgate.plugins.load.session_table import session_digest
from kvgate.plugins.load.shared_load import CounterShare
from kvgate.plugins.load.token_load import (
    TokenLoadScorer,
    expected_output_tokens,
    prompt_tokens,
    uncached_tokens,
)
from kvgate.plugins.placement.conversations import Conversations, Turn
from kvgate.plugins.placement.insertion_ledger import InsertionLedger, SessionInsertions
from kvgate.plugins.placement.metrics import PlacementCollector
from kvgate.plugins.placement.pins import SessionPins
from kvgate.plugins.placement.shared import (
    apply_told,
    conversation_item,
    parse,
    session_item,
    start_placement_share,
)
from kvgate.plugins.placement.state import PLACEMENT, Placement, PlacementStats, PlacementView

#: The request's earlier turn found without a session header (None: looked up, none found).
_PREVIOUS: StateKey[tuple[Turn | None]] = StateKey("kv-placement-previous-turn")


class KvPlacementScorer(
    Plugin, Scorer, DispatchHook, EndpointSetListener, Lifecycle, HealthSource, MetricsSource,
    Persistent,
):
    """Plugin ``kv-placement-scorer`` (see the module docstring and docs/plugins/placement.md).

    Params (units in brackets):

    * ``pressure_exponent`` [1] — 1.0: the cost of an inserted token grows linearly with the
      engine's relative turnover, as the reuse odds of the block it displaces do under LRU (a
      block lives capacity / insertion rate). 0 disables the pressure term.
    * ``pressure_floor`` [share of a cache] — 0.05: the lead in recent insertions over the
      slowest candidate that doubles the cost of a token inserted there. A difference, not a
      ratio: in steady state every pressure carries ~1.4 caches of earlier traffic, and a ratio
      hid a new workload's imbalance behind it (docs/routing.md, "Steady state").
    * ``half_life_caches`` [fleet capacities] — 1.0: an LRU cache keeps a block for about one
      turnover, so insertions older than one fleet turnover no longer occupy anything.
    * ``load_weight`` [cost tokens per in-flight token] — 0.02: a queued token delays this
      request once, a missed token duplicates a prefix and displaces blocks others want: the
      queue is a saturation guard (a session moves when its engine's queue exceeds fifty times
      the prefix it holds beyond the others). Sweeps: docs/plugins/placement.md.
    * ``pin_tokens`` [tokens] — 256: the session's last engine wins when the costs are within
      two CPU blocks (128 tokens) or sixteen GPU blocks (16 tokens); a tie-breaker for the
      moments the index cannot see the session (events not yet arrived), never a force that
      beats a real difference in cached prefix or pressure.
    * ``default_capacity_tokens`` [tokens] — 400,000 ≈ the KV of an 8B model on one H100
      (../shared/design/H100_TIMING.md); used until an engine reports its capacity.
    * ``capacity_tokens`` — per engine name, overrides what the engine reports.
    * ``other_tier_weight`` [0..1] — a token held on a slower tier (the fleet's shared tier,
      an engine's CPU offload) counts this much as held: 0.84, the credit
      ``1 - load/prefill per token`` of plugins/prefix/shared_tier.py for the calibrated 8B model
      over a 25 GB/s RDMA link (a local PCIe offload loads faster, so it is worth at least that).
      Measured in bench/tier_sim.py (docs/shared-tier.md): at 0.5 tier-aware routing gained
      half or less of what it gains at 0.84. Set it from ``TierLink(...).credit`` for another
      model or link.
    * ``load`` — name of the token-load-scorer whose in-flight work is ``queue``; ``None``: the
      pool's in-flight request tokens.
    * ``default_output_tokens``, ``max_output_tokens`` [tokens] — expected output when the
      client sets no limit / cap on a client's limit (as token-load-scorer).
    * ``max_sessions`` [sessions] — pins kept (65,536 x ~150 bytes ≈ 10 MB).
    * ``redis_url`` — tell the other replicas what this one remembers of each session
      (plugins/placement/shared.py; default: ``shared_state.redis_url``, i.e. ``--redis``).
    """

    type_name: ClassVar[str] = "kv-placement-scorer"
    example_params: ClassVar[Mapping[str, object]] = {"pressure_exponent": 1.0}

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)
        pressure_exponent: float = Field(1.0, ge=0.0)
        pressure_floor: float = Field(0.05, gt=0.0)
        half_life_caches: float = Field(1.0, gt=0.0)
        load_weight: float = Field(0.02, ge=0.0)
        pin_tokens: int = Field(256, ge=0)
        default_capacity_tokens: int = Field(400_000, ge=1)
        capacity_tokens: dict[str, int] = Field(default_factory=dict)
        other_tier_weight: float = Field(0.84, ge=0.0, le=1.0)
        load: str | None = None
        default_output_tokens: int = Field(256, ge=0)
        max_output_tokens: int = Field(4096, ge=1)
        max_sessions: int = Field(65_536, ge=1)
        redis_url: SecretStr | None = None

    def __init__(self, name: str, params: BaseModel, plugins: PluginLookup) -> None:
        super().__init__(name, params, plugins)
        assert isinstance(params, KvPlacementScorer.Params)
        self.p = params
        if params.redis_url is not None and find_spec("redis") is None:
            raise ConfigError("redis_url needs the 'redis' package (pip install 'kvgate[redis]')")
        #: The other replicas' session memory (with ``redis_url``, once started).
        self.shared: Broadcast | None = None
        self.load: TokenLoadScorer | None = None
        if params.load is not None:
            found = plugins.lookup(params.load)
            if not isinstance(found, TokenLoadScorer):
                raise ConfigError(f"{params.load!r} is not a token-load-scorer")
            self.load = found
        self.ledger = InsertionLedger()
        self._own = SessionInsertions(params.max_sessions)  # each session's own insertions
        #: The same without session headers: conversations told by their prompts' chains.
        self.conversations = Conversations(params.max_sessions)
        self.stats = PlacementStats()
        #: Tokens this replica charged per engine since start (shared with the other replicas)
        self._inserted: dict[EndpointId, float] = {}
        if self.load is not None:
            self.load.share_counters(CounterShare(self._inserted.copy, self.add_remote))
        #: Session pins and, after a restart, hints (plugins/placement/pins.py).
        self.pins = SessionPins(params.max_sessions, self.stats)
        self._capacity: dict[EndpointId, int] = {}
        #: The metrics object each engine's capacity was last read from (one per engine,
        #: dropped when it leaves the pool).
        self._metrics_read: dict[EndpointId, object] = {}
        #: The fleet's half-life [tokens] from ``_capacity``; None once a capacity changed
        #: (read twice per request: a sum over the fleet only when the fleet changed).
        self._half_life_tokens: float | None = None

    # -- inputs -------------------------------------------------------------------------------
    def capacity(self, ep: Endpoint) -> int:
        """KV capacity [tokens]: configured, else reported by the engine, else the default."""
        configured = self.p.capacity_tokens.get(ep.id)
        if configured is not None:
            return configured
        reported = ep.metrics.extra.get(KV_CAPACITY_TOKENS)
        if reported is not None and reported >= 1:
            return int(reported)
        return self.p.default_capacity_tokens

    def _half_life(self) -> float:
        half_life = self._half_life_tokens
        if half_life is None:
            fleet = sum(self._capacity.values()) or self.p.default_capacity_tokens
            half_life = self._half_life_tokens = self.p.half_life_caches * fleet
        return half_life

    def pressure(self, ep: Endpoint) -> float:
        """Recent insertions into ``ep`` per token of its capacity."""
        return self.ledger.value(ep.id, self._half_life()) / self.capacity(ep)

    def _pressures(self, engines: Iterable[EndpointId], half_life: float,
                   floor: float = 0.0) -> dict[EndpointId, float]:
        """:meth:`pressure` (plus ``floor``) of each of ``engines`` (in ``_capacity``), under
        the fleet's ``half_life``: the placement's and the metric's, in one call."""
        return self.ledger.pressures(engines, self._capacity, half_life, floor)

    def _refresh_capacities(self, eps: Sequence[Endpoint]) -> None:
        """Each candidate's :meth:`capacity` into ``_capacity`` (the half-life recomputed when
        one changed). An engine whose metrics are the object read last time is skipped (the
        pool replaces them when it scrapes; the configured capacities never change): one
        lookup per engine per request, :meth:`capacity` only after a scrape."""
        capacity, seen = self._capacity, self._metrics_read
        for ep in eps:
            if seen.get(ep.id) is ep.metrics:  # read already: the same reported capacity
                continue
            seen[ep.id] = ep.metrics
            tokens = self.capacity(ep)
            if capacity.get(ep.id) != tokens:
                capacity[ep.id] = tokens
                self._half_life_tokens = None

    def queue(self, eps: Sequence[Endpoint]) -> dict[EndpointId, float]:
        """Each candidate's queued work [prefill-token equivalents]: the load scorer's, else
        the engine's in-flight prompt tokens."""
        if self.load is not None:
            return self.load.works([ep.id for ep in eps])
        return {ep.id: float(ep.in_flight_tokens) for ep in eps}

    # -- scoring ------------------------------------------------------------------------------
    def place(self, req: InferenceRequest, state: CycleState, eps: Sequence[Endpoint]) -> Placement:
        """The cost of each candidate (module docstring) and the engine holding the most.

        Comprehensions over the candidates with their inputs read into locals first, no method
        call per candidate: the scorer runs on every request over every candidate, so
        per-engine calls add up with the fleet."""
        p = self.p
        self._refresh_capacities(eps)
        half_life = self._half_life()
        prompt = prompt_tokens(req, state)
        match = state.get(PREFIX_MATCH)
        held = _held(eps, float(prompt), match, p.other_tier_weight)
        pressure = self._pressures(held, half_life)
        session = state.get(SESSION_KEY)
        pinned = state.get(SESSION_PIN) or self.pins.of(session)
        turn = None if session is not None else self._previous(state)
        if turn is not None:  # no header: the conversation its prompt continues
            pinned = turn.engine
        if pinned is not None and pinned in pressure:  # its own growth is no threat to it
            # another replica's turn may be told before its tokens reach this ledger: >= 0
            pressure[pinned] = max(0.0, pressure[pinned] - self._own_pressure(
                session, turn, pinned, half_life))
        slowest = min(pressure.values())
        hint = self.pins.hints.get(session) if session is not None else None
        if hint is not None and hint[0] in held:
            held[hint[0]] = max(held[hint[0]], float(min(prompt, hint[1])))
        queued = self.queue(eps)
        costs: dict[EndpointId, float] = {}
        exponent, load_weight, floor = p.pressure_exponent, p.load_weight, p.pressure_floor
        for e, h in held.items():
            turnover = 1.0 + (pressure[e] - slowest) / floor
            if exponent != 1.0:  # the default 1.0: x ** 1.0 is x, one pow per engine saved
                turnover **= exponent
            cost = (prompt - h) * turnover + load_weight * queued[e]
            costs[e] = cost - p.pin_tokens if e == pinned else cost
        lead = max(held.values()) > min(held.values())
        return Placement(costs, max(held, key=held.__getitem__) if lead else None)

    def _own_pressure(self, session: str | None, turn: Turn | None, engine: EndpointId,
                      half_life: float) -> float:
        """The session's (or header-less conversation's) own recent insertions into
        ``engine`` per token of its capacity."""
        total, cap = self.ledger.total, self._capacity[engine]
        if turn is not None:
            return self.conversations.own_pressure(turn, total, half_life, cap)
        if session is None:
            return 0.0
        return self._own.pressure(session_digest(session), engine, total, half_life, cap)

    def score(
        self, req: InferenceRequest, state: CycleState, eps: Sequence[Endpoint]
    ) -> Mapping[EndpointId, float]:
        if not eps:
            return {}
        placement = self.place(req, state, eps)
        state.put(PLACEMENT, placement)
        low = min(placement.costs.values())
        spread = max(placement.costs.values()) - low
        if spread <= 0.0:
            return dict.fromkeys(placement.costs, 1.0)
        return {ep: 1.0 - (cost - low) / spread for ep, cost in placement.costs.items()}

    # -- dispatch -----------------------------------------------------------------------------
    async def before_dispatch(
        self, req: InferenceRequest, state: CycleState, decision: RoutingDecision
    ) -> None:
        prompt = prompt_tokens(req, state)
        match = state.get(PREFIX_MATCH)
        output = expected_output_tokens(
            req.body, self.p.default_output_tokens, self.p.max_output_tokens
        )
        target = decision.target.id
        inserted = {target: float(uncached_tokens(prompt, match, target) + output)}
        if decision.prefill is not None and decision.prefill.id != target:
            inserted[decision.prefill.id] = float(
                uncached_tokens(prompt, match, decision.prefill.id))
        half_life = self._half_life()
        for engine, tokens in inserted.items():
            self.ledger.add(engine, tokens, half_life)
            self._inserted[engine] = self._inserted.get(engine, 0.0) + tokens
            self.stats.inserted_tokens += int(tokens)
        kind = self._count(state.get(PLACEMENT), target)
        if kind is not None:
            add_log_field(state, "placement", kind)
        session = state.get(SESSION_KEY)
        if session is not None:
            self.pins.pin(session, target, prompt)
            digest = session_digest(session)
            self._own.add(digest, target, inserted[target], self.ledger.total, half_life)
            if self.shared is not None:
                self.shared.send(session_item(digest, target, inserted[target]))
        else:
            self._remember(state, target, inserted[target], half_life)

    def _previous(self, state: CycleState) -> Turn | None:
        """The earlier turn a request without session header continues
        (plugins/placement/conversations.py), noted for the dispatch hook."""
        chain, tokens = state.get(PROMPT_CHAIN), state.get(TOKEN_IDS)
        if chain is None or tokens is None:
            return None
        turn = self.conversations.previous(tokens, chain[0], chain[1])
        state.put(_PREVIOUS, (turn,))
        return turn

    def _remember(self, state: CycleState, target: EndpointId, inserted: float,
                  half_life: float) -> None:
        chain, tokens = state.get(PROMPT_CHAIN), state.get(TOKEN_IDS)
        if chain is None or tokens is None:
            return
        looked = state.get(_PREVIOUS)
        previous = looked[0] if looked is not None else self._previous(state)
        turn = self.conversations.add(tokens, chain[0], chain[1], target, inserted,
                                      self.ledger.total, half_life, previous)
        if turn is not None and self.shared is not None:
            self.shared.send(conversation_item(turn, inserted, previous))

    def apply_shared(self, item: Any) -> bool:
        """Another replica's session memory (plugins/placement/shared.py), applied as if this
        replica had dispatched it, at this replica's fleet counter; False: malformed, or an
        engine this replica has not scored yet (a replica learns the fleet on its first
        request) or does not route to."""
        return apply_told(parse(item), self._own, self.conversations, self._capacity,
                          self.ledger.total, self._half_life())

    def add_remote(self, inserted: Mapping[EndpointId, float]) -> None:
        """The other replicas' insertions since the last exchange (shared through Redis by the
        token-load scorer): every replica's pressure then counts the whole fleet's."""
        half_life = self._half_life()
        for engine, tokens in inserted.items():
            if engine in self._capacity:
                self.ledger.add(engine, tokens, half_life)
                self.stats.remote_inserted_tokens += int(tokens)

    def _count(self, placement: Placement | None, target: EndpointId) -> str | None:
        """The decision's kind (cold, home, moved), counted; None: no placement for it."""
        if placement is None or target not in placement.costs:
            return None  # e.g. P/D: the last placement scored the prefill pool, not the target
        kind = ("cold" if placement.home is None
                else "home" if placement.home == target else "moved")
        self.stats.decisions[kind] += 1
        return kind

    # -- Lifecycle, HealthSource: the session memory shared with the other replicas ----------
    async def start(self) -> None:
        if self.p.redis_url is None or self.shared is not None:
            return
        self.shared = start_placement_share(self.p.redis_url.get_secret_value(),
                                            self.apply_shared, self.name)

    async def stop(self) -> None:
        shared, self.shared = self.shared, None
        if shared is not None:
            await shared.stop()

    def health(self) -> Mapping[str, object]:
        return self.shared.health() if self.shared is not None else {}

    # -- persistence (middleware/serving/routing_state.py) -----------------------------------
    def snapshot(self) -> dict[str, object]:
        """Session pins (least recently used first) and the insertion ledger: what makes a
        restarted gateway send a session back to its engine and keep the pressures it saw."""
        return {"pins": self.pins.snapshot(),
                "ledger": self.ledger.snapshot()}

    def restore(self, data: dict[str, object]) -> int:
        """Take back :meth:`snapshot` (at startup, before the first request); at most
        ``max_sessions`` pins, the most recent kept."""
        ledger = data["ledger"]
        if not isinstance(ledger, dict):
            raise TypeError("ledger must be a mapping")
        pins = SessionPins(self.p.max_sessions, self.stats)
        restored = pins.restore(data["pins"])
        engines = self.ledger.restore(ledger)
        self.pins = pins
        return restored + engines

    # -- endpoint set, metrics ----------------------------------------------------------------
    def on_endpoints_changed(
        self, added: Sequence[Endpoint], removed: Sequence[Endpoint]
    ) -> None:
        """Added engines known at once (the others' items apply before a first request)."""
        self._refresh_capacities(added)
        for ep in removed:
            self.ledger.forget(ep.id)
            self._own.forget_engine(ep.id)
            self.conversations.forget_engine(ep.id)
            self._capacity.pop(ep.id, None)
            self._metrics_read.pop(ep.id, None)
            self._inserted.pop(ep.id, None)
        self._half_life_tokens = None
        self.pins.forget_engines({ep.id for ep in removed})

    def collector(self) -> Collector:
        return PlacementCollector(self.metrics_view)

    def metrics_view(self) -> PlacementView:
        """The numbers ``/metrics`` shows, now."""
        return PlacementView(
            stats=self.stats, sessions=len(self.pins.entries), own_sessions=len(self._own),
            hints=len(self.pins.hints), conversations=len(self.conversations),
            conversation_turns_found=self.conversations.found,
            conversations_evicted=self.conversations.evicted,
            pressures=self._pressures(self._capacity, self._half_life()),
            capacities=dict(self._capacity),
            shared=None if self.shared is None else self.shared.stats)


def _held(eps: Sequence[Endpoint], prompt: float, match: PrefixMatch | None,
          weight: float) -> dict[EndpointId, float]:
    """Tokens of the prompt each candidate holds, its slower tiers counted at ``weight``,
    at most the prompt: one loop with its inputs in locals, no call per engine."""
    if match is None:
        return dict.fromkeys([ep.id for ep in eps], 0.0)
    device, other = match.device.get, match.other.get
    held: dict[EndpointId, float] = {}
    for ep in eps:
        e = ep.id
        h = device(e, 0) + weight * other(e, 0)
        held[e] = h if h < prompt else prompt
    return held
