"""In-flight token load shared between gateway replicas through Redis (``token-load-scorer``
with ``redis_url``).

Each replica (a ``kvgate serve`` process: one per host, or one per ``--workers`` worker) keeps
its own :class:`kvgate.plugins.load.token_load.LoadTracker` exact and synchronous, and every
``interval_s`` a background task:

1. writes its per-engine totals as one JSON string ``<prefix>r:<replica id>`` with a TTL of
   ``ttl_s`` (``SET ... PX``) — and, when a plugin shares counters (:class:`CounterShare`:
   placement's cumulative inserted tokens per engine), those as ``<prefix>c:<replica id>``,
   and when it shares gauges (:class:`GaugeShare`: flow control's demand), those as
   ``<prefix>g:<replica id>`` — registers the id in the sorted set ``<prefix>replicas`` (score:
   the time in ms) and prunes ids older than ``ttl_s`` from it — one pipelined round trip;
2. reads the other replicas' strings (``MGET``; an expired replica reads as nothing) and sums
   them into :attr:`LoadExchange.remote`, a per-engine :class:`EngineLoad` snapshot; the
   counters' growth since the previous round and the gauges' sums over the other replicas
   are handed to the sharing plugin (the gauges' as ``{}`` when Redis fails).

The scorers read ``local + remote`` synchronously: no Redis I/O on the scheduling path. The
snapshot is at most ``interval_s`` + one round trip old; a replica that dies stops counting
after ``ttl_s`` (its string expires in Redis).

Redis down (a call fails or exceeds ``timeout_s``): the snapshot is dropped at once (stale
loads of other replicas would be worse than none: they never drain), each replica routes on its
own in-flight load, a WARNING is logged once per outage, ``/health`` and ``/metrics`` say so,
and Redis is tried again every ``interval_s``. Requests never wait for Redis.

Bounded state: the snapshot holds one entry per engine; at most ``max_replicas`` other replicas
are read per round (the most recently registered first; the rest are counted as ``skipped``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvgate.middleware.framework.tasks import cancel_and_wait
from kvgate.middleware.framework.types import EndpointId
from kvgate.plugins.common.redis_retry import redis_errors, stale_connection_retry
from kvgate.plugins.load.loads import EngineLoad

log = logging.getLogger("kvgate.plugins.shared_load")


class RedisLoadClient(Protocol):
    """What :class:`LoadExchange` needs of ``redis.asyncio.Redis``."""

    def pipeline(self, transaction: bool = ...) -> Any: ...

    def mget(self, keys: list[str]) -> Awaitable[list[Any]]: ...

    def delete(self, *names: str) -> Awaitable[Any]: ...

    def aclose(self) -> Awaitable[None]: ...


def replica_id() -> str:
    """host:pid:random — unique per process, readable in Redis by an operator."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


def encode_loads(loads: Mapping[EndpointId, EngineLoad]) -> str:
    """``{"engine": [prefill, decode, requests], ...}``."""
    return json.dumps({ep: [ld.prefill_tokens, ld.decode_tokens, ld.requests]
                       for ep, ld in loads.items()}, separators=(",", ":"))


def merge_loads(raws: list[Any]) -> dict[EndpointId, EngineLoad]:
    """Sum the replicas' published loads per engine (malformed or missing entries skipped)."""
    total: dict[EndpointId, list[int]] = {}
    for raw in raws:
        if raw is None:
            continue
        try:
            doc = json.loads(raw)
        except ValueError:
            continue
        if not isinstance(doc, dict):
            continue
        for ep, vals in doc.items():
            if (isinstance(vals, list) and len(vals) == 3
                    and all(type(v) is int and v >= 0 for v in vals)):
                acc = total.setdefault(str(ep), [0, 0, 0])
                for i in range(3):
                    acc[i] += vals[i]
    return {ep: EngineLoad(*v) for ep, v in total.items()}


def parse_counters(raw: Any) -> dict[str, float] | None:
    """``{"engine": cumulative value}`` as published, or None when missing or malformed (a
    value that is not a finite number ≥ 0 is skipped: JSON's ``Infinity`` parses)."""
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(doc, dict):
        return None
    return {str(k): float(v) for k, v in doc.items()
            if type(v) in (int, float) and 0 <= v < math.inf}


