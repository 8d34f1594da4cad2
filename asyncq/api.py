"""The seams of the async queue: job data, the store contract, the service the management plane
(Batch API, queued requests) uses, and listeners told of every state change.

Plain data and Protocols only: no I/O, no global state. A *job* is one API request run later
through the gateway's own request path (middleware/framework/loopback.py); its ``id`` is also the
ledger ``request_id`` of that run, so a job executed twice (at-least-once after a crash) is billed
once.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from kvgate.middleware.framework.errors import HTTPError
from kvgate.middleware.framework.types import Principal


class JobState(enum.StrEnum):
    """Where a job is. ``queued -> running -> succeeded | failed``; ``queued -> expired`` (its
    deadline passed before it started); ``queued | running -> cancelled``; a running job whose
    lease lapses (its replica died) goes back to ``queued``."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLED = "cancelled"


#: States a job never leaves (the first terminal write wins).
TERMINAL: frozenset[JobState] = frozenset(
    {JobState.SUCCEEDED, JobState.FAILED, JobState.EXPIRED, JobState.CANCELLED})

#: Job kinds: the pricing tier (``service_tier`` in the ledger) and the metric label.
KINDS: frozenset[str] = frozenset({"batch", "queued", "background"})


@dataclass(frozen=True, slots=True)
class JobSpec:
    """One unit of deferred work: an API request run later through the gateway."""

    #: Unique; also the ledger request_id of its run (exactly-once billing).
    id: str
    #: ``batch`` | ``queued`` | ``background``: pricing tier and metric label.
    kind: str
    method: str
    path: str
    #: The request's JSON body (bytes).
    body: bytes
    #: The submitter (never a secret): runs with this principal, results scoped to it.
    tenant: str | None
    key_id: str | None
    #: Unix seconds.
    created_at: float
    #: Unix seconds; a job not started by then is EXPIRED. None: no deadline.
    deadline: float | None
    #: Higher runs first.
    priority: int = 0
    batch_id: str | None = None
    custom_id: str | None = None
    #: Cache-order key: jobs with equal keys run back to back (``QueueService.prefix_key``).
    prefix_key: str = ""


@dataclass(frozen=True, slots=True)
class JobResult:
    """What the run answered: the API's status and body as a live client would have got them
    (a 4xx keeps the engine's error body), or kvgate's own error for an expired/failed job."""

    status: int
    body: bytes
    content_type: str
    engine: str | None
    finished_at: float


@dataclass(frozen=True, slots=True)
class Job:
    spec: JobSpec
    state: JobState
    #: Runs started so far (a retried or reclaimed job has more than one).
    attempts: int
    result: JobResult | None
    #: Unix seconds of the latest start.
    started_at: float | None
    #: The consumer (replica) holding its lease while running.
    owner: str | None


@runtime_checkable
class JobListener(Protocol):
    """Told after every state change this replica makes (webhooks, batch bookkeeping)."""

    async def on_job(self, job: Job) -> None: ...


class QueueUnavailable(HTTPError):
    """The store cannot be reached (Redis outage): submits fail with this 503 in OpenAI's shape
    (``HTTPError.body()``), pulling pauses, nothing stored is lost."""

    status = 503
    type = "server_error"
    code = "queue_unavailable"


@runtime_checkable
class JobStore(Protocol):
    """Durable job storage. Every method is safe to call from several replicas at once."""

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def enqueue(self, specs: Sequence[JobSpec]) -> int:
        """Store new jobs as QUEUED; ids already stored are left alone. Returns how many were
        new. Raises QueueUnavailable."""
        ...

    async def claim(self, consumer: str, limit: int, lease_s: float,
                    now: float) -> Sequence[Job]:
        """Up to ``limit`` QUEUED jobs moved to RUNNING, owned by ``consumer`` until
        ``now + lease_s`` (attempts + 1). Best first: priority, then age."""
        ...

    async def renew(self, consumer: str, job_ids: Sequence[str], lease_s: float,
                    now: float) -> None: ...

    async def finish(self, job_id: str, state: JobState, result: JobResult | None) -> bool:
        """Move to terminal ``state`` with ``result``; False if it already was terminal (the
        first terminal write wins)."""
        ...

    async def release(self, job_id: str, consumer: str, delay_s: float = 0.0) -> bool:
        """A RUNNING job held by ``consumer`` back to QUEUED, claimable again after
        ``delay_s`` (retry backoff; 0 at shutdown)."""
        ...

    async def cancel(self, job_id: str, now: float) -> Job | None:
        """QUEUED or RUNNING -> CANCELLED; the job as it now is (None: unknown id)."""
        ...

    async def cancel_batch(self, batch_id: str, now: float) -> int: ...

    async def get(self, job_id: str) -> Job | None: ...

    async def batch_jobs(self, batch_id: str) -> Sequence[Job]: ...

    async def batch_counts(self, batch_id: str) -> Mapping[JobState, int]: ...

    async def counts(self) -> Mapping[tuple[str, JobState], int]:
        """Non-terminal jobs by (kind, state), for metrics."""
        ...

    async def reap(self, now: float) -> Sequence[Job]:
        """Expired leases back to QUEUED; QUEUED jobs past their deadline -> EXPIRED. Returns
        the jobs it changed (as they now are)."""
        ...

    def health(self) -> Mapping[str, object]:
        """Cheap, no I/O: what the store last knew (``ok``, ``backend``, outage since ...)."""
        ...


@runtime_checkable
class QueueService(Protocol):
    """What the async-queue plugin offers to the management plane (asyncq/batch/mgmt.py)."""

    async def submit(self, specs: Sequence[JobSpec]) -> int:
        """Idempotent by id; returns how many were new. Raises QueueUnavailable."""
        ...

    async def get(self, job_id: str) -> Job | None: ...

    async def cancel(self, job_id: str) -> Job | None: ...

    async def cancel_batch(self, batch_id: str) -> int: ...

    async def batch_counts(self, batch_id: str) -> Mapping[JobState, int]: ...

    async def batch_jobs(self, batch_id: str) -> Sequence[Job]:
        """For output/error files."""
        ...

    def add_listener(self, listener: JobListener) -> None: ...

    def authenticate(self, headers: Mapping[str, str]) -> Principal | None:
        """The gateway's authenticator on lower-cased ``headers`` (raises Unauthorized);
        None when the gateway has none configured."""
        ...

    def prefix_key(self, path: str, body: Mapping[str, Any]) -> str:
        """The cache-order key of a request body (model + system prompt / first message /
        instructions)."""
        ...


__all__ = ["KINDS", "TERMINAL", "Job", "JobListener", "JobResult", "JobSpec", "JobState",
           "JobStore", "QueueService", "QueueUnavailable"]
