"""``billing``: cached-token accounting, discounted cost, the usage ledger, budgets, the Usage
API endpoint and token/cost metrics.

Pricing. The engine's usage is priced with the price book (pricing/cost.py): (prompt - cached)
at the input rate + cached at the cached-input rate + completion at the output rate, minus the
tenant's discount, each line a Decimal quantized to 1e-10 USD. ``cached_tokens`` unknown (the
engine did not report it) stays None and is billed as uncached, flagged ``unknown``; with
``estimate_cached`` the routing index's match on the serving engine (PREFIX_MATCH, device +
other tiers) is billed as cached instead and flagged ``estimated``. JSON answers carry the cost
in ``cost_header`` (usage hooks run before a JSON response starts; a stream's headers are gone
by the time its usage arrives, so streams have the cost in the ledger only).

Ledger records (one per request that reached an engine, idempotent by request id):

* UsageHook: as soon as the usage is known -- before the client's response ends (JSON: before
  it starts; streams: before the usage event and ``[DONE]`` are relayed) -- a record is made
  durable in the spool (``Ledger.submit`` returns after the fsync). A gateway killed with
  SIGKILL after a client got its answer has that answer's record.
* CompletionHook: the final record (TTFT, total latency, outcome) replaces it (last write
  wins). A retried attempt (``will_retry``) is skipped: the final attempt is the record.
  Requests that ended without usage (client disconnect, engine failure) are recorded with the
  tokens known to have been processed: the prompt (token count if tokenized, else the
  gateway's estimate) and the SSE events relayed as completion tokens, ``priced: false``; an
  engine error before any byte processed nothing (0 tokens).

Sessions: a request's session key (tenant, model and the session header's value, from the
session-affinity plugin) is stored only as ``hs1:`` + the first 32 hex digits of its
HMAC-SHA256 with the gateway secret's ``ledger-session`` key (plugins/tenancy/gateway_secret.py;
``secret_env`` / ``secret_file``, shared with ``cache-salt``), loaded at start: an operator who
knows a session id recomputes the digest to find its records; the ledger alone does not give the
ids away.

Budgets (``budget_usd`` of a key or a tenant) are enforced by the ``quotas`` plugin
(plugins/quotas/plugin.py, docs/plugins/quotas.md), in-process or shared by replicas through Redis:
it asks this plugin for a request's worst-case cost (:meth:`Billing.estimate`), settles with
the real one (``billing-cost`` state, set on every outcome) and seeds spend from the ledger
(:meth:`Billing.spend_by_scope`). Memory: the metric counters per (tenant, model, kind),
bounded by the keys file and the served models.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import time
from collections.abc import Iterator, Sequence
from decimal import Decimal
from pathlib import Path

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from kvgate.middleware.framework.errors import BadRequest, ConfigError, Forbidden
from kvgate.middleware.framework.plugin import (
    Authenticator,
    CompletionHook,
    HttpRequest,
    HttpResponse,
    Lifecycle,
    MetricsSource,
    Plugin,
    PluginLookup,
    Route,
    RouteProvider,
    UsageHook,
    authenticate,
)
from kvgate.middleware.framework.types import (
    CycleState,
    Endpoint,
    InferenceRequest,
    Outcome,
    OutcomeKind,
    StateKey,
    Usage,
    add_log_field,
    add_response_header,
)
from kvgate.plugins.common.state import PREFIX_MATCH, SESSION_KEY, TOKEN_IDS
from kvgate.plugins.tenancy.gateway_secret import (
    DEFAULT_ENV,
    DEFAULT_FILE,
    SESSION_PURPOSE,
    load_secret,
    session_digest,
)
from kvgate.pricing.backends.select import open_backend
from kvgate.pricing.cost import Cost, TokenCounts, cost
from kvgate.pricing.ledger import Ledger
from kvgate.pricing.money import money_str
from kvgate.pricing.prices import PriceBook, PriceError, load_book
from kvgate.pricing.records import LedgerRecord, cost_fields
from kvgate.pricing.usage_api import UsageQueryError, parse_usage_params

log = logging.getLogger("kvgate.plugins.billing")
COST: StateKey[Cost] = StateKey("billing-cost")
ZERO = Decimal(0)
USAGE_PATH = "/v1/organization/usage/completions"


def _default_ledger() -> str:
    return f"sqlite://{Path('.kvgate/ledger.sqlite').resolve()}"


class Billing(Plugin, UsageHook, CompletionHook, Lifecycle, RouteProvider, MetricsSource):
    """See the module docstring and docs/billing.md."""

    type_name = "billing"

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)
        #: Price book: kvgate YAML (USD per million tokens) or LiteLLM's price-map JSON.
        prices: str
        #: ``sqlite:///absolute/path`` (embedded default) or ``postgresql://...``.
        ledger: str = Field(default_factory=_default_ledger)
        #: Directory of the durable spool (one per gateway replica).
        spool: str = ".kvgate/ledger.spool"
        #: Bill the routing index's prefix match as cached when the engine reports nothing.
        estimate_cached: bool = False
        #: Response header carrying a JSON answer's cost (USD, decimal text).
        cost_header: str = Field("x-kvgate-cost-usd", pattern=r"^[A-Za-z0-9-]+$")
        #: Authenticator plugin guarding the usage API (admin keys only); None: unguarded.
        auth: str | None = "api-keys"
        #: Discount per service tier (a deferred run's ``InferenceRequest.service_tier``:
        #: ``batch``, ``queued``, ``background``) as a fraction of the price, e.g.
        #: ``{batch: "0.5"}`` (OpenAI's Batch API price). Applied on top of the cached-token
        #: pricing and combined with the tenant's discount: total off = 1 - (1 - tenant) x
        #: (1 - tier). Live traffic has no tier.
        tier_discounts: dict[str, Decimal] = Field(default_factory=dict)
        #: The gateway secret (plugins/tenancy/gateway_secret.py; shared with ``cache-salt``):
        #: session ids are stored as ``hs1:`` + a keyed digest of the session key, never in clear.
        secret_env: str = DEFAULT_ENV
        secret_file: str = DEFAULT_FILE
        #: Shared state: the gateway secret kept in Redis (default ``shared_state.redis_url``),
        #: so every replica writes the same session digests; wins over ``secret_file``.
        redis_url: SecretStr | None = None

        @field_validator("tier_discounts")
        @classmethod
        def _fractions(cls, value: dict[str, Decimal]) -> dict[str, Decimal]:
            for tier, fraction in value.items():
                if not (fraction.is_finite() and ZERO <= fraction <= 1):
                    raise ValueError(f"tier_discounts.{tier}: {fraction} is not in [0, 1]")
            return value

    example_params = {"prices": "docs/examples/prices.yaml", "ledger": "sqlite:///tmp/x.db",
                      "auth": None}

    def __init__(self, name: str, params: BaseModel, plugins: PluginLookup) -> None:
        super().__init__(name, params, plugins)
        assert isinstance(params, Billing.Params)
        self.p = params
        try:
            self.book: PriceBook = load_book(params.prices)
        except PriceError as exc:
            raise ConfigError(str(exc)) from None
        self.auth: Authenticator | None = None
        if params.auth is not None:
            found = plugins.lookup(params.auth)
            if not isinstance(found, Authenticator):
                raise ConfigError(f"auth {params.auth!r} is not an authenticator plugin")
            self.auth = found
        self.ledger: Ledger | None = None
        self._session_key = b""  # loaded by start(), before the ledger exists
        self.tokens: dict[tuple[str, str, str], int] = {}
        self.money: dict[tuple[str, str], Decimal] = {}

    # -- price reload (plugins/common/reload.py: api-keys' ``reload`` drives it) ----------------
    def watched(self) -> Sequence[Path]:
        return (Path(self.p.prices),)

    def load_new(self) -> object:
        """The price book re-read (ConfigError: bad file; the current book stays)."""
        try:
            return load_book(self.p.prices)
        except PriceError as exc:
            raise ConfigError(str(exc)) from None

    def commit(self, new: object) -> str:
        assert isinstance(new, PriceBook)
        self.book = new
        return f"{len(new.models)} models priced"

    # -- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        url = self.p.ledger
        try:
            backend = open_backend(url)
        except ValueError as exc:
            raise ConfigError(f"billing: {exc}") from None
        await asyncio.to_thread(_make_dirs, url, Path(self.p.spool))
        shared = self.p.redis_url.get_secret_value() if self.p.redis_url else None
        secret = await asyncio.to_thread(load_secret, self.p.secret_env, self.p.secret_file,
                                         None, shared)
        self._session_key = secret.derive(SESSION_PURPOSE)
        self.ledger = Ledger(backend, Path(self.p.spool))
        await self.ledger.start()
        log.info("billing: ledger %s, spool %s, %d models priced", _redact(url), self.p.spool,
                 len(self.book.models))
        if self.auth is None:
            log.warning("billing: the usage API %s is not protected (no authenticator)",
                        USAGE_PATH)

    async def stop(self) -> None:
        if self.ledger is not None:
            await self.ledger.stop()

    # -- budgets (the quotas plugin enforces them) ----------------------------------------
    def estimate(self, req: InferenceRequest, prompt_tokens: int,
                 completion_tokens: int) -> Decimal | None:
        """Worst-case cost of ``req`` (no cached tokens, with the tenant's and tier's discount);
        None: its model has no price."""
        price = self.book.price(req.model, _now())
        if price is None:
            return None
        counts = TokenCounts(prompt_tokens, completion_tokens, None, 0)
        return cost(counts, price, self._discount(req)).total

    async def spend_by_scope(self) -> dict[str, Decimal]:
        """Committed spend per ``key:<id>`` and ``tenant:<name>``, summed in the database."""
        if self.ledger is None:
            return {}
        keys = await self.ledger.spend_by_key()
        tenants = await self.ledger.spend_by_tenant()
        return {**{f"key:{k}": v for k, v in keys.items()},
                **{f"tenant:{t}": v for t, v in tenants.items()}}

    # -- request path ---------------------------------------------------------------------

    async def on_usage(self, req: InferenceRequest, state: CycleState, target: Endpoint,
                       usage: Usage) -> None:
        if not req.billed:  # e.g. tokenize: no usage, no ledger record
            return
        priced = self._price(req, state, target, usage)
        if priced is not None:
            state.put(COST, priced)
            add_response_header(state, self.p.cost_header, money_str(priced.total))
            add_log_field(state, "cost", money_str(priced.total))
        if self.ledger is not None:  # durable before the client's response ends
            early = Outcome(OutcomeKind.DONE, 200, usage,
                            total_s=time.monotonic() - req.received_at)
            await self.ledger.submit(_record(req, state, target, early, usage, priced,
                                             self._session_key))

    def _price(self, req: InferenceRequest, state: CycleState, target: Endpoint,
               usage: Usage) -> Cost | None:
        price = self.book.price(req.model, _now())
        if price is None:
            return None
        estimate = None
        match = state.get(PREFIX_MATCH)
        if self.p.estimate_cached and match is not None:
            estimate = match.device.get(target.id, 0) + match.other.get(target.id, 0)
        counts = TokenCounts(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens,
                             usage.cache_write_tokens)
        return cost(counts, price, self._discount(req), estimate)

    def _discount(self, req: InferenceRequest) -> Decimal:
        """The tenant's discount combined with the request's tier discount (if any)."""
        tenant = self.book.discount(req.tenant)
        tier = self.p.tier_discounts.get(req.service_tier or "", ZERO)
        if tier == ZERO:
            return tenant
        return 1 - (1 - tenant) * (1 - tier)

    async def on_complete(self, req: InferenceRequest, state: CycleState, target: Endpoint,
                          outcome: Outcome) -> None:
        if outcome.will_retry or self.ledger is None or not req.billed:
            return
        usage = outcome.usage or self._processed(req, state, outcome)
        priced = state.get(COST) or self._price(req, state, target, usage)
        if priced is not None:
            state.put(COST, priced)  # the quotas plugin settles budgets with it
        record = _record(req, state, target, outcome, usage, priced, self._session_key)
        add_log_field(state, "cost", None if priced is None else money_str(priced.total))
        add_log_field(state, "session", record.session)  # the keyed digest, never the id
        self._count(record)
        await self.ledger.submit(record)

    def _processed(self, req: InferenceRequest, state: CycleState, outcome: Outcome) -> Usage:
        """What the engine is known to have done when no usage arrived."""
        if outcome.kind is OutcomeKind.UPSTREAM_ERROR and outcome.chunks_relayed == 0:
            return Usage(0, 0, None)  # the engine failed before any work reached the client
        ids = state.get(TOKEN_IDS)
        prompt = len(ids) if ids is not None else req.prompt_token_estimate
        return Usage(prompt, outcome.chunks_relayed, None)

    def _count(self, r: LedgerRecord) -> None:
        for kind, n in (("prompt", r.prompt_tokens), ("completion", r.completion_tokens),
                        ("cached", r.cached_tokens or 0)):
            key = (r.tenant, r.model, kind)
            self.tokens[key] = self.tokens.get(key, 0) + n
        mkey = (r.tenant, r.model)
        self.money[mkey] = self.money.get(mkey, ZERO) + r.cost_total

    # -- usage API --------------------------------------------------------------------------
    def routes(self) -> Sequence[Route]:
        return [Route("GET", USAGE_PATH, self._usage_api)]

    async def _usage_api(self, request: HttpRequest) -> HttpResponse:
        if self.auth is not None:
            key = authenticate(self.auth, request.headers)
            if not getattr(key, "admin", False):
                raise Forbidden("the usage API needs an admin key", code="admin_required")
        try:
            query = parse_usage_params(request.query, int(_now().timestamp()))
        except UsageQueryError as exc:
            raise BadRequest(str(exc), param=exc.param) from None
        assert self.ledger is not None
        page = await self.ledger.usage_page(query)
        return HttpResponse(200, json.dumps(page).encode())

    def collector(self) -> Collector:
        return _BillingCollector(self)


class _BillingCollector(Collector):
    def __init__(self, billing: Billing) -> None:
        self._b = billing

    def collect(self) -> Iterator[CounterMetricFamily]:
        tokens = CounterMetricFamily(
            "kvgate_billed_tokens", "Tokens recorded in the ledger (kind: prompt includes "
            "cached; cached counts reported and estimated cached tokens)",
            labels=["tenant", "model", "kind"])
        for (tenant, model, kind), n in sorted(self._b.tokens.items()):
            tokens.add_metric([tenant, model, kind], n)
        money = CounterMetricFamily("kvgate_cost_usd", "Cost recorded in the ledger (USD)",
                                    labels=["tenant", "model"])
        for (tenant, model), amount in sorted(self._b.money.items()):
            money.add_metric([tenant, model], float(amount))
        yield tokens
        yield money


def _make_dirs(url: str, spool: Path) -> None:
    """The spool directory and a SQLite ledger's directory (blocking: run in a thread)."""
    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite://")).parent.mkdir(parents=True, exist_ok=True)
    spool.mkdir(parents=True, exist_ok=True)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _redact(url: str) -> str:
    """A ledger URL without its password, for logs."""
    head, sep, tail = url.rpartition("@")
    if not sep:
        return url
    scheme, _, cred = head.partition("://")
    return f"{scheme}://{cred.split(':')[0]}:***@{tail}"


