"""``quotas``: per-key and per-tenant rate limits, concurrency and budgets, shared by replicas.

(RequestHook, CompletionHook, RequestEndHook, Lifecycle, MetricsSource, HealthSource.)

What it enforces, from the api-keys principal (``limits`` and ``budget_usd`` of the key, and
of its tenant in the keys file's ``tenants:`` section; a request must pass both):

* **requests/min, input tokens/min, output tokens/min** — token buckets holding the limit and
  refilling it continuously over 60 s. Admission reserves 1 request, the gateway's prompt
  estimate (serialized bytes / 4, x1.25 + 16) as input and the request's ``max_tokens`` (or
  ``max_completion_tokens`` / ``max_output_tokens``; else ``default_output_tokens``) as output;
  completion charges the real usage (the difference is taken from or given back to the bucket,
  which may go into debt). A bucket short of what a request needs (capped at the limit, so a
  request larger than the limit still passes when the bucket is full) refuses it: 429
  ``rate_limited`` with ``Retry-After`` (seconds until it would fit).
* **concurrent requests** — a lease per request in flight, released on every outcome (answer,
  engine error, client gone, never dispatched). A lease also carries a deadline
  (``lease_s``): a replica killed mid-request leaks nothing for longer than that.
* **budgets (USD)** — admission reserves the request's worst-case cost (the estimates above
  at the model's price, as if nothing were cached) and is refused, 429 ``insufficient_quota``,
  when spend + reservations in flight have reached the budget; completion replaces the
  reservation with the ledger's cost. At most one admitted request can cross the budget (every
  other sees its reservation), so the overspend is at most one request's cost plus what the
  estimates missed for requests in flight (prompt estimate below the real tokens).

Successful answers carry OpenAI's ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}``
headers: the tightest request bucket and the tightest token bucket (input or output) of the
key and its tenant. Deferred runs (batch, queued, background) are only held to budgets.

Store: in-process (one replica; :mod:`kvgate.plugins.quotas.local`), or Redis with ``redis_url``
(replicas agree; :mod:`kvgate.plugins.quotas.redis_store`): one script call at admission, one at
completion, none for keys without limits or budgets. Spend is seeded from the ledger (billing)
at start and for any budgeted scope Redis lacks (``HSETNX``: replicas seeding at once agree).

When Redis is down (an error or no answer within ``redis_timeout_s``; retried every
``redis_retry_s``): rate limits and concurrency **fail open** to this replica's own buckets
(each replica enforces the full limit: at most N times the limit with N replicas), budgets
**fail closed** (503 ``service_unavailable`` with ``Retry-After`` for keys or tenants with a
budget: no replica can know what the others spend). Settlements that could not reach Redis are
kept (at most ``max_pending_settlements``, oldest dropped and counted) and replayed when it is
back. Shown on ``/health``, in ``/metrics`` and in one WARNING per outage.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib.util import find_spec
from typing import ClassVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from kvgate.middleware.framework.errors import ConfigError, RateLimited, ServiceUnavailable
from kvgate.middleware.framework.plugin import (
    CompletionHook,
    HealthSource,
    Lifecycle,
    MetricsSource,
    Plugin,
    PluginLookup,
    RequestEndHook,
    RequestHook,
)
from kvgate.middleware.framework.tasks import cancel_and_wait
from kvgate.middleware.framework.types import (
    RESPONSE_HEADERS,
    CycleState,
    Endpoint,
    InferenceRequest,
    Outcome,
    OutcomeKind,
    StateKey,
    add_response_header,
)
from kvgate.plugins.billing.plugin import COST, Billing
from kvgate.plugins.quotas.local import LocalStore
from kvgate.plugins.quotas.model import Ask, ScopeLimits, Settlement, Verdict, to_units
from kvgate.plugins.quotas.redis_store import RedisStore, StoreDown, Unseeded, connect
from kvgate.plugins.tenancy.auth import ApiKey, Limits

log = logging.getLogger("kvgate.plugins.quotas")
#: Body fields bounding a request's output, by API (chat, responses).
MAX_TOKEN_FIELDS = ("max_completion_tokens", "max_tokens", "max_output_tokens")


@dataclass(slots=True)
class Ticket:
    """A request's admission: where it was reserved and, once known, its final outcome."""

    ask: Ask
    shared: bool  # reserved in Redis (else in the local store)
    outcome: Outcome | None = None
    settled: bool = False


