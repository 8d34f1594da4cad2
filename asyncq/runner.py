"""The runner: pulls queued jobs while the fleet has headroom and runs them through the
gateway's own request path (middleware/framework/loopback.py).

Loop (one per replica; ``poll_interval_s`` between rounds when idle):

1. every ``reap_interval_s``: ``store.reap`` -- lapsed leases back to the queue (a dead
   replica's jobs), queued jobs past their deadline EXPIRED (listeners told);
2. while fewer than ``max_concurrency`` jobs run here and the headroom gate
   (asyncq/headroom.py) is open: take the next job from the window, claiming a new window of
   ``window`` jobs when it is empty (ordered for the cache, asyncq/ordering.py). The window
   is claimed only when a job can start; claimed jobs go back to the queue when the gate has
   stayed closed ``hold_window_s`` (live traffic), so other replicas may take them;
3. leases of the jobs held here are renewed every ``lease_s / 3``.

A job runs with ``tier = kind`` and request id = job id (the ledger upserts by request id: a
job run twice after a crash is billed once), its body forced non-streaming (``stream`` and
``background`` removed), as its submitter's principal looked up again by key id. The answer:
2xx SUCCEEDED; 4xx FAILED with the engine's error body kept (the client's problem, retrying
gives the same answer); 5xx or 429 retried after ``backoff_s * 2**(attempt-1)`` (at most
``backoff_max_s``) up to ``max_attempts`` runs, then FAILED with the last answer. A job whose
deadline passed before it started is EXPIRED; one cancelled while claimed is not run.

Store outage (QueueUnavailable): pulling pauses (retried every ``poll_interval_s`` up to 5 s),
logged once per outage with a WARNING, shown on /health and /metrics; jobs in flight finish and
their result is written once the store is back (retried), or their lease lapses and they run
again -- at-least-once, billed once.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import orjson

from kvgate.asyncq.api import Job, JobListener, JobResult, JobState, JobStore, QueueUnavailable
from kvgate.asyncq.headroom import HeadroomParams, gate
from kvgate.asyncq.metrics import QueueMetrics
from kvgate.asyncq.ordering import order_window
from kvgate.asyncq.tasks import cancel
from kvgate.middleware.framework.errors import HTTPError
from kvgate.middleware.framework.plugin import LoopbackCaller
from kvgate.middleware.framework.types import LoopbackResponse

log = logging.getLogger("kvgate.asyncq.runner")


@dataclass(frozen=True, slots=True)
class RunnerSettings:
    consumer: str
    max_concurrency: int = 8
    lease_s: float = 300.0
    max_attempts: int = 3
    window: int = 256
    poll_interval_s: float = 0.05
    reap_interval_s: float = 1.0
    backoff_s: float = 1.0
    backoff_max_s: float = 60.0
    #: The gate closed this long (live traffic): jobs claimed but not started go back to the
    #: queue for other replicas. 10 s: long past a burst's TTFT, short against job waits.
    hold_window_s: float = 10.0
    headroom: HeadroomParams = field(default_factory=HeadroomParams)


def error_result(status: int, message: str, code: str, now: float) -> JobResult:
    body = {"error": {"message": message, "type": "invalid_request_error" if status < 500
                      else "server_error", "param": None, "code": code}}
    return JobResult(status, orjson.dumps(body), "application/json", None, now)


def run_body(body: bytes) -> bytes:
    """The job's body as run: not streamed, not backgrounded (the result is stored whole)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body  # the gateway answers 400, stored as the job's result
    if not isinstance(data, dict) or not ({"stream", "background"} & data.keys()):
        return body
    data.pop("background", None)
    data.pop("stream", None)
    data.pop("stream_options", None)
    return orjson.dumps(data)