@dataclass(frozen=True, slots=True)
class CounterShare:
    """Per-engine cumulative counters shared the same way (placement's inserted tokens):
    ``local()`` is this replica's, ``remote(deltas)`` receives the others' growth each round."""

    local: Callable[[], Mapping[EndpointId, float]]
    remote: Callable[[Mapping[EndpointId, float]], None]


@dataclass(frozen=True, slots=True)
class GaugeShare:
    """Named current values shared the same way (flow control's queued demand): ``local()`` is
    this replica's, ``remote(sums)`` receives the sum over the other replicas read each round
    (``{}`` when the round failed: the others' view is dropped, as the loads are)."""

    local: Callable[[], Mapping[str, float]]
    remote: Callable[[Mapping[str, float]], None]


def sum_gauges(raws: list[Any]) -> dict[str, float]:
    """The replicas' published gauges summed per name (missing or malformed entries skipped)."""
    total: dict[str, float] = {}
    for raw in raws:
        for name, value in (parse_counters(raw) or {}).items():
            total[name] = total.get(name, 0.0) + value
    return total


@dataclass(slots=True)
class ExchangeStats:
    """Rounds done and failed, replicas seen in the last round, replicas not read (cap)."""

    rounds: int = 0
    errors: int = 0
    replicas: int = 0
    skipped: int = 0
    down: bool = False


class LoadExchange:
    """Publishes this replica's load and reads the others' (module docstring)."""

    def __init__(
        self, client: RedisLoadClient, local: Callable[[], Mapping[EndpointId, EngineLoad]], *,
        prefix: str, interval_s: float, ttl_s: float, timeout_s: float, max_replicas: int,
        me: str | None = None, clock: Callable[[], float] = time.time,
        counters: CounterShare | None = None, gauges: GaugeShare | None = None,
    ) -> None:
        self._client = client
        self._local = local
        self._prefix = prefix
        self.interval_s = interval_s
        self._ttl_ms = max(1, round(ttl_s * 1000))
        self._timeout_s = timeout_s
        self._max_replicas = max_replicas
        self.me = me or replica_id()
        self.clock = clock
        self.remote: dict[EndpointId, EngineLoad] = {}
        self.stats = ExchangeStats()
        self._errors = _redis_errors()
        self._task: asyncio.Task[None] | None = None
        self._counters = counters
        self._gauges = gauges
        #: per other replica, its counters as last read (deltas are taken against them)
        self._seen: dict[str, dict[str, float]] = {}

    def _key(self, replica: str, kind: str = "r") -> str:
        return f"{self._prefix}{kind}:{replica}"

    async def exchange(self) -> None:
        """One round: publish, then read the others (errors drop the snapshot)."""
        try:
            await asyncio.wait_for(self._round(), self._timeout_s)
        except self._errors as exc:
            self._failed(exc)
            return
        self.stats.rounds += 1
        if self.stats.down:
            self.stats.down = False
            log.warning("shared load: Redis reachable again; routing on every replica's load")

    async def _round(self) -> None:
        now_ms = int(self.clock() * 1000)
        registry = self._prefix + "replicas"
        pipe = self._client.pipeline(transaction=False)
        pipe.set(self._key(self.me), encode_loads(self._local()), px=self._ttl_ms)
        if self._counters is not None:
            pipe.set(self._key(self.me, "c"), json.dumps(dict(self._counters.local())),
                     px=self._ttl_ms)
        if self._gauges is not None:
            pipe.set(self._key(self.me, "g"), json.dumps(dict(self._gauges.local())),
                     px=self._ttl_ms)
        pipe.zadd(registry, {self.me: now_ms})
        pipe.pexpire(registry, self._ttl_ms * 10)
        pipe.zremrangebyscore(registry, "-inf", now_ms - self._ttl_ms)
        pipe.zrevrange(registry, 0, self._max_replicas)
        replies = await pipe.execute()
        members = [m.decode() if isinstance(m, bytes) else str(m) for m in replies[-1]]
        others = [m for m in members if m != self.me][: self._max_replicas]
        self.stats.skipped = max(0, len(members) - 1 - len(others))
        kinds = ["r"] + ["c"] * (self._counters is not None) + ["g"] * (self._gauges is not None)
        keys = [self._key(m, kind) for kind in kinds for m in others]
        raws = list(await self._client.mget(keys)) if keys else []
        parts = {kind: raws[i * len(others):(i + 1) * len(others)]
                 for i, kind in enumerate(kinds)}
        self.stats.replicas = sum(raw is not None for raw in parts["r"])
        self.remote = merge_loads(parts["r"])
        if self._counters is not None:
            self._share_counters(others, parts["c"], self._counters)
        if self._gauges is not None:
            self._gauges.remote(sum_gauges(parts["g"]))

    def _share_counters(self, others: list[str], raws: list[Any], share: CounterShare) -> None:
        """Hand the growth of the other replicas' counters since the last round to ``share``;
        a replica seen for the first time only sets its baseline."""
        deltas: dict[EndpointId, float] = {}
        seen: dict[str, dict[str, float]] = {}
        for replica, raw in zip(others, raws, strict=True):
            current = parse_counters(raw)
            if current is None:
                continue
            seen[replica] = current
            before = self._seen.get(replica)
            if before is None:
                continue
            for ep, value in current.items():
                grown = value - before.get(ep, 0.0)
                if grown > 0:
                    deltas[ep] = deltas.get(ep, 0.0) + grown
        self._seen = seen
        if deltas:
            share.remote(deltas)

    def _failed(self, exc: BaseException) -> None:
        self.stats.errors += 1
        self.remote = {}
        self.stats.replicas = 0
        if self._gauges is not None:
            self._gauges.remote({})
        if not self.stats.down:
            self.stats.down = True
            # The URL may hold a password: name the error type only.
            log.warning("shared load: Redis unavailable (%s); routing on this replica's own "
                        "in-flight load until it answers again", type(exc).__name__)

    async def run(self) -> None:
        """Exchange every ``interval_s`` until cancelled."""
        while True:
            await self.exchange()
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run())

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait(task)
        try:
            await asyncio.wait_for(
                self._client.delete(*(self._key(self.me, kind) for kind in "rcg")),
                self._timeout_s)
        except self._errors:
            log.info("shared load: could not remove this replica's entry (expires in Redis)")
        await self._client.aclose()

    def health(self) -> Mapping[str, object]:
        return {"shared_load": "degraded: Redis unavailable, per-replica load" if self.stats.down
                else "ok", "replica": self.me, "other_replicas": self.stats.replicas}