class Quotas(Plugin, RequestHook, CompletionHook, RequestEndHook, Lifecycle, MetricsSource,
             HealthSource):
    """See the module docstring and docs/plugins/quotas.md.

    Params (units in brackets):

    * ``redis_url`` — share state through Redis (default: ``shared_state.redis_url``; None:
      in-process). May embed a password; never logged.
    * ``redis_timeout_s`` [s] — bound on one Redis call. 0.1: LAN round trips are < 1 ms and a
      script a few more; this caps what a stalled Redis adds to a request before the outage
      policy applies.
    * ``redis_retry_s`` [s] — after a failure Redis is not called for this long (then probed).
    * ``key_prefix`` — Redis key prefix (the ``{quota}`` hash tag keeps one Cluster slot).
    * ``billing`` — the billing plugin pricing budgets (default ``billing`` when declared
      before this plugin; None: budgets are not enforced).
    * ``default_output_tokens`` [tokens] — output reserved for a request without
      ``max_tokens``. 4096: a long answer; the reservation is corrected at completion.
    * ``prompt_factor`` [ratio], ``prompt_overhead_tokens`` [tokens] — input reserved:
      ``ceil(estimate * factor) + overhead``. The gateway's estimate (bytes / 4) runs low for
      short chats (the chat template's tokens: +5 on the simulator) and for dense text (x1.18
      on a 1,440-byte prompt); every token it misses is budget overspent per request in flight,
      so the reservation errs high (1.25, +16); the buckets get the difference back.
    * ``lease_s`` [s] — deadline of an in-flight lease. 900: longer than the default request
      timeout (600 s) so a live request never loses its lease.
    * ``max_scopes`` [scopes] — LRU bound of the in-process store (keys + tenants).
    * ``max_pending_settlements`` [settlements] — kept while Redis is down.
    * ``headers`` — send the ``x-ratelimit-*`` headers.
    """

    type_name = "quotas"
    produces: ClassVar[frozenset[str]] = frozenset({RESPONSE_HEADERS.name})
    example_params: ClassVar[Mapping[str, object]] = {"billing": None}

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)
        redis_url: SecretStr | None = None
        redis_timeout_s: float = Field(0.1, gt=0)
        redis_retry_s: float = Field(2.0, gt=0)
        key_prefix: str = Field("kvgate:{quota}:", min_length=1)
        billing: str | None = "billing"
        default_output_tokens: int = Field(4096, ge=1)
        prompt_factor: float = Field(1.25, ge=1.0)
        prompt_overhead_tokens: int = Field(16, ge=0)
        lease_s: float = Field(900.0, gt=0)
        max_scopes: int = Field(100_000, ge=1)
        max_pending_settlements: int = Field(10_000, ge=1)
        headers: bool = True

    def __init__(self, name: str, params: BaseModel, plugins: PluginLookup) -> None:
        super().__init__(name, params, plugins)
        assert isinstance(params, Quotas.Params)
        self.p = params
        if params.redis_url is not None and find_spec("redis") is None:
            raise ConfigError("redis_url needs the 'redis' package (pip install 'kvgate[redis]')")
        self.billing = _billing(plugins, params)
        self.local = LocalStore(params.max_scopes)
        self.redis: RedisStore | None = None
        self.down_since: float | None = None  # monotonic time Redis went down
        self.retry_at = 0.0
        self.pending: deque[tuple[Ask, Settlement]] = deque(maxlen=params.max_pending_settlements)
        self.counts: dict[str, int] = {"admissions_shared": 0, "admissions_local": 0,
                                       "fallback_admissions": 0, "closed_rejections": 0,
                                       "redis_errors": 0, "settlements_dropped": 0,
                                       "settlements_replayed": 0, "seeds": 0}
        self.rejections: dict[tuple[str, str], int] = {}  # (dimension, scope kind)
        self._ticket: StateKey[Ticket] = StateKey(f"{name}/ticket")
        self._task: asyncio.Task[None] | None = None
        self._seed_cache: tuple[float, dict[str, int]] | None = None

    # -- admission ----------------------------------------------------------------------------
    async def on_request(self, req: InferenceRequest, state: CycleState) -> None:
        key = req.principal
        if not isinstance(key, ApiKey):
            return
        scopes = self.scopes(key, deferred=req.service_tier is not None)
        if not scopes:
            return  # nothing to enforce: no round trip
        output = _max_tokens(req.body) or self.p.default_output_tokens
        prompt = math.ceil(req.prompt_token_estimate * self.p.prompt_factor
                           ) + self.p.prompt_overhead_tokens
        cost = None
        if self.billing is not None and any(s.has_budget for s in scopes):
            cost = self.billing.estimate(req, prompt, output)
        ask = Ask(req.request_id, scopes, prompt, output,
                  0 if cost is None else to_units(cost), math.ceil(self.p.lease_s * 1000))
        verdict, shared = await self._admit(ask)
        self.counts["admissions_shared" if shared else "admissions_local"] += verdict.ok
        if not verdict.ok:
            rkey = (verdict.dimension, verdict.scope.partition(":")[0])
            self.rejections[rkey] = self.rejections.get(rkey, 0) + 1
            raise _refusal(verdict, scopes, self.p.headers)
        state.put(self._ticket, Ticket(ask, shared))
        if self.p.headers:
            _add_headers(state, verdict)

    def scopes(self, key: ApiKey, *, deferred: bool = False) -> tuple[ScopeLimits, ...]:
        """The key's and its tenant's limits that apply (deferred runs: budgets only)."""
        budgets = self.billing is not None
        out = []
        for scope, limits, budget in ((f"key:{key.key_id}", key.limits, key.budget_usd),
                                      (f"tenant:{key.tenant}", key.tenant_limits,
                                       key.tenant_budget_usd)):
            units = to_units(budget) if budgets and budget is not None else -1
            lim = _scope(scope, Limits() if deferred else limits, units)
            if lim.needs_lease or any(lim.bucket_limits):
                out.append(lim)
        return tuple(out)

    async def _admit(self, ask: Ask) -> tuple[Verdict, bool]:
        now_ms = _now_ms()
        if self.redis is None:
            return self.local.admit_now(ask, now_ms), False
        if self.down_since is None or time.monotonic() >= self.retry_at:
            try:
                return await self._admit_shared(self.redis, ask, now_ms), True
            except StoreDown as exc:
                self._failed("admission", exc)
        budgets = [s.scope for s in ask.scopes if s.has_budget]
        if budgets:  # fail closed: no replica knows what the others spend
            self.counts["closed_rejections"] += 1
            raise ServiceUnavailable(
                f"budgets are unavailable (the shared quota store is down); {budgets[0]} has "
                "a budget, so its requests are refused until it is back",
                code="budget_unavailable",
                headers={"retry-after": str(max(1, math.ceil(self.p.redis_retry_s)))})
        self.counts["fallback_admissions"] += 1  # fail open: this replica's own buckets
        return self.local.admit_now(ask, now_ms), False

    async def _admit_shared(self, redis: RedisStore, ask: Ask, now_ms: int) -> Verdict:
        """Admission through Redis, seeding each budgeted scope it lacks (key, then tenant)."""
        for _ in range(len(ask.scopes)):
            try:
                verdict = await redis.admit(ask, now_ms)
                break
            except Unseeded as missing:
                await self._seed(redis, missing.scope)
        else:
            verdict = await redis.admit(ask, now_ms)  # every scope seeded by now
        self._succeeded()
        return verdict

    async def _seed(self, redis: RedisStore, scope: str) -> None:
        """Seed a scope's spend from the ledger (snapshot reused for 5 s across scopes)."""
        now = time.monotonic()
        if self._seed_cache is None or now - self._seed_cache[0] > 5.0:
            self._seed_cache = (now, await self._ledger_spend())
        self.counts["seeds"] += 1
        await redis.seed({scope: self._seed_cache[1].get(scope, 0)})

    async def _ledger_spend(self) -> dict[str, int]:
        if self.billing is None:
            return {}
        spend = await self.billing.spend_by_scope()
        return {scope: to_units(usd) for scope, usd in spend.items()}

    # -- settlement ---------------------------------------------------------------------------
    async def on_complete(self, req: InferenceRequest, state: CycleState, target: Endpoint,
                          outcome: Outcome) -> None:
        ticket = state.get(self._ticket)
        if ticket is not None and not outcome.will_retry:
            ticket.outcome = outcome

    async def on_request_end(self, req: InferenceRequest, state: CycleState,
                             status: int) -> None:
        ticket = state.get(self._ticket)
        if ticket is None or ticket.settled:
            return
        ticket.settled = True
        priced = state.get(COST)
        used = _used(req, ticket.outcome, 0 if priced is None else to_units(priced.total))
        now_ms = _now_ms()
        if not ticket.shared or self.redis is None:
            self.local.settle_now(ticket.ask, used, now_ms)
            return
        if self.down_since is not None and time.monotonic() < self.retry_at:
            self._keep(ticket.ask, used)
            return
        try:
            await self.redis.settle(ticket.ask, used, now_ms)
            self._succeeded()
        except StoreDown as exc:
            self._failed("settlement", exc)
            self._keep(ticket.ask, used)

    def _keep(self, ask: Ask, used: Settlement) -> None:
        if len(self.pending) == self.pending.maxlen:
            self.counts["settlements_dropped"] += 1
        self.pending.append((ask, used))

    async def _replay(self, redis: RedisStore) -> None:
        """Settlements kept during an outage, oldest first; stops at the first failure."""
        while self.pending:
            ask, used = self.pending[0]
            await redis.settle(ask, used, _now_ms())
            self.pending.popleft()
            self.counts["settlements_replayed"] += 1

    # -- outage bookkeeping -------------------------------------------------------------------
    def _failed(self, what: str, exc: StoreDown) -> None:
        self.counts["redis_errors"] += 1
        self.retry_at = time.monotonic() + self.p.redis_retry_s
        if self.down_since is None:
            self.down_since = time.monotonic()
            log.warning("quota store (Redis) unavailable (%s failed: %s): rate limits and "
                        "concurrency fall back to this replica's own buckets (fail open); "
                        "keys and tenants with a budget get 503 (fail closed); retrying every "
                        "%.1f s", what, exc, self.p.redis_retry_s)

    def _succeeded(self) -> None:
        if self.down_since is not None:
            log.warning("quota store (Redis) reachable again after %.1f s; replaying %d "
                        "settlements", time.monotonic() - self.down_since, len(self.pending))
            self.down_since = None

    async def _watch(self) -> None:
        """Probe Redis while it is down, and replay kept settlements once it is back."""
        while True:
            await asyncio.sleep(self.p.redis_retry_s)
            redis = self.redis
            if redis is None or (self.down_since is None and not self.pending):
                continue
            try:
                await redis.ping()
                self._succeeded()
                await self._replay(redis)
            except StoreDown as exc:
                self._failed("probe", exc)

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        spend = await self._ledger_spend()
        await self.local.seed(spend)
        if self.p.redis_url is None:
            return
        self.redis = RedisStore(
            connect(self.p.redis_url.get_secret_value(), self.p.redis_timeout_s),
            prefix=self.p.key_prefix, timeout_s=self.p.redis_timeout_s)
        try:
            await self.redis.seed(spend)
        except StoreDown as exc:
            self._failed("seeding", exc)
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            if not self._task.cancelled():
                self._task.result()  # a failed loop still raises, as before
            self._task = None
        if self.redis is not None:
            with contextlib.suppress(StoreDown):
                await self._replay(self.redis)
            await self.redis.close()
            self.redis = None

    # -- reporting ----------------------------------------------------------------------------
    def health(self) -> Mapping[str, object]:
        if self.p.redis_url is None:
            backend, state = "local", "ok"
        else:
            backend, state = "redis", "ok" if self.down_since is None else "down"
        return {"backend": backend, "state": state,
                "policy_when_down": {"rate_limits": "open (per-replica buckets)",
                                     "budgets": "closed (503)"},
                "pending_settlements": len(self.pending),
                "local_in_flight": self.local.in_flight()}

    def collector(self) -> Collector:
        return _QuotaCollector(self)


