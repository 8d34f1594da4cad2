"""Request ids, the one JSON parse of a body, and :class:`InferenceRequest` construction.

Validation of a body is its API adapter's (middleware/framework/api.py, ``apis/``); this module only
turns bytes into a JSON object (orjson, once) and a parsed request into the request plugins
see.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping
from typing import Any

import orjson

from kvgate.middleware.framework.api import ApiAdapter, ParsedRequest
from kvgate.middleware.framework.composition.registry import load_apis
from kvgate.middleware.framework.errors import BadRequest
from kvgate.middleware.framework.plugin import CREDENTIAL_HEADERS
from kvgate.middleware.framework.types import InferenceRequest

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def client_request_id(headers: Mapping[str, str]) -> str | None:
    """The client's ``x-request-id`` if given and well-formed (400 if malformed), else None.

    It is echoed on the response and kept in the ledger as ``client_request_id``, but it never
    identifies the request inside kvgate: clients reuse ids (retries, bugs, malice), and each
    request that reaches an engine is billed once on its own (see :class:`RequestIds`)."""
    given = headers.get("x-request-id")
    if given is None:
        return None
    if not _REQUEST_ID.fullmatch(given):
        raise BadRequest(
            "x-request-id must be 1-128 characters of [A-Za-z0-9._:-]", param="x-request-id"
        )
    return given


class RequestIds:
    """kvgate's own ids of requests: the ledger key and the engines' ``X-Request-Id``, unique
    per request whatever the client sends, and unguessable (128 random bits, 32 hex digits,
    like a UUID4's ``hex``).

    The random bytes are read from the OS :data:`BATCH` ids at a time: one ``getrandom``
    call per batch instead of one per request (with ``uuid.uuid4`` it was a syscall and a
    UUID object each). Holds at most one batch (4 KiB)."""

    #: Ids per read of the OS's random source.
    BATCH = 256
    _SIZE = 16

    def __init__(self) -> None:
        self._pool = b""
        self._at = 0

    def __call__(self) -> str:
        at = self._at
        if at >= len(self._pool):
            self._pool, at = os.urandom(self.BATCH * self._SIZE), 0
        self._at = at + self._SIZE
        return self._pool[at:at + self._SIZE].hex()


def load_body(body: bytes) -> dict[str, Any]:
    """The body as a JSON object, parsed once (400 on empty, malformed or non-object bodies)."""
    if not body:
        raise BadRequest("request body is empty; expected a JSON object")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BadRequest("request body must be a JSON object")
    return data


def build_request(
    adapter: ApiAdapter, parsed: ParsedRequest, data: dict[str, Any], body: bytes,
    headers: Mapping[str, str], rid: str, client_rid: str | None = None,
) -> InferenceRequest:
    """The request plugins see (the credential headers left out of its headers)."""
    forwarded = {k: v for k, v in headers.items() if k not in CREDENTIAL_HEADERS}
    return InferenceRequest(
        request_id=rid, api=adapter.name, model=parsed.model, body=data, headers=forwarded,
        stream=parsed.stream, client_wants_usage=parsed.client_wants_usage,
        prompt_token_estimate=parsed.prompt_token_estimate, received_at=time.monotonic(),
        raw_body=body, client_request_id=client_rid, prompt=parsed.prompt,
        billed=bool(getattr(adapter, "billed", True)),
    )


def parse_request(
    api: str, body: bytes, headers: Mapping[str, str], rid: str, client_rid: str | None = None
) -> InferenceRequest:
    """Parse and validate ``body`` with the adapter named ``api`` (``kvgate.apis`` entry
    point), as the gateway does; for tools and benchmarks (loads the entry points per call)."""
    factory = load_apis().get(str(api))
    if factory is None:
        raise BadRequest(f"no API adapter named {api!r}")
    adapter = factory()
    data = load_body(body)
    return build_request(adapter, adapter.parse(data, headers), data, body, headers, rid,
                         client_rid)

