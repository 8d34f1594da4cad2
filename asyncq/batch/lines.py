"""Pure helpers of the Batch API: input-line validation, deterministic ids, and the output /
error file lines in OpenAI's shapes. No I/O (asyncq/batch/batches.py does it)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from kvgate.asyncq.api import Job, JobState

#: Every API the gateway serves that a batch may target (OpenAI's four plus Anthropic's).
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses",
             "/v1/messages")


@dataclass(frozen=True, slots=True)
class GoodLine:
    custom_id: str
    body: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class BadLine:
    """An input line that cannot run: 1-based ``line`` number, its custom_id if it had one."""

    line: int
    custom_id: str | None
    code: str
    message: str


def job_id(batch_id: str, custom_id: str) -> str:
    """The deterministic job id (and ledger request id) of one batch request: submitting the
    same batch again after a crash stores nothing new, and a run bills under the same id."""
    digest = hashlib.sha256(f"{batch_id}\0{custom_id}".encode()).hexdigest()[:32]
    return f"batch_req_{digest}"


def output_file_id(batch_id: str, which: str) -> str:
    """Deterministic id of a batch's ``output`` / ``error`` file (finalising twice rewrites
    the same file instead of leaving two)."""
    return "file-" + hashlib.sha256(f"{batch_id}:{which}".encode()).hexdigest()[:24]


def _check(obj: object, endpoint: str, seen: set[str]) -> tuple[str | None, str | None, str]:
    """(custom_id, error code or None, message) of one parsed line."""
    if not isinstance(obj, dict):
        return None, "invalid_json_line", "the line is not a JSON object"
    cid = obj.get("custom_id")
    custom_id = cid if isinstance(cid, str) else None
    problems: list[tuple[str, str]] = []
    if not isinstance(cid, str) or not cid:
        problems.append(("missing_required_parameter", "custom_id must be a non-empty string"))
    elif cid in seen:
        problems.append(("duplicate_custom_id", f"custom_id {cid!r} is not unique"))
    if obj.get("method") != "POST":
        problems.append(("invalid_method", "method must be \"POST\""))
    if obj.get("url") != endpoint:
        problems.append(("mismatched_endpoint",
                         f"url must be the batch's endpoint {endpoint!r}"))
    body = obj.get("body")
    if not isinstance(body, dict):
        problems.append(("invalid_body", "body must be a JSON object"))
    elif not isinstance(body.get("model"), str) or not body["model"]:
        problems.append(("missing_required_parameter", "body.model must be a string"))
    elif body.get("stream") is True:
        problems.append(("invalid_body", "streaming is not supported in a batch"))
    elif body.get("background") is True:
        problems.append(("invalid_body", "background is not supported in a batch"))
    if problems:
        code = problems[0][0]
        return custom_id, code, "; ".join(m for _, m in problems)
    return custom_id, None, ""


def validate_lines(lines: Iterable[bytes], endpoint: str
                   ) -> tuple[list[GoodLine], list[BadLine]]:
    """Every line parsed and checked: ``custom_id`` unique, ``method`` POST, ``url`` the
    batch's endpoint, ``body`` an object naming a model (not streaming)."""
    good: list[GoodLine] = []
    bad: list[BadLine] = []
    seen: set[str] = set()
    for number, raw in enumerate(lines, start=1):
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            bad.append(BadLine(number, None, "invalid_json_line", f"invalid JSON: {exc}"))
            continue
        custom_id, code, message = _check(obj, endpoint, seen)
        if custom_id:
            seen.add(custom_id)
        if code is not None:
            bad.append(BadLine(number, custom_id, code, f"line {number}: {message}"))
        else:
            assert custom_id is not None and isinstance(obj, dict)
            good.append(GoodLine(custom_id, obj["body"]))
    return good, bad


def bad_line_row(batch_id: str, bad: BadLine) -> bytes:
    """An invalid input line in the error file's shape."""
    return orjson.dumps({
        "id": job_id(batch_id, bad.custom_id or f"#line{bad.line}"),
        "custom_id": bad.custom_id,
        "response": None,
        "error": {"code": bad.code, "message": bad.message, "line": bad.line},
    })


def _body(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw.decode("utf-8", "replace")


_STATE_ERRORS = {
    JobState.EXPIRED: ("batch_expired",
                       "This request could not be executed before the completion window "
                       "expired."),
    JobState.CANCELLED: ("batch_cancelled",
                         "This request was cancelled before it ran."),
}


def job_row(job: Job) -> tuple[bool, bytes]:
    """(goes to the output file, the line): OpenAI's ``{id, custom_id, response: {status_code,
    request_id, body}, error}``. A request the engine answered with an error keeps its
    response and goes to the error file, as OpenAI does; one that never ran carries an
    ``error`` instead."""
    spec, res = job.spec, job.result
    ok = job.state is JobState.SUCCEEDED and res is not None and res.status < 400
    error: dict[str, str] | None = None
    response: dict[str, Any] | None = None
    if not ok and job.state in _STATE_ERRORS and (res is None or res.status >= 400):
        code, message = _STATE_ERRORS[job.state]
        error = {"code": code, "message": message}
    elif res is not None:
        response = {"status_code": res.status, "request_id": spec.id, "body": _body(res.body)}
    else:
        error = {"code": "request_failed", "message": f"the request ended {job.state.value} "
                 "without an answer"}
    line = {"id": spec.id, "custom_id": spec.custom_id, "response": response, "error": error}
    return ok, orjson.dumps(line)
