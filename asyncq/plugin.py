"""``async-queue``: the durable queue for work that need not be answered now -- OpenAI Batch
(asyncq/batch/mgmt.py), queued single requests (asyncq/queued.py) and background responses
(asyncq/background.py) -- pulled while the fleet has headroom (asyncq/runner.py). docs/async.md.

It is the :class:`QueueService` of the management plane, and plugs into the core through its
generic extension points: a Lifecycle (store, runner, reaper, management plane), AsgiMount
(the FastAPI management app at ``/v1/files``, ``/v1/batches``, ``/v1/queue``,
``/openapi.json``), RequestDeferral (queue header, ``background: true``), StateResolver
(``GET /v1/responses/{id}`` of a background job), NeedsLoopback (jobs run through the
gateway's own request path), MetricsSource and HealthSource.

Memory: the runner's window (at most ``window`` jobs) and the jobs in flight (at most
``max_concurrency``); listeners are registered once at startup. Everything else is in the store.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import orjson
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvgate.asyncq.api import (
    Job,
    JobListener,
    JobSpec,
    JobState,
    JobStore,
    QueueUnavailable,
)
from kvgate.asyncq.background import background_spec, response_object, wants_background
from kvgate.asyncq.headroom import HeadroomParams
from kvgate.asyncq.metrics import QueueMetrics
from kvgate.asyncq.ordering import prefix_key
from kvgate.asyncq.queued import accepted, owned, queue_options, queued_spec, wants_queue
from kvgate.asyncq.runner import Runner, RunnerSettings
from kvgate.middleware.framework.errors import ConfigError
from kvgate.middleware.framework.plugin import (
    AsgiApp,
    AsgiMount,
    Deferred,
    HealthSource,
    HttpResponse,
    Lifecycle,
    LoopbackCaller,
    MetricsSource,
    NeedsLoopback,
    Plugin,
    PluginLookup,
    RequestDeferral,
    StateResolver,
)
from kvgate.middleware.framework.types import InferenceRequest, Principal

log = logging.getLogger("kvgate.asyncq")
#: Paths of the management app (asyncq/batch/mgmt.py).
MOUNTS = ("/v1/files", "/v1/batches", "/v1/queue", "/openapi.json")


def _default_backend() -> str:
    return f"sqlite://{Path('.kvgate/jobs.sqlite').resolve()}"


def open_store(url: str, retention_s: float, max_jobs: int) -> JobStore:
    """The store for a backend URL (``sqlite:///path`` or ``redis://...``), ConfigError else."""
    if url.startswith("sqlite://"):
        from kvgate.asyncq.store.sqlite_store import SqliteJobStore
        path = url[len("sqlite://"):]
        if not path.startswith("/"):
            raise ConfigError(f"backend {url!r}: use sqlite:///absolute/path")
        return SqliteJobStore(path, retention_s=retention_s, max_jobs=max_jobs)
    if url.startswith(("redis://", "rediss://")):
        from kvgate.asyncq.store.redis_store import RedisJobStore
        return RedisJobStore(url, retention_s=retention_s, max_jobs=max_jobs)
    raise ConfigError(f"backend {url!r}: expected sqlite:///path or redis://host:port/db")


class AsyncQueue(Plugin, Lifecycle, AsgiMount, RequestDeferral, StateResolver, NeedsLoopback,
                 MetricsSource, HealthSource):
    """See the module docstring and docs/async.md."""

    type_name: ClassVar[str] = "async-queue"

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)
        #: ``sqlite:///absolute/path`` (embedded default) or ``redis://host:port/db``.
        backend: str = Field(default_factory=_default_backend)
        #: This replica's consumer name (lease owner); default ``host-pid-random``.
        consumer: str | None = Field(None, min_length=1, max_length=128)
        #: Jobs run at once by this replica (requests).
        max_concurrency: int = Field(8, ge=1, le=4096)
        #: A running job's lease (s): a replica that dies holding it loses it after this long
        #: and the job runs again elsewhere. 300 s: past any single generation's length.
        lease_s: float = Field(300.0, gt=0)
        #: Runs of one job before a 5xx/429 answer is final.
        max_attempts: int = Field(3, ge=1, le=20)
        #: Jobs claimed at once and ordered for the cache (asyncq/ordering.py).
        window: int = Field(256, ge=1, le=10_000)
        poll_interval_s: float = Field(0.05, gt=0)
        reap_interval_s: float = Field(1.0, gt=0)
        #: Retry backoff: ``backoff_s * 2**(attempt-1)``, at most ``backoff_max_s`` (s).
        backoff_s: float = Field(1.0, ge=0)
        backoff_max_s: float = Field(60.0, ge=0)
        headroom: HeadroomParams = Field(default_factory=HeadroomParams)
        #: Accept ``x-kvgate-queue: true`` on API routes.
        queued: bool = True
        #: Queue ``POST /v1/responses`` with ``background: true``.
        background: bool = True
        #: Default deadline of queued requests and background responses (s): 24 h.
        queued_deadline_s: float = Field(86400.0, gt=0)
        background_deadline_s: float = Field(86400.0, gt=0)
        #: Terminal jobs kept this long (s): 30 days.
        retention_s: float = Field(30 * 86400.0, gt=0)
        #: Unfinished jobs the store holds at most (a submit past it is a 429).
        max_jobs: int = Field(1_000_000, ge=1)
        #: The management plane (Files, Batches, webhooks: asyncq/batch/mgmt.py's
        #: ManagementSettings); null: not mounted.
        management: dict[str, Any] | None = Field(default_factory=dict)

    example_params = {"backend": "sqlite:///tmp/kvgate-example-jobs.sqlite",
                      "management": None}

    def __init__(self, name: str, params: BaseModel, plugins: PluginLookup) -> None:
        super().__init__(name, params, plugins)
        assert isinstance(params, AsyncQueue.Params)
        self.p = params
        self.store = open_store(params.backend, params.retention_s, params.max_jobs)
        self.consumer = params.consumer or (
            f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}")
        self.metrics = QueueMetrics()
        self.service = Queue(self.store, self.metrics)
        self.loopback: LoopbackCaller | None = None
        self.runner: Runner | None = None
        self.app: AsgiApp | None = None
        self._plane: Any = None
        if params.management is not None:
            self._build_management(params.management)

    def _build_management(self, section: Mapping[str, Any]) -> None:
        from kvgate.asyncq.batch.mgmt import ManagementSettings, build_management_app, plane_of
        try:
            settings = ManagementSettings.model_validate(section)
        except ValidationError as exc:
            detail = "; ".join(f"management.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
                               for e in exc.errors())
            raise ConfigError(f"bad params: {detail}") from None
        app = build_management_app(self.service, settings)
        self.app = app
        self._plane = plane_of(app)

    # -- core hooks ----------------------------------------------------------------------
    def bind_loopback(self, loopback: LoopbackCaller) -> None:
        self.loopback = loopback
        self.service.loopback = loopback

    def mounts(self) -> Sequence[tuple[str, AsgiApp]]:
        app = self.app
        return [] if app is None else [(prefix, app) for prefix in MOUNTS]

    async def start(self) -> None:
        if self.loopback is None:
            raise ConfigError("async-queue: no loopback was bound (the app binds it)")
        await self.store.open()
        s = self.p
        settings = RunnerSettings(
            consumer=self.consumer, max_concurrency=s.max_concurrency, lease_s=s.lease_s,
            max_attempts=s.max_attempts, window=s.window, poll_interval_s=s.poll_interval_s,
            reap_interval_s=s.reap_interval_s, backoff_s=s.backoff_s,
            backoff_max_s=s.backoff_max_s, headroom=s.headroom)
        if self._plane is not None:
            await self._plane.start()
        self.runner = Runner(self.store, self.loopback, settings, self.metrics,
                             self.service.listeners)
        self.service.runner = self.runner
        self.runner.start()
        log.info("async-queue: %s store, consumer %s, up to %d jobs at once",
                 getattr(self.store, "backend", "?"), self.consumer, s.max_concurrency)

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.stop()
            self.runner = self.service.runner = None
        if self._plane is not None:
            await self._plane.stop()
        await self.store.close()

    async def defer(self, req: InferenceRequest, adapter_name: str,
                    path: str) -> Deferred | None:
        if req.service_tier is not None:  # a job's own run
            return None
        now = time.time()
        if self.p.background and wants_background(req, adapter_name):
            spec = background_spec(req, path, prefix_key(path, req.body),
                                   self.p.background_deadline_s, now)
            await self.service.submit([spec])
            job = Job(spec, JobState.QUEUED, 0, None, None, None)
            return Deferred(200, orjson.dumps(response_object(job)))
        if self.p.queued and wants_queue(req.headers):
            priority, deadline_s = queue_options(req.headers, self.p.queued_deadline_s)
            spec = queued_spec(req, path, prefix_key(path, req.body), priority,
                               deadline_s, now)
            await self.service.submit([spec])
            return Deferred(202, accepted(spec),
                            {"location": f"/v1/queue/requests/{spec.id}"})
        return None

    async def resolve(self, adapter_name: str, method: str, state_id: str,
                      principal: Principal | None) -> HttpResponse | None:
        if adapter_name != "responses" or not state_id.startswith("resp_"):
            return None
        job = owned(await self.store.get(state_id), principal, "background")
        if job is None:
            return None
        if method == "POST":
            job = await self.service.cancel(state_id) or job
        return HttpResponse(200, orjson.dumps(response_object(job)))

    # -- observability -------------------------------------------------------------------
    def collector(self) -> Collector:
        return _Collectors(self.metrics, None if self._plane is None
                           else self._plane.collector())

    def health(self) -> Mapping[str, object]:
        out: dict[str, object] = {**self.store.health(), "consumer": self.consumer,
                                  "running_here": self.metrics.running_here,
                                  "headroom_open": self.metrics.gate_open}
        outage = None if self.runner is None else self.runner.outage_since
        if outage is not None:
            out["ok"] = False
            out["unavailable_since"] = outage
        if self._plane is not None:
            out["management"] = dict(self._plane.health())
        return out


