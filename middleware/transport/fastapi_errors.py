"""Errors and the request guard of FastAPI sub-applications (management planes mounted
through ``AsgiMount``). Errors in OpenAI's shape: kvgate's own ``HTTPError``\\ s,
Starlette's HTTP errors (404, 405, ...), request-validation errors (400 naming the
parameter) and anything unexpected (500 with a request id, the traceback logged, never the
exception text in the body).

:class:`Guard` authenticates and bounds the body of every request before FastAPI sees it.

One implementation for every such app (the async queue's Files/Batch plane, the keys admin
API), so their error bodies and checks cannot drift apart.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvgate.middleware.framework.errors import (
    BadRequest,
    HTTPError,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    internal_error,
)
from kvgate.middleware.transport.error_response import render

__all__ = ["PRINCIPAL", "ErrorDetail", "ErrorResponse", "Guard", "error_response",
           "install_openai_errors", "openapi_errors", "status_error"]

#: The scope key under which :class:`Guard` leaves the authenticated principal.
PRINCIPAL = "kvgate.principal"


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error shape."""

    error: ErrorDetail


def openapi_errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` for a router: these statuses documented with OpenAI's error body."""
    return {s: {"model": ErrorResponse} for s in statuses}


def error_response(err: HTTPError) -> Response:
    """``err`` in OpenAI's shape (middleware/transport/error_response.py, the one place errors are
    rendered)."""
    status, headers, body = render(err)
    return Response(body, status_code=status, headers={
        k.decode("latin-1"): v.decode("latin-1") for k, v in headers})


def status_error(status: int, detail: str) -> HTTPError:
    """The kvgate error of a bare HTTP status raised by Starlette or FastAPI."""
    errors: dict[int, type[HTTPError]] = {404: NotFound, 405: MethodNotAllowed,
                                          413: PayloadTooLarge}
    if status in errors:
        return errors[status](detail)
    err = BadRequest(detail) if status < 500 else HTTPError(detail)
    err.status = status
    return err


def install_openai_errors(app: FastAPI, what: str, log: logging.Logger) -> None:
    """Every error ``app`` can raise answered in OpenAI's shape; ``what`` names the app in the
    log line of an unexpected error."""

    async def kvgate_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPError)
        return error_response(exc)

    async def http_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        if isinstance(exc.__cause__, HTTPError):  # raised while the body was read
            return error_response(exc.__cause__)
        return error_response(status_error(exc.status_code, str(exc.detail)))

    async def validation_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
        msg = str(first.get("msg", "invalid request"))
        param = ".".join(loc) or None
        return error_response(BadRequest(f"{param}: {msg}" if param else msg, param=param))

    async def unexpected(_: Request, exc: Exception) -> Response:
        rid = uuid.uuid4().hex
        log.error("unexpected error in the %s (request %s)", what, rid, exc_info=exc)
        return error_response(internal_error(rid))

    app.add_exception_handler(HTTPError, kvgate_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, unexpected)


class Guard:
    """Pure ASGI wrapper: ``authenticate(headers)`` (raises an ``HTTPError``: 401/403) and a body
    of at most ``max_body`` bytes (413, by ``content-length`` and while it streams in), before
    the app sees the request; the principal is left in the scope under :data:`PRINCIPAL`.
    ``open_path`` (the app's OpenAPI schema) needs neither."""

    def __init__(self, app: ASGIApp, authenticate: Callable[[dict[str, str]], object],
                 max_body: int, open_path: str) -> None:
        self.app = app
        self.authenticate = authenticate
        self.max_body = max_body
        self.open_path = open_path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] == self.open_path:
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", ())}
        try:
            principal = self.authenticate(headers)
            length = headers.get("content-length", "")
            if length.isdigit() and int(length) > self.max_body:
                raise PayloadTooLarge(f"the request body is larger than {self.max_body} bytes")
        except HTTPError as err:
            await error_response(err)(scope, receive, send)
            return
        seen = 0

        async def bounded() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_body:
                raise PayloadTooLarge(f"the request body is larger than {self.max_body} bytes")
            return message
        await self.app({**scope, PRINCIPAL: principal}, bounded, send)