def _redis_errors() -> tuple[type[BaseException], ...]:
    return redis_errors()


def connect(url: str, timeout_s: float) -> RedisLoadClient:
    """A lazily connecting Redis client that does not retry (the next round is the retry)."""
    from redis.asyncio import Redis

    client: RedisLoadClient = Redis.from_url(
        url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
        retry=stale_connection_retry(),
    )
    return client


class LoadCollector(Collector):
    """``kvgate_token_load_tokens{engine,kind,scope}``: in-flight prefill/decode tokens, this
    replica's (``local``) and the other replicas' last published (``other``); the exchange's
    rounds, errors, replicas seen and whether Redis is down."""

    def __init__(
        self, local: Callable[[], Mapping[EndpointId, EngineLoad]],
        shared: Callable[[], LoadExchange | None],
    ) -> None:
        self._local = local
        self._shared = shared

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        tokens = GaugeMetricFamily(
            "kvgate_token_load_tokens", "In-flight tokens per engine (scope local: this "
            "replica; other: the other replicas, shared through Redis)",
            labels=["engine", "kind", "scope"])
        shared = self._shared()
        views = [("local", self._local())]
        if shared is not None:
            views.append(("other", shared.remote))
        for scope, loads in views:
            for ep, ld in sorted(loads.items()):
                tokens.add_metric([ep, "prefill", scope], ld.prefill_tokens)
                tokens.add_metric([ep, "decode", scope], ld.decode_tokens)
        yield tokens
        if shared is None:
            return
        st = shared.stats
        yield CounterMetricFamily("kvgate_shared_load_rounds", "Load exchanges with Redis done",
                                  value=st.rounds)
        yield CounterMetricFamily("kvgate_shared_load_errors",
                                  "Load exchanges with Redis failed", value=st.errors)
        yield GaugeMetricFamily("kvgate_shared_load_replicas",
                                "Other replicas whose load was read last round",
                                value=st.replicas)
        yield GaugeMetricFamily("kvgate_shared_load_down",
                                "1 while Redis is unavailable (per-replica load only)",
                                value=int(st.down))