class _QuotaCollector(Collector):
    def __init__(self, q: Quotas) -> None:
        self._q = q

    def collect(self) -> Iterator[Metric]:
        q = self._q
        rej = CounterMetricFamily("kvgate_quota_rejections", "Requests refused by a quota "
                                  "(dimension: requests, input_tokens, output_tokens, "
                                  "concurrent, budget; scope: key, tenant)",
                                  labels=["dimension", "scope"])
        for (dim, scope), n in sorted(q.rejections.items()):
            rej.add_metric([dim, scope], n)
        yield rej
        events = CounterMetricFamily("kvgate_quota_events", "Quota store events (kind: "
                                     + ", ".join(sorted(q.counts)) + ")", labels=["kind"])
        for kind, n in sorted(q.counts.items()):
            events.add_metric([kind], n)
        yield events
        up = GaugeMetricFamily("kvgate_quota_store_up", "1 while the quota store answers "
                               "(always 1 in-process)", labels=["backend"])
        up.add_metric(["redis" if q.p.redis_url else "local"], float(q.down_since is None))
        yield up
        yield GaugeMetricFamily("kvgate_quota_pending_settlements", "Settlements kept while "
                                "Redis is down", value=len(q.pending))


def _billing(plugins: PluginLookup, p: Quotas.Params) -> Billing | None:
    """The billing plugin pricing budgets; the default name is optional."""
    if p.billing is None:
        return None
    try:
        found = plugins.lookup(p.billing)
    except ConfigError:
        if "billing" in p.model_fields_set:
            raise
        return None
    if not isinstance(found, Billing):
        raise ConfigError(f"billing {p.billing!r} is not a billing plugin")
    return found


