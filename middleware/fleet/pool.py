"""The engine pool: endpoints, health probing, metrics scraping, in-flight counters.

Per-request code gets an immutable snapshot (:meth:`EndpointPool.snapshot`), rebuilt lazily only
after something changed. In-flight counters are taken with :meth:`acquire` and released through
the returned :class:`Lease` on every outcome (release is idempotent).
Bounded: one record per configured engine; nothing else is kept.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import aiohttp

from kvgate.middleware.fleet.breaker import STATE_VALUE, Breaker, BreakerState
from kvgate.middleware.framework.composition.config import EngineConfig, PoolConfig
from kvgate.middleware.framework.engine import EngineAdapter
from kvgate.middleware.framework.errors import ConfigError
from kvgate.middleware.framework.plugin import EndpointSetListener
from kvgate.middleware.framework.tasks import cancel_and_wait
from kvgate.middleware.framework.types import Endpoint, EndpointId, EngineMetrics

if TYPE_CHECKING:
    from kvgate.middleware.serving.context import RequestContext

log = logging.getLogger("kvgate.pool")


class _Engine:
    """Mutable live state of one engine; only the pool touches it."""

    __slots__ = (
        "adapter", "breaker", "config", "confirmed", "endpoint", "failures", "headers", "healthy",
        "in_flight_requests", "in_flight_tokens", "last_error", "metrics", "models",
    )

    def __init__(self, config: EngineConfig, adapter: EngineAdapter, breaker: Breaker) -> None:
        self.config = config
        self.adapter = adapter
        #: The probes' verdict: optimistic until ``unhealthy_after`` probes in a row failed.
        self.healthy = True
        #: A probe has succeeded at least once (readiness: ``GET /health`` answers 200 only then).
        self.confirmed = False
        self.breaker = breaker
        self.models: frozenset[str] = frozenset(config.models)
        self.metrics = EngineMetrics()
        self.in_flight_requests = 0
        self.in_flight_tokens = 0
        self.failures = 0
        self.last_error: str | None = None
        self.headers = _auth_headers(config)
        #: The last snapshot of this engine; None once something in it changed (the pool
        #: clears it where it marks its own snapshot dirty).
        self.endpoint: Endpoint | None = None

    def snapshot(self) -> Endpoint:
        """The engine as scheduling sees it: the last snapshot unless it changed since. A
        request changes only the engine it went to, so a fleet of N engines rebuilds one
        ``Endpoint`` per change, not N."""
        ep = self.endpoint
        if ep is None:
            c = self.config
            ep = self.endpoint = Endpoint(
                id=c.name, url=c.url, kind=c.kind, role=c.role, models=self.models,
                healthy=self.healthy and self.breaker.allows(),
                in_flight_requests=self.in_flight_requests,
                in_flight_tokens=self.in_flight_tokens, metrics=self.metrics, labels=c.labels,
                kv_events=c.kv_events, kv_events_replay=c.kv_events_replay,
            )
        return ep


def _auth_headers(config: EngineConfig) -> dict[str, str]:
    if config.api_key_env is None:
        return {}
    key = os.environ.get(config.api_key_env)
    if not key:
        raise ConfigError(
            f"engine {config.name!r}: environment variable {config.api_key_env} is not set"
        )
    return {"Authorization": f"Bearer {key}"}


class Lease:
    """An acquired in-flight slot on one engine. ``release()`` is idempotent."""

    __slots__ = ("_engine", "_pool", "_tokens", "endpoint_id")

    def __init__(self, pool: EndpointPool, engine: _Engine, tokens: int) -> None:
        self._pool = pool
        self._engine: _Engine | None = engine
        self._tokens = tokens
        self.endpoint_id = engine.config.name

    def release(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.in_flight_requests -= 1
            engine.in_flight_tokens -= self._tokens
            engine.breaker.on_release()
            self._pool.changed(engine)


class EndpointPool:
    """Owns engine state; its probe loop is started and stopped by the app's lifespan."""

    def __init__(
        self,
        engines: Sequence[EngineConfig],
        adapters: Mapping[str, EngineAdapter],
        config: PoolConfig,
        listeners: Sequence[EndpointSetListener] = (),
    ) -> None:
        self.config = config
        self._engines = {
            e.name: _Engine(e, adapters[e.kind], Breaker(config.breaker_failures)) for e in engines
        }
        #: Breaker transitions by (engine, new state): bounded by engines x 3 states.
        self.transitions: dict[tuple[str, str], int] = {}
        self._listeners = tuple(listeners)
        self._snapshot: tuple[Endpoint, ...] = ()
        self._dirty = True
        self._models: frozenset[str] | None = None
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._last_metrics = 0.0

    # -- request path -------------------------------------------------------------------
    def snapshot(self) -> tuple[Endpoint, ...]:
        if self._dirty:
            self._snapshot = tuple(e.snapshot() for e in self._engines.values())
            self._dirty = False
        return self._snapshot

    def adapter(self, endpoint_id: EndpointId) -> EngineAdapter:
        return self._engines[endpoint_id].adapter

    def headers(self, endpoint_id: EndpointId) -> Mapping[str, str]:
        return self._engines[endpoint_id].headers

    def acquire(self, endpoint_id: EndpointId, tokens: int) -> Lease:
        engine = self._engines[endpoint_id]
        engine.in_flight_requests += 1
        engine.in_flight_tokens += tokens
        engine.breaker.on_dispatch()
        self.changed(engine)
        return Lease(self, engine, tokens)

    def report_failure(self, endpoint_id: EndpointId, reason: str) -> None:
        """A request could not reach the engine: its breaker opens at once (out of rotation
        until a probe succeeds, then one trial request)."""
        engine = self._engines[endpoint_id]
        engine.last_error = reason
        self._breaker_moved(engine, engine.breaker.trip(), reason)

    def report_outcome(self, endpoint_id: EndpointId, error: str | None) -> None:
        """A request's verdict on the engine (``error`` None: it served): feeds its breaker."""
        engine = self._engines.get(endpoint_id)
        if engine is None:
            return
        if error is None:
            breaker = engine.breaker
            if breaker.state is BreakerState.CLOSED and not breaker.failures:
                return  # the common case, nothing to change: the snapshot stays valid
            self._breaker_moved(engine, breaker.on_success(), "a request succeeded")
            return
        engine.last_error = error
        moved = engine.breaker.on_failure()
        self._breaker_moved(engine, moved, f"{engine.breaker.threshold} request failures in a "
                            f"row, the last: {error}" if moved is BreakerState.OPEN else error)

    def suspect(self, ctx: RequestContext, endpoint_id: EndpointId, reason: str) -> None:
        """The request failed on the engine by what looks like the engine's fault (a 5xx, a
        timeout, an answer broken before it began). The verdict waits for the request's retry
        (:meth:`settle`): a request that fails so on a second engine as well is its own fault
        (an input that makes every engine fail), and neither engine's breaker counts it, so one
        client cannot take engines out of rotation for every tenant (docs/security.md)."""
        if ctx.suspect is None and not ctx.request_fault:
            ctx.suspect = (endpoint_id, reason)
            return
        first = ctx.suspect[0] if ctx.suspect is not None else "another engine"
        ctx.suspect, ctx.request_fault = None, True
        log.warning("request %s failed on %s and %s alike (%s): the request's fault, counted "
                    "against neither engine's circuit breaker", ctx.request_id, first,
                    endpoint_id, reason)

    def settle(self, ctx: RequestContext) -> None:
        """Count the failure :meth:`suspect` holds: another engine served the request, or it
        was not tried on another (no other engine, no retry left, not retryable)."""
        suspect, ctx.suspect = ctx.suspect, None
        if suspect is not None:
            self.report_outcome(*suspect)

    def changed(self, engine: _Engine) -> None:
        """Something scheduling sees of ``engine`` changed: its next snapshot is rebuilt."""
        engine.endpoint = None
        self._dirty = True

    def _breaker_moved(self, engine: _Engine, to: BreakerState | None, why: str) -> None:
        self.changed(engine)
        if to is None:
            return
        name = engine.config.name
        key = (name, to.value)
        self.transitions[key] = self.transitions.get(key, 0) + 1
        log.warning("engine %s: circuit breaker %s (%s)", name, to.value, why)

    def breaker_states(self) -> dict[str, float]:
        """``kvgate_engine_breaker_state`` values by engine (breaker.STATE_VALUE)."""
        return {n: STATE_VALUE[e.breaker.state] for n, e in self._engines.items()}

    def ready(self) -> bool:
        """Some engine is in rotation and a probe has confirmed it (readiness)."""
        return any(e.confirmed and e.healthy and e.breaker.state is not BreakerState.OPEN
                   for e in self._engines.values())

    def models(self) -> frozenset[str]:
        """Every model some engine serves (read twice per request: kept until discovery
        changes an engine's models)."""
        if self._models is None:
            out: set[str] = set()
            for engine in self._engines.values():
                out |= engine.models
            self._models = frozenset(out)
        return self._models

    # -- lifecycle ----------------------------------------------------------------------
    async def start(self, session: aiohttp.ClientSession) -> None:
        self._session = session
        eps = self.snapshot()
        for listener in self._listeners:
            listener.on_endpoints_changed(eps, ())
        if self.config.startup_probe_timeout_s > 0 and self._engines:
            try:
                await asyncio.wait_for(self.probe_all(), self.config.startup_probe_timeout_s)
            except TimeoutError:
                log.warning("first engine probe round did not finish in time; serving anyway")
        self._task = asyncio.create_task(self._run(), name="kvgate-pool-probe")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None

    async def _run(self) -> None:
        interval = min(self.config.health_interval_s, self.config.metrics_interval_s)
        while True:
            await asyncio.sleep(interval)
            await self.probe_all()

    async def probe_all(self) -> None:
        now = time.monotonic()
        scrape = now - self._last_metrics >= self.config.metrics_interval_s
        if scrape:
            self._last_metrics = now
        await asyncio.gather(*(self._probe(e, scrape) for e in self._engines.values()))
        for engine in self._engines.values():  # health, models, scraped metrics
            self.changed(engine)

    # -- probing ------------------------------------------------------------------------
    async def _get(self, engine: _Engine, path: str) -> tuple[int, bytes]:
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)
        async with self._session.get(
            engine.config.url + path, headers=engine.headers, timeout=timeout
        ) as resp:
            return resp.status, await resp.read()

    async def _probe(self, engine: _Engine, scrape: bool) -> None:
        try:
            status, _ = await self._get(engine, engine.adapter.health_path)
            ok = status == 200
            reason = f"health answered {status}"
            if ok and not engine.config.models and engine.adapter.models_path:
                await self._discover_models(engine)
            if ok and scrape and engine.adapter.metrics_path:
                await self._scrape(engine)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            ok, reason = False, f"{type(exc).__name__}: {exc}"
        self._record_probe(engine, ok, reason)

    def _record_probe(self, engine: _Engine, ok: bool, reason: str) -> None:
        if ok:
            if not engine.healthy:
                log.info("engine %s is healthy again", engine.config.name)
            engine.healthy, engine.failures, engine.confirmed = True, 0, True
            if engine.breaker.state is BreakerState.CLOSED:
                engine.last_error = None
            self._breaker_moved(engine, engine.breaker.on_probe_ok(), "a health probe passed")
            return
        engine.failures += 1
        engine.last_error = reason
        if engine.healthy and engine.failures >= self.config.unhealthy_after:
            log.warning("engine %s marked unhealthy: %s", engine.config.name, reason)
            engine.healthy = False

    async def _discover_models(self, engine: _Engine) -> None:
        assert engine.adapter.models_path is not None
        status, body = await self._get(engine, engine.adapter.models_path)
        if status == 200:
            payload: Any = json.loads(body)
            if isinstance(payload, dict):
                engine.models = engine.adapter.parse_models(payload)
                self._models = None
                self.changed(engine)  # the snapshot's Endpoint.models too

    async def _scrape(self, engine: _Engine) -> None:
        assert engine.adapter.metrics_path is not None
        status, body = await self._get(engine, engine.adapter.metrics_path)
        if status == 200:
            text = body.decode("utf-8", errors="replace")
            engine.metrics = engine.adapter.parse_metrics(text, time.monotonic())

    def status(self) -> list[dict[str, Any]]:
        """Per-engine state for ``GET /health`` and operators (no secrets)."""
        return [
            {
                "name": e.config.name, "url": e.config.url, "role": e.config.role.value,
                "healthy": e.healthy and e.breaker.state is not BreakerState.OPEN,
                "confirmed": e.confirmed, "breaker": e.breaker.state.value,
                "models": sorted(e.models),
                "in_flight_requests": e.in_flight_requests, "last_error": e.last_error,
            }
            for e in self._engines.values()
        ]