class Runner:
    """See the module docstring. ``clock``: unix seconds (tests may pass their own)."""

    def __init__(self, store: JobStore, loopback: LoopbackCaller, settings: RunnerSettings,
                 metrics: QueueMetrics, listeners: Sequence[JobListener] = (),
                 clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.loopback = loopback
        self.s = settings
        self.metrics = metrics
        self.listeners = listeners
        self.clock = clock
        self.window: collections.deque[Job] = collections.deque()
        self.active: dict[str, asyncio.Task[None]] = {}
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._outage_since: float | None = None
        self._closed_since: float | None = None
        self._running_jobs: list[Job] = []

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="kvgate-async-runner")

    def wake(self) -> None:
        """Something was submitted or finished: look again now."""
        self._wake.set()

    async def stop(self) -> None:
        """Stop pulling; jobs in flight are cancelled and, with the window, given back."""
        task, self._task = self._task, None
        await cancel(task)
        held = [*self.window, *self._running_jobs]  # before the tasks' cleanup forgets them
        tasks = list(self.active.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.window.clear()
        for job in held:
            with contextlib.suppress(QueueUnavailable):
                await self.store.release(job.spec.id, self.s.consumer)

    @property
    def outage_since(self) -> float | None:
        return self._outage_since

    # -- the loop ----------------------------------------------------------------------
    async def _loop(self) -> None:
        next_reap = next_renew = 0.0
        while True:
            try:
                now = self.clock()
                if now >= next_reap:
                    await self._reap(now)
                    next_reap = now + self.s.reap_interval_s
                if now >= next_renew:
                    held = [*self.active, *(j.spec.id for j in self.window)]
                    await self.store.renew(self.s.consumer, held, self.s.lease_s, now)
                    next_renew = now + self.s.lease_s / 3
                await self._fill(now)
                self._store_back()
                delay = self.s.poll_interval_s
            except QueueUnavailable as exc:
                self._store_down(str(exc))
                delay = min(5.0, max(self.s.poll_interval_s, 0.5))
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), delay)

    async def _reap(self, now: float) -> None:
        changed = await self.store.reap(now)
        for job in changed:
            if job.state is JobState.QUEUED:
                self.metrics.reclaimed.inc()
            else:
                self.metrics.finished.labels(job.spec.kind, str(job.state)).inc()
            await self._notify(job)
        self.metrics.counts = await self.store.counts()

    async def _fill(self, now: float) -> None:
        while len(self.active) < self.s.max_concurrency:
            verdict = gate(self.loopback.endpoints(), len(self.active), self.s.headroom,
                           self.loopback.live_queued())
            self.metrics.gate_open = verdict.open
            if not verdict.open:
                self.metrics.gate_closed.labels(verdict.reason).inc()
                if verdict.reason != "job_slots":
                    self._closed_since = self._closed_since or now
                    if now - self._closed_since >= self.s.hold_window_s:
                        await self._give_back_window()
                return
            self._closed_since = None
            if not self.window:
                claimed = await self.store.claim(self.s.consumer, self.s.window,
                                                 self.s.lease_s, now)
                if not claimed:
                    return
                self.window.extend(order_window(claimed))
            job = self.window.popleft()
            self._running_jobs.append(job)
            self.active[job.spec.id] = asyncio.create_task(self._run(job))

    async def _give_back_window(self) -> None:
        """The gate closed: claimed jobs not started go back to the queue (other replicas, or
        this one later, take them), so none waits on a lease behind live traffic."""
        while self.window:
            job = self.window.popleft()
            await self.store.release(job.spec.id, self.s.consumer)

    # -- one job -----------------------------------------------------------------------
    async def _run(self, job: Job) -> None:
        spec = job.spec
        try:
            current = await self.store.get(spec.id)
            if current is None or current.state is not JobState.RUNNING \
                    or current.owner != self.s.consumer:
                return  # cancelled (or reclaimed) while it waited in the window
            now = self.clock()
            if spec.deadline is not None and now > spec.deadline:
                await self._finish(job, JobState.EXPIRED, error_result(
                    408, "the job was not started before its deadline", "expired", now))
                return
            if job.attempts == 1:
                self.metrics.wait.labels(spec.kind).observe(max(0.0, now - spec.created_at))
            self.metrics.started.labels(spec.kind).inc()
            await self._notify(current)
            await self._execute(job)
        except QueueUnavailable as exc:
            self._store_down(str(exc))  # the lease lapses; the job runs again, billed once
        finally:
            self.active.pop(spec.id, None)
            self._running_jobs = [j for j in self._running_jobs if j.spec.id != spec.id]
            self.metrics.running_here = len(self.active)
            self.wake()

    async def _execute(self, job: Job) -> None:
        spec = job.spec
        principal = None
        if self.loopback.has_auth:
            principal = self.loopback.principal_for(spec.key_id)
            if principal is None:
                await self._finish(job, JobState.FAILED, error_result(
                    401, f"the API key {spec.key_id!r} that submitted this job is no longer "
                    "valid", "invalid_api_key", self.clock()))
                return
        try:
            resp = await self.loopback.call(spec.method, spec.path, run_body(spec.body),
                                            principal=principal, request_id=spec.id,
                                            tier=spec.kind)
        except HTTPError as err:  # the answer was too large, or none came
            resp = LoopbackResponse(err.status, {"content-type": "application/json"},
                                    orjson.dumps(err.body()))
        result = JobResult(resp.status, resp.body, resp.content_type,
                           resp.headers.get("x-kvgate-engine"), self.clock())
        if resp.status < 400:
            await self._finish(job, JobState.SUCCEEDED, result)
        elif (resp.status >= 500 or resp.status == 429) and job.attempts < self.s.max_attempts:
            delay = min(self.s.backoff_max_s, self.s.backoff_s * 2 ** (job.attempts - 1))
            self.metrics.retries.labels(spec.kind).inc()
            log.info("job %s: answer %d on attempt %d; retrying in %.1f s", spec.id,
                     resp.status, job.attempts, delay)
            if await self.store.release(spec.id, self.s.consumer, delay):
                await self._notify_current(spec.id)
        else:
            await self._finish(job, JobState.FAILED, result)

    async def _finish(self, job: Job, state: JobState, result: JobResult) -> None:
        if await self.store.finish(job.spec.id, state, result):
            self.metrics.finished.labels(job.spec.kind, str(state)).inc()
            await self._notify_current(job.spec.id)

    async def _notify_current(self, job_id: str) -> None:
        current = await self.store.get(job_id)
        if current is not None:
            await self._notify(current)

    async def _notify(self, job: Job) -> None:
        for listener in self.listeners:
            try:
                await listener.on_job(job)
            except Exception:  # one listener's bug must not stop the queue
                log.exception("job listener %r failed on job %s", listener, job.spec.id)

    # -- outages -------------------------------------------------------------------------
    def _store_down(self, why: str) -> None:
        self.metrics.store_up = False
        if self._outage_since is None:
            self._outage_since = self.clock()
            self.metrics.outages.inc()
            log.warning("job store unavailable (%s): pulling paused, submits refused with "
                        "503 until it is back", why)

    def _store_back(self) -> None:
        if self._outage_since is not None:
            log.warning("job store back after %.1f s: pulling resumed",
                        self.clock() - self._outage_since)
            self._outage_since = None
        self.metrics.store_up = True


__all__ = ["Runner", "RunnerSettings", "error_result", "run_body"]