def _scope(scope: str, limits: Limits, budget_units: int) -> ScopeLimits:
    return ScopeLimits(scope, limits.requests_per_min or 0, limits.input_tokens_per_min or 0,
                       limits.output_tokens_per_min or 0, limits.max_concurrent or 0,
                       budget_units)


def _max_tokens(body: Mapping[str, object]) -> int | None:
    for name in MAX_TOKEN_FIELDS:
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _used(req: InferenceRequest, outcome: Outcome | None, cost_units: int) -> Settlement:
    """What the request used: the engine's usage, else what is known to have been processed
    (as billing records it), nothing when it was never dispatched."""
    if outcome is None:
        return Settlement(0, 0, 0)
    if outcome.usage is not None:
        return Settlement(outcome.usage.prompt_tokens, outcome.usage.completion_tokens,
                          cost_units)
    if outcome.kind is OutcomeKind.UPSTREAM_ERROR and outcome.chunks_relayed == 0:
        return Settlement(0, 0, cost_units)
    return Settlement(req.prompt_token_estimate, outcome.chunks_relayed, cost_units)


#: The ``x-ratelimit-*`` suffix of a refused bucket dimension (OpenAI has one for tokens).
_HEADER_OF = {"requests": "requests", "input_tokens": "tokens", "output_tokens": "tokens"}


