"""The Batch API's objects in OpenAI's shapes (``Batch``, its request counts and errors, the
list page, the create body) and its 409. No I/O (batches.py does it)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvgate.middleware.framework.errors import HTTPError


class Conflict(HTTPError):
    status = 409
    type = "invalid_request_error"
    code = "conflict"


class RequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchError(BaseModel):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class BatchObject(BaseModel):
    """OpenAI's batch object."""

    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: Literal["validating", "failed", "in_progress", "finalizing", "completed",
                    "expired", "cancelling", "cancelled"]
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class BatchCreate(BaseModel):
    """``POST /v1/batches`` body."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str
    endpoint: Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings",
                      "/v1/responses", "/v1/messages"]
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = None
    #: Accepted for OpenAI compatibility; output files do not expire here.
    output_expires_after: dict[str, Any] | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is not None:
            if len(v) > 16:
                raise ValueError("metadata holds at most 16 pairs")
            if any(len(k) > 64 or len(x) > 512 for k, x in v.items()):
                raise ValueError("metadata keys are at most 64 characters, values 512")
        return v
