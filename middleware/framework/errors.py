"""kvgate's one error hierarchy. Every error kvgate raises on purpose is a :class:`KvgateError`:

```
KvgateError
├── ConfigError                  the configuration is invalid: the process does not start
├── ClientGone                   the client left before its answer (nothing sent; 499 logged)
├── TransferUnavailable          P/D: no KV transfer for this request, decode locally
└── HTTPError                    becomes a response (middleware/transport/error_response.py)
    ├── BadRequest 400, Unauthorized 401, Forbidden 403, NotFound/ModelNotFound 404,
    │   MethodNotAllowed 405, PayloadTooLarge 413, RateLimited 429,
    │   NoEndpointAvailable/Overloaded/ServiceUnavailable 503
    └── UpstreamError 502        an engine call failed (middleware/transport/engine_call.py)
        ├── Unreachable          connect refused/reset: retried, out of rotation
        ├── EngineTimeout 504    retried, breaker
        ├── StreamBroken         the answer broke off: retried before its first byte, breaker
        ├── BadAnswer            invalid JSON: not retried, breaker
        └── EngineStatus         the engine answered >= 400 (``engine_status``)
            ├── EngineFailed     5xx: retried, breaker
            ├── EngineBusy       408 / 429 (504 / 502): retried, no breaker
            └── UpstreamHTTPError (EngineRefused) other 4xx: the engine's status and cleaned
                                 message, not retried, no breaker
```

Each class carries its policy (``retryable``, ``engine_fault``); nobody reads flags off an
instance. An error becomes a response in one place, middleware/transport/error_response.py, in the
shape of the request's API (its adapter's ``error_body``; OpenAI's before one is known).
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable
from typing import Any, ClassVar

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
    """An engine (or a provider) failed: 502, or 504 when it timed out. The base of every
    error an engine call raises (middleware/transport/engine_call.py); what the dispatcher does
    with one
    is told by its class, never by a flag:

    * ``retryable``: another engine may take the request (a failure before the first byte);
    * ``engine_fault``: it counts against the engine's circuit breaker
      (middleware/fleet/breaker.py);
    * :class:`Unreachable`: the engine is taken out of rotation at once.

    Raised as is for a failure nothing more specific describes (a provider's, an in-process
    call's)."""

    status = 502
    type = "server_error"
    code: str | None = "upstream_error"
    retryable: ClassVar[bool] = True
    engine_fault: ClassVar[bool] = True

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        if status is not None:
            self.status = status
        if self.status == 504:
            self.code = "upstream_timeout"


class Unreachable(UpstreamError):
    """The engine could not be reached (connect refused or reset, closed before answering):
    retried elsewhere, and the engine leaves the rotation until a probe passes."""


class EngineTimeout(UpstreamError, TimeoutError):
    """The engine did not answer in time (connect, a free connection, or the whole exchange).
    Also a ``TimeoutError``, like the deadlines of ``asyncio`` that raise it."""

    status = 504


class StreamBroken(UpstreamError):
    """The engine's answer broke off, or was not valid HTTP, before its end (before the first
    byte relayed: retried elsewhere; after it, the stream ends with the API's error event)."""


class BadAnswer(UpstreamError):
    """The engine answered, but with something kvgate cannot pass on (invalid JSON, an answer
    past the size an in-process caller takes): not retried."""

    retryable = False


class EngineStatus(UpstreamError):
    """The engine answered an error status (``engine_status``; None: a provider gave none).
    As such: 502, not retried; its subclasses say more."""

    retryable = False

    def __init__(self, message: str, engine_status: int | None, *,
                 status: int | None = None) -> None:
        super().__init__(message, status=status)
        self.engine_status = engine_status


class EngineFailed(EngineStatus):
    """A 5xx: the engine's fault, retried elsewhere (502 if none takes it)."""

    retryable = True


#: Engine 4xx answers that mean load, not a bad request, and the status the client gets when no
#: other engine takes the request: 408 (the engine timed it out waiting) as a gateway timeout,
#: 429 (at its limit) as 502.
ENGINE_LOAD = {408: 504, 429: 502}


class EngineBusy(EngineStatus):
    """408 or 429: the engine's load, not a bad request; retried elsewhere and, like a client's
    fault, never counted against the engine's breaker (504 / 502 if no engine takes it)."""

    retryable = True
    engine_fault = False

    def __init__(self, engine_status: int) -> None:
        super().__init__(f"engine answered {engine_status}", engine_status,
                         status=ENGINE_LOAD.get(engine_status, 502))


#: OpenAI's error type of an engine's 4xx by status (others: ``invalid_request_error``).
_ENGINE_4XX_TYPES = {401: "authentication_error", 403: "permission_error"}


class UpstreamHTTPError(EngineStatus):
    """The engine refused the request with a 4xx: the client's fault, never the engine's
    (not retried, not counted against the engine's circuit breaker, middleware/serving/dispatch.py).

    The client gets the engine's status and message in its API's own error shape (each
    adapter's ``error_body``): ``message`` is the engine's, read from its body (OpenAI's or
    Anthropic's error shape, a bare ``message`` or ``detail``, or plain text) and cleaned of
    tracebacks, addresses and file paths, capped (middleware/framework/redact.py
    ``client_message``); the engine's string ``param`` and ``code`` are kept, its own ``type`` is
    not (vLLM's ``BadRequestError`` is no OpenAI type): ``type`` follows the status."""

    engine_fault = False
    code = None

    def __init__(self, status: int, body: bytes) -> None:
        message, param, code = _engine_error(body)
        super().__init__(client_message(message) or f"engine answered {status}", status,
                         status=status)
        self.param = param
        self.code = code
        self.type = _ENGINE_4XX_TYPES.get(status, "invalid_request_error")


#: The engine refused the request (4xx): :class:`UpstreamHTTPError` by its newer name.
EngineRefused = UpstreamHTTPError


def engine_status_error(status: int, body: bytes) -> EngineStatus:
    """The error of an engine's answer with ``status`` >= 400 (``body``: its bytes)."""
    if status >= 500:
        return EngineFailed(f"engine answered {status}", status)
    if status in ENGINE_LOAD:
        return EngineBusy(status)
    return UpstreamHTTPError(status, body)


class ClientGone(KvgateError):
    """The client disconnected before it was answered: nothing is sent (logged as 499)."""


class TransferUnavailable(KvgateError):
    """A prefill/decode KV transfer cannot be set up, or the prefill answer cannot drive one:
    the request is decoded locally instead (middleware/serving/disagg.py)."""


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