def _refusal(v: Verdict, scopes: tuple[ScopeLimits, ...], headers: bool) -> RateLimited:
    """The 429 of a refused verdict; a refused rate limit carries ``Retry-After`` and, with
    ``headers``, the refused bucket's ``x-ratelimit-*`` headers (remaining 0, reset = the
    wait), as OpenAI's 429s do."""
    kind, _, who = v.scope.partition(":")
    if v.dimension == "budget":
        return RateLimited(f"{'API key' if kind == 'key' else 'tenant'} {who!r} has used its "
                           "budget", code="insufficient_quota")
    what = {"requests": "requests per minute", "input_tokens": "input tokens per minute",
            "output_tokens": "output tokens per minute",
            "concurrent": "concurrent requests"}[v.dimension]
    retry = max(1, math.ceil(v.retry_ms / 1000))
    out = {"retry-after": str(retry)}
    suffix = _HEADER_OF.get(v.dimension)
    refused = next((s for s in scopes if s.scope == v.scope), None)
    if headers and suffix is not None and refused is not None:
        limit = refused.bucket_limits[("requests", "input_tokens", "output_tokens")
                                      .index(v.dimension)]
        out |= {f"x-ratelimit-limit-{suffix}": str(limit),
                f"x-ratelimit-remaining-{suffix}": "0",
                f"x-ratelimit-reset-{suffix}": _duration(v.retry_ms)}
    return RateLimited(f"rate limit reached for {kind} {who!r}: {what}; retry in {retry} s",
                       headers=out)


def _add_headers(state: CycleState, v: Verdict) -> None:
    for suffix, quota in (("requests", v.requests), ("tokens", v.tokens)):
        if quota is not None:
            add_response_header(state, f"x-ratelimit-limit-{suffix}", str(quota.limit))
            add_response_header(state, f"x-ratelimit-remaining-{suffix}", str(quota.remaining))
            add_response_header(state, f"x-ratelimit-reset-{suffix}", _duration(quota.reset_ms))


def _duration(ms: int) -> str:
    """OpenAI's reset format: ``20ms``, ``1s``, ``6m0s``."""
    if ms < 1000:
        return f"{ms}ms"
    minutes, seconds = divmod(math.ceil(ms / 1000), 60)
    return f"{minutes}m{seconds}s" if minutes else f"{seconds}s"


def _now_ms() -> int:
    return int(time.time() * 1000)


__all__ = ["Quotas"]
