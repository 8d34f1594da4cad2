"""A small in-memory ``QueueService`` for the management plane's tests (the real one is the
``async-queue`` plugin; tests/integration/test_batches_gateway.py runs through it). Jobs run
when the test calls :meth:`MemoryQueue.run`, with a handler the test gives; every state
change is told to the listeners, as the real service does."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvgate.asyncq.api import TERMINAL, Job, JobListener, JobResult, JobSpec, JobState
from kvgate.middleware.framework.errors import Unauthorized
from kvgate.middleware.framework.types import Principal

Handler = Callable[[JobSpec], Awaitable[JobResult]]


@dataclass(frozen=True, slots=True)
class Caller:
    tenant: str
    key_id: str


class MemoryQueue:
    """Keys ``sk-<tenant>`` authenticate as ``<tenant>``; ``auth=False``: no authenticator."""

    def __init__(self, auth: bool = True) -> None:
        self.jobs: dict[str, Job] = {}
        self.listeners: list[JobListener] = []
        self.auth = auth
        self.submitted = 0

    async def _set(self, job: Job) -> None:
        self.jobs[job.spec.id] = job
        for listener in self.listeners:
            await listener.on_job(job)

    async def submit(self, specs: Sequence[JobSpec]) -> int:
        new = 0
        for spec in specs:
            if spec.id not in self.jobs:
                new += 1
                self.submitted += 1
                await self._set(Job(spec, JobState.QUEUED, 0, None, None, None))
        return new

    async def get(self, job_id: str) -> Job | None:
        return self.jobs.get(job_id)

    async def cancel(self, job_id: str) -> Job | None:
        job = self.jobs.get(job_id)
        if job is not None and job.state is JobState.QUEUED:
            job = dataclasses.replace(job, state=JobState.CANCELLED)
            await self._set(job)
        return job

    async def cancel_batch(self, batch_id: str) -> int:
        ids = [j.spec.id for j in self.jobs.values()
               if j.spec.batch_id == batch_id and j.state is JobState.QUEUED]
        for job_id in ids:
            await self.cancel(job_id)
        return len(ids)

    async def batch_counts(self, batch_id: str) -> Mapping[JobState, int]:
        out: dict[JobState, int] = {}
        for job in self.jobs.values():
            if job.spec.batch_id == batch_id:
                out[job.state] = out.get(job.state, 0) + 1
        return out

    async def batch_jobs(self, batch_id: str) -> Sequence[Job]:
        return [j for j in self.jobs.values() if j.spec.batch_id == batch_id]

    def add_listener(self, listener: JobListener) -> None:
        self.listeners.append(listener)

    def authenticate(self, headers: Mapping[str, str]) -> Principal | None:
        if not self.auth:
            return None
        auth = headers.get("authorization", "")
        if not auth.startswith("Bearer sk-") or len(auth) <= len("Bearer sk-"):
            raise Unauthorized("invalid API key")
        tenant = auth[len("Bearer sk-"):]
        return Caller(tenant, f"key-{tenant}")

    def prefix_key(self, path: str, body: Mapping[str, Any]) -> str:
        messages = body.get("messages") or [{}]
        return f"{body.get('model')}|{str(messages[0].get('content', ''))[:64]}"

    async def run(self, handler: Handler, limit: int | None = None) -> int:
        """Run up to ``limit`` queued jobs (all by default) through ``handler``."""
        queued = [j for j in self.jobs.values() if j.state is JobState.QUEUED][:limit]
        for job in queued:
            running = dataclasses.replace(job, state=JobState.RUNNING,
                                          attempts=job.attempts + 1, started_at=time.time())
            await self._set(running)
            result = await handler(job.spec)
            if self.jobs[job.spec.id].state in TERMINAL:
                continue
            state = JobState.SUCCEEDED if result.status < 500 else JobState.FAILED
            await self._set(dataclasses.replace(running, state=state, result=result))
        return len(queued)

    async def expire_all(self) -> None:
        for job in list(self.jobs.values()):
            if job.state is JobState.QUEUED:
                await self._set(dataclasses.replace(job, state=JobState.EXPIRED))
