"""Queued single requests (Cloudflare's ``queueRequest`` shape) on any API route.

``x-kvgate-queue: true`` on an API request makes the gateway answer ``202`` with
``{"id": "qreq_...", "object": "queued_request", "status": "queued", ...}`` after the request
hooks ran (authentication, catalog, allow-lists: a request the gateway would refuse is refused
now, not later), instead of dispatching it. The request runs later through the same path
(asyncq/runner.py), its answer kept. Optional headers (a bad value is a 400):

* ``x-kvgate-queue-priority``: integer in [-100, 100], higher runs first (default 0);
* ``x-kvgate-queue-deadline-s``: seconds from now (> 0, at most 30 days) by which it must have
  started, else it EXPIRES (default: the plugin's ``queued_deadline_s``).

``GET /v1/queue/requests/{id}`` answers ``status`` ``queued`` / ``running`` / ``succeeded`` /
``failed`` / ``expired`` / ``cancelled`` and, once finished, ``result``: the API's status code
and answer body (JSON as JSON, anything else as text). ``DELETE`` cancels a queued or running
one. Both are tenant-scoped: another tenant's id is a 404.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Path, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from kvgate.asyncq.api import Job, JobSpec, QueueService
from kvgate.middleware.framework.errors import BadRequest, NotFound
from kvgate.middleware.framework.types import InferenceRequest, Principal

QUEUE_HEADER = "x-kvgate-queue"
PRIORITY_HEADER = "x-kvgate-queue-priority"
DEADLINE_HEADER = "x-kvgate-queue-deadline-s"
_TRUE, _FALSE = frozenset({"true", "1", "yes"}), frozenset({"false", "0", "no"})
#: Longest deadline a client may ask for: 30 days (OpenAI keeps batch results that long).
MAX_DEADLINE_S = 30 * 86400.0
PRIORITY_RANGE = (-100, 100)


def wants_queue(headers: Mapping[str, str]) -> bool:
    value = headers.get(QUEUE_HEADER)
    if value is None or value.strip().lower() in _FALSE:
        return False
    if value.strip().lower() in _TRUE:
        return True
    raise BadRequest(f"{QUEUE_HEADER} must be true or false", param=QUEUE_HEADER)


def queue_options(headers: Mapping[str, str], default_deadline_s: float) -> tuple[int, float]:
    """(priority, deadline in seconds from now) from the request headers (400 if bad)."""
    raw = headers.get(PRIORITY_HEADER, "0").strip()
    try:
        priority = int(raw)
    except ValueError:
        raise BadRequest(f"{PRIORITY_HEADER} must be an integer", param=PRIORITY_HEADER) from None
    if not PRIORITY_RANGE[0] <= priority <= PRIORITY_RANGE[1]:
        raise BadRequest(f"{PRIORITY_HEADER} must be in [{PRIORITY_RANGE[0]}, "
                         f"{PRIORITY_RANGE[1]}]", param=PRIORITY_HEADER)
    given = headers.get(DEADLINE_HEADER)
    if given is None:
        return priority, default_deadline_s
    try:
        deadline = float(given)
    except ValueError:
        raise BadRequest(f"{DEADLINE_HEADER} must be a number of seconds",
                         param=DEADLINE_HEADER) from None
    if not 0 < deadline <= MAX_DEADLINE_S:
        raise BadRequest(f"{DEADLINE_HEADER} must be in (0, {MAX_DEADLINE_S:.0f}]",
                         param=DEADLINE_HEADER)
    return priority, deadline


def request_body(req: InferenceRequest) -> bytes:
    """The body as the gateway would send it now (the client's bytes unless a hook changed
    them)."""
    return req.raw_body if req.raw_body is not None else orjson.dumps(req.body)


def queued_spec(req: InferenceRequest, path: str, prefix_key: str, priority: int,
                deadline_s: float, now: float) -> JobSpec:
    return JobSpec(id="qreq_" + uuid.uuid4().hex, kind="queued", method="POST", path=path,
                   body=request_body(req), tenant=req.tenant, key_id=req.key_id,
                   created_at=now, deadline=now + deadline_s, priority=priority,
                   prefix_key=prefix_key)


def _answer_body(content_type: str, body: bytes) -> Any:
    if "json" in content_type:
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError:
            pass
    return body.decode("utf-8", "replace")


def queued_object(job: Job) -> dict[str, Any]:
    """The ``queued_request`` object of a job."""
    spec = job.spec
    out: dict[str, Any] = {
        "id": spec.id, "object": "queued_request", "status": str(job.state),
        "created_at": int(spec.created_at), "path": spec.path, "priority": spec.priority,
        "deadline": None if spec.deadline is None else int(spec.deadline),
        "attempts": job.attempts, "result": None,
    }
    if job.result is not None:
        out["finished_at"] = int(job.result.finished_at)
        out["result"] = {"status_code": job.result.status,
                         "body": _answer_body(job.result.content_type, job.result.body)}
    return out


def owned(job: Job | None, principal: Principal | None, kind: str) -> Job | None:
    """``job`` if it is of ``kind`` and the caller's tenant's (None otherwise: a 404)."""
    tenant = None if principal is None else principal.tenant
    if job is None or job.spec.kind != kind or job.spec.tenant != tenant:
        return None
    return job


class QueuedRequest(BaseModel):
    """OpenAPI shape of a queued request (answers are built by :func:`queued_object`)."""

    id: str
    object: str = "queued_request"
    status: str
    created_at: int
    path: str
    priority: int
    deadline: int | None
    attempts: int
    result: dict[str, Any] | None = None
    finished_at: int | None = None


JobId = Annotated[str, Path(min_length=1, max_length=128)]


def queued_router(service: QueueService) -> APIRouter:
    """``GET`` / ``DELETE /v1/queue/requests/{id}`` for the management app."""
    router = APIRouter(tags=["queue"])

    async def find(request: Request, job_id: str) -> Job:
        principal = service.authenticate(
            {k.lower(): v for k, v in request.headers.items()})
        job = owned(await service.get(job_id), principal, "queued")
        if job is None:
            raise NotFound(f"no queued request with id {job_id!r}", param="id")
        return job

    @router.get("/v1/queue/requests/{job_id}", response_model=QueuedRequest)
    async def get_queued(request: Request, job_id: JobId) -> JSONResponse:
        return JSONResponse(queued_object(await find(request, job_id)))

    @router.delete("/v1/queue/requests/{job_id}", response_model=QueuedRequest)
    async def cancel_queued(request: Request, job_id: JobId) -> JSONResponse:
        job = await find(request, job_id)
        cancelled = await service.cancel(job.spec.id)
        return JSONResponse(queued_object(cancelled or job))

    return router


def accepted(spec: JobSpec) -> bytes:
    """The 202 body of a just-queued request."""
    return orjson.dumps({
        "id": spec.id, "object": "queued_request", "status": "queued",
        "created_at": int(spec.created_at), "path": spec.path, "priority": spec.priority,
        "deadline": None if spec.deadline is None else int(spec.deadline), "attempts": 0,
        "result": None, "request_id": spec.id})


__all__ = ["DEADLINE_HEADER", "PRIORITY_HEADER", "QUEUE_HEADER", "QueuedRequest", "accepted",
           "owned", "queue_options", "queued_object", "queued_router", "queued_spec",
           "request_body", "wants_queue"]
