"""The access log: one JSON line per API request, written once when the request ends.

:meth:`AccessLog.write` is called by the gateway (middleware/serving/gateway.py) in the ``finally``
of every API request, whatever its outcome: an answer, an error before or after dispatch, a client
that left (499), an engine that died mid-stream, a two-hop (P/D) dispatch. The line goes to the
``kvgate.access`` logger at INFO; ``kvgate serve`` gives that logger its own handler (stderr or
``server.access_log.path``, message only: a line is pure JSON) and stops it propagating, so the
access lines do not mix with the gateway's log format. In-process (tests) it propagates.

Fields (docs/observability.md): what the core knows of the request (ids, API, status, tenant,
key id, model, engines, profiles, tokens, durations) and what plugins add with
:func:`add_log_field` (the billing plugin: ``cost`` and ``session``, the keyed digest its ledger
stores; routing plugins: ``route``, why they chose). Never the API key, the raw session id, the
prompt or any header: the core copies none of those, and a plugin adds only what it chooses.

Cost: one ``orjson.dumps`` per request; nothing at all when disabled. Under ``kvgate serve``
(the logger's only handler is the one :func:`install_handler` gave it, nothing propagated,
no filters) the line goes straight to that handler's stream, under its lock, instead of
through ``Logger.info`` (a ``LogRecord``, the handler chain, a formatter: ~14 µs against
~2 µs per line, ~5 % of kvgate's CPU per 1 KiB request), and the lines of one event-loop
iteration in one write (:class:`AccessLog`); what reaches the file is the same.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import Any

import orjson

from kvgate.middleware.framework.composition.config import AccessLogConfig
from kvgate.middleware.framework.types import LOG_FIELDS
from kvgate.middleware.serving.context import RequestContext

LOGGER = "kvgate.access"
#: Longest model name copied (a client's string: bounded, so one line stays one line's size).
_MAX_MODEL = 200
_HANDLER_MARK = "_kvgate_access"
#: Lines held for one event-loop iteration at most before :meth:`AccessLog.flush` (a bound:
#: an iteration that ends more requests writes them in several batches).
MAX_PENDING = 256


def _us(seconds: float) -> float:
    """``seconds`` to the microsecond: ``round(seconds, 6)`` but for the last digit in rare
    half-way cases, at half its cost (it rounds an integer, not a decimal string; four per
    line)."""
    return round(seconds * 1e6) / 1e6


def _round(seconds: float | None) -> float | None:
    return None if seconds is None else _us(seconds)


class AccessLog:
    """Builds and writes the lines; ``enabled`` False: :meth:`write` returns at once.

    Straight to the own handler (module docstring), the lines of one event-loop iteration go
    out in one write: the first schedules :meth:`flush` with ``call_soon`` (it runs after the
    callbacks ready in this iteration: requests ending together, under load), the others
    append. Bounded by what one iteration ends (and :data:`MAX_PENDING` lines); a line waits
    well under a millisecond; :meth:`flush` at shutdown writes what is left. One write syscall
    per line was ~2 % of kvgate's CPU per 1 KiB request."""

    def __init__(self, config: AccessLogConfig) -> None:
        self.enabled = config.enabled
        self._log = logging.getLogger(LOGGER)
        self._pending: list[str] = []

    def write(self, ctx: RequestContext, method: str) -> None:
        if not self.enabled or not self._log.isEnabledFor(logging.INFO):
            return
        line = orjson.dumps(self.entry(ctx, method), default=str).decode()
        pending = self._pending
        if pending:
            pending.append(line)
            if len(pending) >= MAX_PENDING:
                self.flush()
            return
        if self._own_handler() is None:
            self._log.info(line)
            return
        try:
            asyncio.get_running_loop().call_soon(self.flush)
        except RuntimeError:  # no event loop (a synchronous caller): at once
            pending.append(line)
            self.flush()
            return
        pending.append(line)

    def flush(self) -> None:
        """Write the pending lines (one write) to the own handler, else through ``logging``."""
        lines, self._pending = self._pending, []
        if not lines:
            return
        handler = self._own_handler()
        if handler is not None and _write(handler, lines):
            return
        for line in lines:  # a closed or failing stream: logging reports it
            self._log.info(line)

    def _own_handler(self) -> logging.StreamHandler[Any] | None:
        """The handler :func:`install_handler` gave the logger when it is the only way out
        (else None: lines go through ``logging``, e.g. to pytest's caplog)."""
        log = self._log
        handlers = log.handlers
        if len(handlers) != 1 or log.propagate or log.filters:
            return None
        handler = handlers[0]
        if (not getattr(handler, _HANDLER_MARK, False) or handler.filters
                or handler.level > logging.INFO
                or not isinstance(handler, logging.StreamHandler) or handler.stream is None):
            return None
        return handler

    @staticmethod
    def entry(ctx: RequestContext, method: str) -> dict[str, object]:
        """The line's fields (plugin fields first: the core's win on a clash)."""
        now = time.monotonic()
        req, usage, who = ctx.req, ctx.usage, ctx.principal
        extra = ctx.state.get(LOG_FIELDS) or {}
        first = ctx.first_byte_at
        return {
            **extra,
            "ts": _us(time.time()),
            "request_id": ctx.request_id,
            "client_request_id": ctx.client_request_id,
            "api": ctx.adapter.name,
            "method": method,
            "path": ctx.path,
            "status": ctx.status,
            "error": ctx.error_code,
            "tenant": req.tenant if req is not None else None if who is None else who.tenant,
            "key_id": req.key_id if req is not None else None if who is None else who.key_id,
            "model": None if req is None else req.model[:_MAX_MODEL],
            "engines": ctx.engines,
            "profiles": ctx.profiles,  # a tuple: orjson writes it as a list
            "stream": None if req is None else req.stream,
            "service_tier": None if req is None else req.service_tier,
            "prompt_tokens": None if usage is None else usage.prompt_tokens,
            "cached_tokens": None if usage is None else usage.cached_tokens,
            "output_tokens": None if usage is None else usage.completion_tokens,
            "total_s": _round(now - ctx.received_at),
            "ttfb_s": None if first is None else _round(first - ctx.received_at),
            "upstream_s": _round(ctx.upstream_s) if ctx.engines else None,
        }


def _write(handler: logging.StreamHandler[Any], lines: list[str]) -> bool:
    """The lines to the handler's stream, under its lock; False if the stream failed."""
    try:
        with handler.lock:  # type: ignore[union-attr]  # set by Handler.createLock
            handler.stream.write("\n".join(lines) + "\n")
            handler.stream.flush()
    except (OSError, ValueError):
        return False
    return True


def install_handler(config: AccessLogConfig) -> None:
    """Give ``kvgate.access`` its own handler (``config.path`` appended to, else stderr),
    message only, not propagated (``kvgate serve``; idempotent: replaces its own handler)."""
    logger = logging.getLogger(LOGGER)
    for old in [h for h in logger.handlers if getattr(h, _HANDLER_MARK, False)]:
        logger.removeHandler(old)
        old.close()
    if not config.enabled:
        return
    handler: logging.Handler = (logging.FileHandler(config.path, encoding="utf-8")
                                if config.path else logging.StreamHandler(sys.stderr))
    setattr(handler, _HANDLER_MARK, True)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


__all__ = ["LOGGER", "AccessLog", "install_handler"]
