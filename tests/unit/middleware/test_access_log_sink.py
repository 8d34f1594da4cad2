"""Where an access-log line goes: straight to ``kvgate serve``'s own handler when it is the
logger's only way out, through ``logging`` otherwise; the file gets the same line either way."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvgate.middleware.framework.composition.config import AccessLogConfig
from kvgate.middleware.observe import access_log
from kvgate.middleware.observe.access_log import LOGGER, AccessLog, install_handler

ENTRY = {"request_id": "r1", "status": 200, "path": "/v1/chat/completions", "total_s": 0.001}


class Seen(logging.Filter):
    """Counts the records ``logging`` handled (a filter that lets everything through)."""

    def __init__(self) -> None:
        super().__init__()
        self.records = 0

    def filter(self, record: logging.LogRecord) -> bool:
        self.records += 1
        return True


@pytest.fixture
def access_file(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "access.jsonl"
    install_handler(AccessLogConfig(path=str(path)))
    try:
        yield path
    finally:
        install_handler(AccessLogConfig(enabled=False))
        logging.getLogger(LOGGER).propagate = True


def _add_logger_filter(seen: Seen) -> Callable[[], None]:
    logger = logging.getLogger(LOGGER)
    logger.addFilter(seen)
    return lambda: logger.removeFilter(seen)


def _add_handler_filter(seen: Seen) -> Callable[[], None]:
    handler = logging.getLogger(LOGGER).handlers[0]
    handler.addFilter(seen)
    return lambda: handler.removeFilter(seen)


def _propagate(_: Seen) -> Callable[[], None]:
    logger = logging.getLogger(LOGGER)
    logger.propagate = True
    return lambda: setattr(logger, "propagate", False)


def _no_change(_: Seen) -> Callable[[], None]:
    return lambda: None


@pytest.mark.parametrize(("name", "setup", "through_logging"), [
    ("own handler only", _no_change, False),
    ("a filter on the logger", _add_logger_filter, True),
    ("a filter on the handler", _add_handler_filter, True),
    ("propagating", _propagate, False),  # no filter sees it: checked by the line count only
])
def test_line_reaches_the_file_once(access_file: Path, monkeypatch: pytest.MonkeyPatch,
                                    name: str, setup: Callable[[Seen], Callable[[], None]],
                                    through_logging: bool) -> None:
    monkeypatch.setattr(AccessLog, "entry", staticmethod(lambda ctx, method: dict(ENTRY)))
    seen = Seen()
    undo = setup(seen)
    try:
        AccessLog(AccessLogConfig()).write(Any, "POST")  # type: ignore[arg-type]
    finally:
        undo()
    lines = access_file.read_text().splitlines()
    assert [json.loads(line) for line in lines] == [ENTRY], name
    assert seen.records == (1 if through_logging else 0), name



class CountingStream(io.StringIO):
    """A stream that counts its writes."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, text: str) -> int:
        self.writes += 1
        return super().write(text)


@pytest.mark.parametrize(("lines", "max_pending", "writes"), [
    (1, 256, 1),
    (5, 256, 1),  # one event-loop iteration's lines: one write
    (5, 2, 3),  # bounded: 2 + 2, then the last one at the iteration's end
])
async def test_one_write_per_event_loop_iteration(
        access_file: Path, monkeypatch: pytest.MonkeyPatch,
        lines: int, max_pending: int, writes: int) -> None:
    monkeypatch.setattr(AccessLog, "entry", staticmethod(lambda ctx, method: dict(ENTRY)))
    monkeypatch.setattr(access_log, "MAX_PENDING", max_pending)
    logger = logging.getLogger(LOGGER)
    handler = logger.handlers[0]
    assert isinstance(handler, logging.StreamHandler)
    # pytest's log capture may hang its handlers on the logger of an async test: only ours
    monkeypatch.setattr(logger, "handlers", [handler])
    stream = CountingStream()
    monkeypatch.setattr(handler, "stream", stream)
    log = AccessLog(AccessLogConfig())
    for _ in range(lines):
        log.write(Any, "POST")  # type: ignore[arg-type]
    assert stream.writes == writes - 1
    await asyncio.sleep(0)  # the next iteration: the flush ran
    assert stream.writes == writes
    assert [json.loads(line) for line in stream.getvalue().splitlines()] == [ENTRY] * lines
    log.write(Any, "POST")  # type: ignore[arg-type]
    log.flush()  # at shutdown: what is pending, at once
    assert len(stream.getvalue().splitlines()) == lines + 1