def _status(outcome: Outcome) -> int:
    """The HTTP status the client got; 499 (nginx's "client closed request") when it left
    before any response started."""
    if outcome.kind is OutcomeKind.CLIENT_DISCONNECT and outcome.status == 0:
        return 499
    return outcome.status


def _record(req: InferenceRequest, state: CycleState, target: Endpoint, outcome: Outcome,
            usage: Usage, priced: Cost | None, session_key: bytes) -> LedgerRecord:
    """The ledger record; the session key (tenant, model, session id) only as its keyed digest
    (plugins/tenancy/gateway_secret.py ``session_digest``)."""
    session = state.get(SESSION_KEY)
    money = cost_fields(priced)
    if priced is None:
        money["cached_tokens"] = usage.cached_tokens
        money["cached_source"] = "unknown" if usage.cached_tokens is None else "reported"
    return LedgerRecord(
        request_id=req.request_id, ts=_now(), tenant=req.tenant or "-",
        key_id=req.key_id or "-", model=req.model, engine=target.id,
        prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
        cache_write_tokens=usage.cache_write_tokens, outcome=outcome.kind.value,
        status=_status(outcome), ttft_s=outcome.ttft_s,
        total_s=outcome.total_s,
        session=None if session is None else session_digest(session_key, str(session)),
        priced=priced is not None and outcome.usage is not None,
        client_request_id=req.client_request_id, service_tier=req.service_tier, **money,
    )


__all__ = ["COST", "USAGE_PATH", "Billing"]