class Queue:
    """The :class:`~kvgate.asyncq.api.QueueService` the management plane and the plugin's own hooks
    use: the store, the runner to wake, the listeners (a separate object from the plugin, so
    its ``authenticate`` is not taken for an Authenticator plugin's)."""

    def __init__(self, store: JobStore, metrics: QueueMetrics) -> None:
        self.store = store
        self.metrics = metrics
        self.listeners: list[JobListener] = []
        self.loopback: LoopbackCaller | None = None
        self.runner: Runner | None = None

    async def submit(self, specs: Sequence[JobSpec]) -> int:
        try:
            new = await self.store.enqueue(specs)
        except QueueUnavailable:
            self.metrics.store_up = False
            raise
        if self.runner is not None:
            self.runner.wake()
        for spec in specs:
            if spec.kind != "batch":  # a batch's own bookkeeping knows its lines
                await self._notify(Job(spec, JobState.QUEUED, 0, None, None, None))
        return new

    async def get(self, job_id: str) -> Job | None:
        return await self.store.get(job_id)

    async def cancel(self, job_id: str) -> Job | None:
        job = await self.store.cancel(job_id, time.time())
        if job is not None and job.state is JobState.CANCELLED:
            self.metrics.finished.labels(job.spec.kind, "cancelled").inc()
            await self._notify(job)
        return job

    async def cancel_batch(self, batch_id: str) -> int:
        return await self.store.cancel_batch(batch_id, time.time())

    async def batch_counts(self, batch_id: str) -> Mapping[JobState, int]:
        return await self.store.batch_counts(batch_id)

    async def batch_jobs(self, batch_id: str) -> Sequence[Job]:
        return await self.store.batch_jobs(batch_id)

    def add_listener(self, listener: JobListener) -> None:
        self.listeners.append(listener)

    def authenticate(self, headers: Mapping[str, str]) -> Principal | None:
        if self.loopback is None:
            return None
        return self.loopback.authenticate(headers)

    def prefix_key(self, path: str, body: Mapping[str, Any]) -> str:
        return prefix_key(path, body)

    async def _notify(self, job: Job) -> None:
        for listener in self.listeners:
            try:
                await listener.on_job(job)
            except Exception:  # one listener's bug must not fail a submit
                log.exception("job listener %r failed on job %s", listener, job.spec.id)


class _Collectors(Collector):
    def __init__(self, *parts: Collector | None) -> None:
        self._parts = [p for p in parts if p is not None]

    def collect(self) -> Iterator[Metric]:
        for part in self._parts:
            yield from part.collect()


__all__ = ["MOUNTS", "AsyncQueue", "Queue", "open_store"]
