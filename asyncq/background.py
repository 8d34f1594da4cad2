"""Background responses: ``POST /v1/responses`` with ``background: true``, run by the queue.

The gateway answers at once with the Responses object in OpenAI's shape (``id: resp_...``,
``object: "response"``, ``status: "queued"``, ``background: true``); the job runs later with
``background`` removed and ``store`` kept, and with vLLM's ``request_id`` extra parameter set
to that id, so the engine's stored response has the *same* id the client was given: the
gateway's StateMap learns which engine holds it from the answer, and a later
``previous_response_id`` continues there. (An engine that ignores ``request_id`` answers with
its own id: the stored result is rewritten to the client's id, but continuing from it then
reaches that engine only by chance.)

``GET /v1/responses/{id}`` of such an id is answered from the job (a StateResolver):
``queued``, ``in_progress`` while it runs, then the engine's completed response; a failed run
is ``status: "failed"`` with the error; an expired one ``failed`` (code ``expired``); a
cancelled one ``cancelled``. ``POST /v1/responses/{id}/cancel`` cancels a queued (or running:
its answer is discarded) one and returns the object. Responses whose ``background`` is not
true are not touched. The ``responses`` API must accept ``background`` (``apis: responses:
allow_background: true``; the default preset sets it when the queue is on).
"""

from __future__ import annotations

import uuid
from typing import Any

import orjson

from kvgate.asyncq.api import Job, JobSpec, JobState
from kvgate.middleware.framework.types import InferenceRequest

_STATUS = {JobState.QUEUED: "queued", JobState.RUNNING: "in_progress",
           JobState.SUCCEEDED: "completed", JobState.FAILED: "failed",
           JobState.EXPIRED: "failed", JobState.CANCELLED: "cancelled"}


def wants_background(req: InferenceRequest, adapter_name: str) -> bool:
    return adapter_name == "responses" and req.body.get("background") is True


def background_spec(req: InferenceRequest, path: str, prefix_key: str, deadline_s: float,
                    now: float) -> JobSpec:
    job_id = "resp_" + uuid.uuid4().hex
    body = {**req.body, "request_id": job_id}
    return JobSpec(id=job_id, kind="background", method="POST", path=path,
                   body=orjson.dumps(body), tenant=req.tenant, key_id=req.key_id,
                   created_at=now, deadline=now + deadline_s, prefix_key=prefix_key)


def _shell(job: Job, status: str) -> dict[str, Any]:
    """The Responses object of a job without an engine answer."""
    try:
        body = orjson.loads(job.spec.body)
    except orjson.JSONDecodeError:
        body = {}
    return {
        "id": job.spec.id, "object": "response", "created_at": int(job.spec.created_at),
        "status": status, "background": True, "model": body.get("model"), "output": [],
        "error": None, "incomplete_details": None, "instructions": body.get("instructions"),
        "metadata": body.get("metadata") or {}, "parallel_tool_calls": True,
        "temperature": body.get("temperature"), "top_p": body.get("top_p"),
        "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
        "max_output_tokens": body.get("max_output_tokens"),
        "previous_response_id": body.get("previous_response_id"),
        "store": body.get("store", True), "usage": None,
    }


def _error_of(job: Job) -> dict[str, Any]:
    try:
        err = orjson.loads(job.result.body if job.result else b"{}").get("error") or {}
    except (orjson.JSONDecodeError, AttributeError):
        err = {}
    code = err.get("code") if isinstance(err, dict) else None
    message = err.get("message") if isinstance(err, dict) else None
    status = job.result.status if job.result else 500
    return {"code": code or ("server_error" if status >= 500 else "invalid_request"),
            "message": message or f"the background response failed with status {status}"}


def response_object(job: Job) -> dict[str, Any]:
    """What ``GET /v1/responses/{id}`` answers for a background job."""
    if job.state is JobState.SUCCEEDED and job.result is not None:
        try:
            answer = orjson.loads(job.result.body)
        except orjson.JSONDecodeError:
            answer = None
        if isinstance(answer, dict):
            return {**answer, "id": job.spec.id, "background": True}
    shell = _shell(job, _STATUS[job.state])
    if job.state in (JobState.FAILED, JobState.EXPIRED):
        shell["error"] = _error_of(job)
    return shell


__all__ = ["background_spec", "response_object", "wants_background"]
