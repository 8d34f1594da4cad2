"""``billing``: cached-token accounting, discounted cost, the usage ledger, budgets, the Usage
API endpoint and token/cost metrics.

Per dispatched request (CompletionHook; a retried attempt is skipped — the final one is the
request's record) it prices the engine's usage with the price book (prompt - cached at the
input rate, cached at the cached-input rate, completion at the output rate, tenant discount;
see pricing/cost.py), and submits one ledger record, idempotent by request id, durable before
the hook returns. Requests that ended without usage (client disconnect, engine failure) are
recorded with the tokens known to have been processed: the prompt (token count if tokenized,
else the gateway's estimate) and the SSE events relayed as completion tokens, flagged
``priced: false`` when no usage arrived. ``cached_tokens`` unknown stays None; with
``estimate_cached`` the routing index's match on the serving engine is billed as cached and
flagged ``estimated``. JSON answers carry the cost in ``x-kvgate-cost-usd`` (usage hooks run
before the response starts). Budgets (``budget_usd`` of an api-keys key) are checked per
request against the key's spend (loaded from the ledger at start, then kept in memory: one
Decimal per key, bounded by the keys file): over budget → 429 ``insufficient_quota``.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from collections.abc import Iterator, Sequence
from decimal import Decimal
from pathlib import Path

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector
from pydantic import BaseModel, ConfigDict, Field

from middleware.errors import BadRequest, ConfigError, Forbidden, RateLimited
from middleware.plugin import (
    Authenticator,
    CompletionHook,
    HttpRequest,
    HttpResponse,
    Lifecycle,
    MetricsSource,
    Plugin,
    PluginLookup,
    RequestHook,
    Route,
    RouteProvider,
    UsageHook,
)
from middleware.types import (
    CycleState,
    Endpoint,
    InferenceRequest,
    Outcome,
    StateKey,
    Usage,
    add_response_header,
)
from plugins.state import PREFIX_MATCH, SESSION_KEY, TOKEN_IDS
from pricing.backends import open_backend
from pricing.cost import Cost, TokenCounts, cost
from pricing.ledger import Ledger
from pricing.prices import PriceBook, PriceError, load_book
from pricing.records import LedgerRecord
from pricing.usage_api import from_unix, usage_page

log = logging.getLogger("kvgate.plugins.billing")
COST: StateKey[Cost] = StateKey("billing-cost")
ZERO = Decimal(0)


class Billing(Plugin, RequestHook, UsageHook, CompletionHook, Lifecycle, RouteProvider,
              MetricsSource):
    """See the module docstring. Params: ``prices`` (price-book path: kvgate YAML or LiteLLM
    JSON), ``ledger`` (``sqlite:///abs/path`` or ``postgresql://...``), ``spool`` (path of the
    durable spool), ``estimate_cached`` (bool), ``cost_header`` (name), ``auth`` (name of the
    authenticator plugin guarding the usage API; admin keys only)."""

    type_name = "billing"

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)
        prices: str
        ledger: str = Field(
            default_factory=lambda: f"sqlite://{Path('.kvgate/ledger.sqlite').resolve()}"
        )
        spool: str = ".kvgate/ledger.spool"
        estimate_cached: bool = False
        cost_header: str = "x-kvgate-cost-usd"
        auth: str | None = "api-keys"

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
        self.spent: dict[str, Decimal] = {}
        self.tokens: dict[tuple[str, str, str], int] = {}
        self.money: dict[tuple[str, str], Decimal] = {}

    # -- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        Path(self.p.spool).parent.mkdir(parents=True, exist_ok=True)
        url = self.p.ledger
        if url.startswith("sqlite:///"):
            Path(url.removeprefix("sqlite://")).parent.mkdir(parents=True, exist_ok=True)
        self.ledger = Ledger(open_backend(url), Path(self.p.spool))
        await self.ledger.start()
        for r in await self.ledger.query(dt.datetime(1970, 1, 1, tzinfo=dt.UTC), _now() + _DAY):
            self.spent[r.key_id] = self.spent.get(r.key_id, ZERO) + r.cost_total
        log.info("billing: ledger %s, %d keys with spend", _redact(url), len(self.spent))

    async def stop(self) -> None:
        if self.ledger is not None:
            await self.ledger.stop()

    # -- request path ---------------------------------------------------------------------
    async def on_request(self, req: InferenceRequest, state: CycleState) -> None:
        budget = getattr(req.principal, "budget_usd", None)
        over = isinstance(budget, Decimal) and req.key_id is not None and (
            self.spent.get(req.key_id, ZERO) >= budget)
        if over:
            raise RateLimited(f"API key {req.key_id!r} has used its budget of ${budget}",
                              code="insufficient_quota")

    async def on_usage(self, req: InferenceRequest, state: CycleState, target: Endpoint,
                       usage: Usage) -> None:
        priced = self._price(req, state, target, usage)
        if priced is not None:
            state.put(COST, priced)
            add_response_header(state, self.p.cost_header, str(priced.total))

    def _price(self, req: InferenceRequest, state: CycleState, target: Endpoint,
               usage: Usage) -> Cost | None:
        price = self.book.price(req.model, _now())
        if price is None:
            return None
        estimate = None
        match = state.get(PREFIX_MATCH)
        if self.p.estimate_cached and match is not None:
            estimate = match.device.get(target.id, 0) + match.other.get(target.id, 0)
        counts = TokenCounts(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)
        return cost(counts, price, self.book.discount(req.tenant), estimate)

    async def on_complete(self, req: InferenceRequest, state: CycleState, target: Endpoint,
                          outcome: Outcome) -> None:
        if outcome.will_retry or self.ledger is None:
            return
        usage = outcome.usage or self._processed(req, state, outcome)
        priced = state.get(COST) or self._price(req, state, target, usage)
        record = _record(req, state, target, outcome, usage, priced)
        self._count(record)
        await self.ledger.submit(record)

    def _processed(self, req: InferenceRequest, state: CycleState, outcome: Outcome) -> Usage:
        """What the engine is known to have done when no usage arrived."""
        if outcome.status >= 400 and outcome.chunks_relayed == 0:
            return Usage(0, 0, None)  # rejected before any work
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
        self.spent[r.key_id] = self.spent.get(r.key_id, ZERO) + r.cost_total

    # -- usage API --------------------------------------------------------------------------
    def routes(self) -> Sequence[Route]:
        return [Route("GET", "/v1/organization/usage/completions", self._usage_api)]

    async def _usage_api(self, request: HttpRequest) -> HttpResponse:
        if self.auth is not None:
            key = self.auth.authenticate(request.headers.get("authorization"))
            if not getattr(key, "admin", False):
                raise Forbidden("the usage API needs an admin key", code="admin_required")
        q = request.query
        try:
            start = int(q["start_time"][0])
            end = int(q.get("end_time", [str(int(_now().timestamp()))])[0])
            width = q.get("bucket_width", ["1d"])[0]
            group_by = [g for v in q.get("group_by", []) for g in v.split(",") if g]
        except (KeyError, ValueError):
            raise BadRequest("start_time (unix seconds) is required; end_time is an integer",
                             param="start_time") from None
        assert self.ledger is not None
        records = await self.ledger.query(from_unix(start), from_unix(end))
        try:
            page = usage_page(records, start, end, width, group_by)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        return HttpResponse(200, json.dumps(page).encode())

    def collector(self) -> Collector:
        return _BillingCollector(self)


class _BillingCollector(Collector):
    def __init__(self, billing: Billing) -> None:
        self._b = billing

    def collect(self) -> Iterator[CounterMetricFamily]:
        tokens = CounterMetricFamily("kvgate_billed_tokens", "Tokens recorded in the ledger",
                                     labels=["tenant", "model", "kind"])
        for (tenant, model, kind), n in sorted(self._b.tokens.items()):
            tokens.add_metric([tenant, model, kind], n)
        money = CounterMetricFamily("kvgate_cost_usd", "Cost recorded in the ledger (USD)",
                                    labels=["tenant", "model"])
        for (tenant, model), amount in sorted(self._b.money.items()):
            money.add_metric([tenant, model], float(amount))
        yield tokens
        yield money


_DAY = dt.timedelta(days=1)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _redact(url: str) -> str:
    """A ledger URL without its password, for logs."""
    head, sep, tail = url.rpartition("@")
    if not sep:
        return url
    scheme, _, cred = head.partition("://")
    return f"{scheme}://{cred.split(':')[0]}:***@{tail}"


def _record(req: InferenceRequest, state: CycleState, target: Endpoint, outcome: Outcome,
            usage: Usage, priced: Cost | None) -> LedgerRecord:
    c = priced
    session = state.get(SESSION_KEY)
    return LedgerRecord(
        request_id=req.request_id, ts=_now(), tenant=req.tenant or "-",
        key_id=req.key_id or "-", model=req.model, engine=target.id,
        prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
        cached_tokens=usage.cached_tokens if c is None or c.cached_source == "reported" else None,
        cached_source=c.cached_source.value if c is not None else (
            "reported" if usage.cached_tokens is not None else "unknown"),
        cost_input=c.input if c else ZERO, cost_cached_input=c.cached_input if c else ZERO,
        cost_output=c.output if c else ZERO, cost_cache_write=c.cache_write if c else ZERO,
        cost_discount=c.discount if c else ZERO, cost_total=c.total if c else ZERO,
        outcome=outcome.kind.value, status=outcome.status, ttft_s=outcome.ttft_s,
        total_s=outcome.total_s, session=None if session is None else str(session),
        priced=c is not None and outcome.usage is not None,
    )


__all__ = ["COST", "Billing"]
