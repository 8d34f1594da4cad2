"""One narrow error hierarchy, mapped to OpenAI error bodies in exactly one place."""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable
from typing import Any

from kvgate.middleware.framework.redact import client_message


class KvgateError(Exception):
    """Base of every error kvgate raises on purpose."""


class ConfigError(KvgateError):
    """The configuration is invalid; the process refuses to start.

    The message names the file, the instance and the problem.
    """


class HTTPError(KvgateError):
    """An error that becomes an OpenAI-style HTTP error response."""

    status: int = 500
    type: str = "server_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class BadRequest(HTTPError):
    status = 400
    type = "invalid_request_error"


class Unauthorized(HTTPError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class Forbidden(HTTPError):
    status = 403
    type = "permission_error"


class ModelNotFound(HTTPError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class NotFound(HTTPError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class MethodNotAllowed(HTTPError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class PayloadTooLarge(HTTPError):
    status = 413
    type = "invalid_request_error"
    code = "payload_too_large"


class RateLimited(HTTPError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limited"


class NoEndpointAvailable(HTTPError):
    status = 503
    type = "server_error"
    code = "no_healthy_engine"


class Overloaded(HTTPError):
    """Every engine that could take the request is at capacity and it waited too long (send
    ``Retry-After``)."""

    status = 503
    type = "server_error"
    code = "overloaded"


class ServiceUnavailable(HTTPError):
    """A store the request depends on is down and its policy fails closed (e.g. budgets while
    the shared quota store is unreachable; send ``Retry-After``)."""

    status = 503
    type = "server_error"
    code = "service_unavailable"


class UpstreamError(HTTPError):
    """The engine failed or answered with an error (502), or timed out (504)."""

    status = 502
    type = "server_error"
    code = "upstream_error"

    def __init__(
        self, message: str, *, status: int = 502, retryable: bool = True,
        unreachable: bool = False, engine_fault: bool = True,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.retryable = retryable
        #: The engine could not be reached at all (connect refused/reset): take it out of rotation.
        self.unreachable = unreachable
        #: Counts against the engine's circuit breaker (False: the engine is busy, e.g. a 429).
        self.engine_fault = engine_fault
        if status == 504:
            self.code = "upstream_timeout"


#: OpenAI's error type of an engine's 4xx by status (others: ``invalid_request_error``).
_ENGINE_4XX_TYPES = {401: "authentication_error", 403: "permission_error"}


class UpstreamHTTPError(HTTPError):
    """The engine refused the request with a 4xx: the client's fault, never the engine's
    (it does not count against the engine's circuit breaker, middleware/serving/dispatch.py).

    The client gets the engine's status and message in its API's own error shape (each
    adapter's ``error_body``): ``message`` is the engine's, read from its body (OpenAI's or
    Anthropic's error shape, a bare ``message`` or ``detail``, or plain text) and cleaned of
    tracebacks, addresses and file paths, capped (middleware/framework/redact.py
    ``client_message``); the engine's string ``param`` and ``code`` are kept, its own ``type`` is
    not (vLLM's ``BadRequestError`` is no OpenAI type): ``type`` follows the status."""

    def __init__(self, status: int, body: bytes) -> None:
        message, param, code = _engine_error(body)
        super().__init__(client_message(message) or f"engine answered {status}", param=param,
                         code=code)
        self.status = status
        self.type = _ENGINE_4XX_TYPES.get(status, "invalid_request_error")


def _engine_error(body: bytes) -> tuple[str, str | None, str | None]:
    """(message, param, code) of an engine's error body; the text itself if it is not JSON."""
    try:
        payload: Any = json.loads(body)
    except ValueError:
        return body.decode(errors="replace").strip(), None, None
    if not isinstance(payload, dict):
        return "", None, None
    inner = payload.get("error")
    fields: dict[str, Any] = inner if isinstance(inner, dict) else payload
    message = fields.get("message", fields.get("detail"))
    if not isinstance(message, str):
        message = "" if message is None else json.dumps(message)
    param, code = fields.get("param"), fields.get("code")
    return (message, param if isinstance(param, str) else None,
            code if isinstance(code, str) else None)


def model_not_found(name: str, known: Iterable[str]) -> ModelNotFound:
    """404 for an unknown model, naming the closest known names (difflib, at most 5)."""
    close = difflib.get_close_matches(name, sorted(known), n=5, cutoff=0.5)
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return ModelNotFound(f"the model {name!r} does not exist{hint}", param="model")


def internal_error(request_id: str) -> HTTPError:
    """The error shown for an unexpected exception: no details leak, the id links to the log."""
    err = HTTPError(f"internal error (request id {request_id})", code="internal_error")
    err.status = 500
    return err
