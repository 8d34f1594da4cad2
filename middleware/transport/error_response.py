"""The one place an error becomes an HTTP response.

Every answer kvgate gives for an :class:`~kvgate.middleware.framework.errors.HTTPError` is built by
:func:`render`: its status, its headers (``content-type`` first, then the caller's, then the
error's own, e.g. ``Retry-After``) and its body in an :class:`ErrorShape`:

* an API request's error, in its API's shape: the request's adapter is the shape (its
  ``error_body``: OpenAI's ``{"error": {...}}``, Anthropic's ``{"type": "error", ...}``, ...;
  middleware/serving/gateway.py);
* an error before any adapter is known (no route, 405, ``/health``, ``/metrics``,
  ``/v1/models``, plugin routes, the admin port) and the management planes' FastAPI apps:
  :data:`OPENAI`;
* the HTTP front end's own refusals (middleware/transport/h1limits.py: 408, 414, 431, 503 in
  OpenAI's
  shape; the 400 of a request it cannot parse) and its 500 for an app that failed before
  answering (middleware/transport/h1server.py): :data:`PLAIN` for the last two, as uvicorn answers
  them,
  built as whole HTTP/1.1 responses by :func:`wire_response` or sent through ASGI.

How each API shapes an error stays in its adapter (``apis/``); which shape, status and
headers a response gets is decided here.
"""

from __future__ import annotations

import http
from collections.abc import Iterable
from typing import NamedTuple, Protocol

import orjson

from kvgate.middleware.framework.errors import HTTPError
from kvgate.middleware.transport.asgi import Headers, Send, send_bytes

JSON = b"application/json"
TEXT = b"text/plain; charset=utf-8"


class ErrorShape(Protocol):
    """How one API writes an error body (every ``ApiAdapter`` is one)."""

    def error_body(self, err: HTTPError) -> bytes: ...


class OpenAIShape:
    """OpenAI's ``{"error": {"message", "type", "param", "code"}}``."""

    content_type = JSON

    def error_body(self, err: HTTPError) -> bytes:
        return orjson.dumps(err.body())


class PlainShape:
    """The message as plain text (the front end's 400 and 500, as uvicorn answers them)."""

    content_type = TEXT

    def error_body(self, err: HTTPError) -> bytes:
        return err.message.encode()


OPENAI = OpenAIShape()
PLAIN = PlainShape()


class Rendered(NamedTuple):
    """An error response: status, headers (without ``content-length``) and body."""

    status: int
    headers: Headers
    body: bytes


def render(err: HTTPError, shape: ErrorShape = OPENAI,
           extra: Iterable[tuple[bytes, bytes]] = ()) -> Rendered:
    """``err`` as a response in ``shape``, with ``extra`` headers (e.g. ``x-request-id``)."""
    content_type = TEXT if isinstance(shape, PlainShape) else JSON
    headers = [(b"content-type", content_type), *extra,
               *((k.encode(), v.encode()) for k, v in err.headers.items())]
    return Rendered(err.status, headers, shape.error_body(err))


async def send_error(send: Send, err: HTTPError, shape: ErrorShape = OPENAI,
                     extra: Iterable[tuple[bytes, bytes]] = ()) -> None:
    """Send ``err`` as a whole ASGI response (:func:`render`)."""
    status, headers, body = render(err, shape, extra)
    await send_bytes(send, status, body, headers)


def wire_response(err: HTTPError, shape: ErrorShape = OPENAI,
                  extra: Iterable[tuple[bytes, bytes]] = ()) -> bytes:
    """``err`` as a whole HTTP/1.1 response, connection closed after it (the front end's
    refusals, written to the socket before any app runs)."""
    status, headers, body = render(err, shape, [(b"connection", b"close"), *extra])
    phrase = http.HTTPStatus(status).phrase.encode()
    head = b"".join(b"%s: %s\r\n" % pair for pair in headers)
    return (b"HTTP/1.1 %d %s\r\n%scontent-length: %d\r\n\r\n" % (status, phrase, head, len(body))
            + body)


def with_status(status: int, message: str, *, kind: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> HTTPError:
    """An error of a given status that no class of middleware/framework/errors.py names (the front
    end's refusals; FastAPI's bare statuses)."""
    err = HTTPError(message, code=code, headers=headers)
    err.status = status
    if kind is not None:
        err.type = kind
    return err


__all__ = ["OPENAI", "PLAIN", "ErrorShape", "OpenAIShape", "PlainShape", "Rendered", "render",
           "send_error", "wire_response", "with_status"]
