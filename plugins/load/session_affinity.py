"""Session affinity: keep a session's requests on one engine, softly, the same on every replica.

Type ``session-affinity-scorer``. One object fills several slots:

* **RequestHook** — finds the session header (the first of ``headers``, in order, that is present
  and non-empty), validates its value (at most ``max_length`` characters of printable ASCII, else
  ``400``), writes :data:`kvgate.plugins.common.state.SESSION_KEY` = (tenant, model, session) and
  asks the gateway to echo the header on the response (``echo``).
* **Scorer** — rendezvous (highest-random-weight, HRW) hashing of the session key over the
  candidate endpoints with a stable 64-bit BLAKE2b hash, so every gateway replica ranks engines
  identically without sharing anything, and removing one engine only moves the sessions that
  preferred it. Bounded load: an engine that is unhealthy, or whose in-flight requests exceed
  ``load_factor * mean + load_slack`` (mean over the healthy candidates), is skipped and the
  session falls to the next engine in its HRW order. The chosen engine scores 1.0, the k-th
  eligible engine after it ``decay ** k`` (0 by default: the others score 0).
* **DataProducer / DispatchHook / Lifecycle** — only with ``redis_url``: a shared session table
  ``session -> engine`` with a TTL. The pin is read before scheduling (and preferred over HRW
  while the pinned engine is eligible) and written after scheduling with the engine the
  request actually goes to, so the table follows placements that the prefix/load scorers made.
  Redis being slow or down never fails a request: every call has a ``redis_timeout_s`` bound,
  a failure falls back to HRW, is counted, logged once per outage, and Redis is not tried again
  for ``redis_retry_s``.

Bounded state: no in-memory session table at all (HRW needs none); the only per-plugin structure
is the set of pending background Redis writes, capped at ``max_pending_writes`` (new writes are
dropped and counted past it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from importlib.util import find_spec
from typing import ClassVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from kvgate.middleware.framework.errors import BadRequest, ConfigError
from kvgate.middleware.framework.plugin import (
    DataProducer,
    DispatchHook,
    HealthSource,
    Lifecycle,
    MetricsSource,
    Plugin,
    PluginLookup,
    RequestHook,
    Scorer,
)
from kvgate.middleware.framework.types import (
    RESPONSE_HEADERS,
    CycleState,
    Endpoint,
    EndpointId,
    InferenceRequest,
    RoutingDecision,
    StateKey,
    add_log_field,
    add_response_header,
)
from kvgate.plugins.common.state import SESSION_KEY, SESSION_PIN
from kvgate.plugins.load.session_table import SessionStats, SessionTable, connect_table

log = logging.getLogger("kvgate.plugins.session_affinity")

#: Headers clients send a session id in, most specific first: Cloudflare's (also OpenCode's),
#: then the generic and vendor ones seen in the wild (see docs/plugins/session-affinity.md).
DEFAULT_HEADERS: tuple[str, ...] = (
    "x-session-affinity",
    "x-session-id",
    "x-dynamo-session-id",
    "x-claude-code-session-id",
    "x-smg-routing-key",
    "session-id",
)
#: Tenant placeholder for unauthenticated requests (no api-keys plugin configured).
NO_TENANT = "-"
_HEADER_NAME = re.compile(r"[a-z0-9!#$%&'*+.^_`|~-]+")


@dataclass(frozen=True, slots=True)
class SessionInfo:
    """What the request hook found: the header used, its value, and the scoped key."""

    header: str
    value: str
    tenant: str | None
    key: str


# -- pure helpers ------------------------------------------------------------------------------


def find_session(headers: Mapping[str, str], names: Sequence[str]) -> tuple[str, str] | None:
    """The first header of ``names`` present with a non-empty value, as (name, value).

    An empty value (a client template with an unset variable) counts as absent.
    """
    for name in names:
        value = headers.get(name)
        if value is not None and value.strip():
            return name, value.strip()
    return None


def check_session_value(header: str, value: str, max_length: int) -> None:
    """Raise ``BadRequest`` unless ``value`` is 1..max_length characters of printable ASCII."""
    if len(value) > max_length:
        raise BadRequest(
            f"{header} must be at most {max_length} characters (got {len(value)})", param=header
        )
    if not all(" " <= ch <= "~" for ch in value):
        raise BadRequest(f"{header} must be printable ASCII", param=header)


def session_key(tenant: str | None, model: str, session: str) -> str:
    """The scoped, unambiguous session key: a JSON array (tenant, model, session)."""
    return json.dumps([tenant or NO_TENANT, model, session], separators=(",", ":"))


def hrw_weight(key: str, endpoint_id: EndpointId) -> int:
    """Stable 64-bit rendezvous weight of (key, endpoint): identical on every process."""
    data = key.encode() + b"\x00" + endpoint_id.encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def hrw_order(key: str, eps: Sequence[Endpoint]) -> list[Endpoint]:
    """Endpoints by descending rendezvous weight (ties, ~2^-64 likely, by id)."""
    return sorted(eps, key=lambda ep: (-hrw_weight(key, ep.id), ep.id))


def load_bound(eps: Sequence[Endpoint], factor: float, slack: float) -> float:
    """In-flight requests above which a healthy endpoint counts as overloaded."""
    loads = [ep.in_flight_requests for ep in eps if ep.healthy]
    if not loads:
        return math.inf
    return factor * (sum(loads) / len(loads)) + slack


def preference(
    order: Sequence[Endpoint], bound: float, pinned: EndpointId | None
) -> list[Endpoint]:
    """Eligible endpoints (healthy, within the load bound), pinned one first, then HRW order."""
    eligible = [ep for ep in order if ep.healthy and ep.in_flight_requests <= bound]
    if pinned is not None:
        eligible.sort(key=lambda ep: ep.id != pinned)  # stable: the rest keep HRW order
    return eligible


class SessionAffinityScorer(
    Plugin, RequestHook, DataProducer, Scorer, DispatchHook, Lifecycle, HealthSource,
    MetricsSource,
):
    """Soft, replica-consistent session affinity (see the module docstring for the algorithm).

    Params (units in brackets):

    * ``headers`` — ordered header names; the first present and non-empty one is the session.
    * ``max_length`` [characters] — longest accepted session value (256: session ids in the wild
      are UUIDs or ~30-character tokens; longer values are more likely abuse than ids).
    * ``echo`` — send the session header back on the response (clients can check it was seen).
    * ``load_factor`` [ratio ≥ 1], ``load_slack`` [requests] — an engine with more in-flight
      requests than ``load_factor * mean + load_slack`` is skipped. 1.25 is the usual choice for
      consistent hashing with bounded loads (at most 25 % above the mean, while few sessions
      move); the slack of 2 keeps an almost idle fleet (mean 0.3) from bouncing sessions.
    * ``decay`` [0..1) — score ``decay ** k`` for the k-th eligible engine after the chosen one.
      0 by default: the signal is "this engine or not"; a small value (0.1) makes the session's
      second choice, identical on every replica, win ties when another scorer overrides the first.
    * ``redis_url`` — enables the shared session table (may embed a password; never logged).
    * ``ttl_s`` [s] — pin lifetime, renewed by each request of the session. 600: a session idle
      longer has usually lost its KV blocks to LRU eviction on a busy engine, so HRW is as good.
    * ``redis_timeout_s`` [s] — bound on one Redis call (0.25 s: LAN round trips are < 1 ms,
      but the bound also counts the gateway's own event-loop lag: 50 ms tripped dozens of
      times per minute on a saturated 2-core host in the replay benchmark, each time dropping
      the shared pin; this caps what a stalled Redis adds to a request).
    * ``redis_retry_s`` [s] — after a failure Redis is not called for this long.
    * ``key_prefix`` — Redis key prefix; ``max_pending_writes`` [writes] — cap on background
      writes in flight.
    """

    type_name = "session-affinity-scorer"
    produces: ClassVar[frozenset[str]] = frozenset(
        {SESSION_KEY.name, SESSION_PIN.name, RESPONSE_HEADERS.name})
    example_params: ClassVar[Mapping[str, object]] = {
        "headers": ["x-session-affinity", "x-session-id"],
        "load_factor": 1.25,
        "decay": 0.0,
    }

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)

        headers: tuple[str, ...] = Field(default=DEFAULT_HEADERS, min_length=1)
        max_length: int = Field(default=256, ge=1, le=4096)
        echo: bool = True
        load_factor: float = Field(default=1.25, ge=1.0)
        load_slack: float = Field(default=2.0, ge=0.0)
        decay: float = Field(default=0.0, ge=0.0, lt=1.0)
        redis_url: SecretStr | None = None
        ttl_s: float = Field(default=600.0, gt=0.0)
        redis_timeout_s: float = Field(default=0.25, gt=0.0)
        redis_retry_s: float = Field(default=5.0, ge=0.0)
        key_prefix: str = Field(default="kvgate:session:", min_length=1)
        max_pending_writes: int = Field(default=1024, ge=1)

        @field_validator("headers")
        @classmethod
        def _header_names(cls, value: tuple[str, ...]) -> tuple[str, ...]:
            names = tuple(v.strip().lower() for v in value)
            for name in names:
                if not _HEADER_NAME.fullmatch(name):
                    raise ValueError(f"{name!r} is not a valid header name")
            if len(set(names)) != len(names):
                raise ValueError("header names must be unique")
            return names

    def __init__(self, name: str, params: BaseModel, plugins: PluginLookup) -> None:
        super().__init__(name, params, plugins)
        assert isinstance(params, SessionAffinityScorer.Params)
        self.p = params
        if params.redis_url is not None and find_spec("redis") is None:
            raise ConfigError("redis_url needs the 'redis' package (pip install 'kvgate[redis]')")
        self.stats = SessionStats()
        self.table: SessionTable | None = None
        self._session: StateKey[SessionInfo] = StateKey(f"{name}/session")
        self._pinned: StateKey[EndpointId] = StateKey(f"{name}/pinned")

    # RequestHook
    async def on_request(self, req: InferenceRequest, state: CycleState) -> None:
        found = find_session(req.headers, self.p.headers)
        if found is None:
            return
        header, value = found
        try:
            check_session_value(header, value, self.p.max_length)
        except BadRequest:
            self.stats.rejected += 1
            raise
        info = SessionInfo(header, value, req.tenant, session_key(req.tenant, req.model, value))
        self.stats.sessions += 1
        state.put(self._session, info)
        state.put(SESSION_KEY, info.key)
        if self.p.echo:
            add_response_header(state, header, value)

    # DataProducer
    async def prepare(
        self, req: InferenceRequest, state: CycleState, eps: Sequence[Endpoint]
    ) -> None:
        info = state.get(self._session)
        if info is None:
            return
        if info.tenant != req.tenant:  # an auth hook declared after this plugin set it
            info = SessionInfo(
                info.header, info.value, req.tenant, session_key(req.tenant, req.model, info.value)
            )
            state.put(self._session, info)
            state.put(SESSION_KEY, info.key)
        if self.table is None:
            return
        pinned = await self.table.get(info.key)
        if pinned is not None:
            state.put(self._pinned, pinned)
            state.put(SESSION_PIN, pinned)

    # Scorer
    def score(
        self, req: InferenceRequest, state: CycleState, eps: Sequence[Endpoint]
    ) -> Mapping[EndpointId, float]:
        info = state.get(self._session)
        if info is None or not eps:
            return {}
        bound = load_bound(eps, self.p.load_factor, self.p.load_slack)
        ranked = preference(hrw_order(info.key, eps), bound, state.get(self._pinned))
        if not ranked:
            return {}
        scores = {ranked[0].id: 1.0}
        if self.p.decay > 0.0:
            for k, ep in enumerate(ranked[1:], start=1):
                scores[ep.id] = self.p.decay**k
        return scores

    # DispatchHook
    async def before_dispatch(
        self, req: InferenceRequest, state: CycleState, decision: RoutingDecision
    ) -> None:
        info = state.get(self._session)
        if info is None:
            return
        pinned = state.get(self._pinned)
        add_log_field(state, "affinity", "new" if pinned is None else
                      "kept" if pinned == decision.target.id else "moved")
        if self.table is not None:
            self.table.put_later(info.key, decision.target.id)

    # Lifecycle
    async def start(self) -> None:
        if self.p.redis_url is None or self.table is not None:
            return
        self.table = SessionTable(
            connect_table(self.p.redis_url.get_secret_value(), self.p.redis_timeout_s),
            prefix=self.p.key_prefix, ttl_s=self.p.ttl_s, timeout_s=self.p.redis_timeout_s,
            retry_s=self.p.redis_retry_s, max_pending=self.p.max_pending_writes,
            stats=self.stats,
        )

    async def stop(self) -> None:
        table, self.table = self.table, None
        if table is not None:
            await table.close()

    # HealthSource, MetricsSource
    def health(self) -> Mapping[str, object]:
        if self.table is None:
            return {}
        return {"session_table": "degraded: Redis unavailable, rendezvous hashing and "
                "per-replica pins" if self.table.down else "ok"}

    def collector(self) -> Collector:
        return _SessionCollector(self)


class _SessionCollector(Collector):
    def __init__(self, scorer: SessionAffinityScorer) -> None:
        self._s = scorer

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        st = self._s.stats
        table = CounterMetricFamily("kvgate_session_table_calls",
                                    "Shared session table (Redis) calls by outcome",
                                    labels=["outcome"])
        for outcome in ("hits", "misses", "errors", "skipped", "writes"):
            table.add_metric([outcome], getattr(st, f"table_{outcome}"))
        yield table
        yield CounterMetricFamily("kvgate_session_rejected", "Invalid session header values",
                                  value=st.rejected)
        down = self._s.table is not None and self._s.table.down
        yield GaugeMetricFamily("kvgate_session_table_down",
                                "1 while the shared session table (Redis) is unavailable",
                                value=int(down))
