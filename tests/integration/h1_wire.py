"""Raw-socket helpers for fuzzing the HTTP/1.1 front end ``kvgate serve`` runs
(middleware/transport/h1server.py): a real ``kvgate serve`` process and a simulated engine
(:func:`served_gateway`), one exchange of raw bytes (:func:`exchange`), and the check that what
came back is a sequence of valid HTTP responses, read with httptools' response parser
(:func:`responses`)."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httptools
import yaml

from tests.integration.conftest import gateway_config
from tests.servers import free_port, running_process

KVGATE = str(Path(sys.executable).with_name("kvgate"))
#: The statuses the front end and the gateway may answer malformed, oversized or slow input with.
ALLOWED = frozenset({200, 400, 404, 405, 408, 411, 413, 414, 415, 422, 431, 501, 503, 505})
#: A valid request body (chat, one token) and the valid request around it.
CHAT_BODY = json.dumps({"model": "sim-model", "max_tokens": 1,
                        "messages": [{"role": "user", "content": "hi"}]}).encode()
CHAT = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\nconnection: close\r\n\r\n" % len(CHAT_BODY) + CHAT_BODY)
HEALTH = b"GET /health HTTP/1.1\r\nhost: gw\r\nconnection: close\r\n\r\n"


@dataclass
class Answer:
    """What one connection got back: the statuses of the complete responses, whether the
    server closed it (EOF or a reset), and when that happened (seconds after the send)."""

    statuses: list[int] = field(default_factory=list)
    raw: bytes = b""
    closed: bool = False
    reset: bool = False
    closed_after_s: float | None = None


class _Parser:
    def __init__(self) -> None:
        self.begun = 0
        self.parser = httptools.HttpResponseParser(self)
        self.statuses: list[int] = []

    def on_message_begin(self) -> None:
        self.begun += 1

    def on_message_complete(self) -> None:
        self.statuses.append(self.parser.get_status_code())


def responses(raw: bytes) -> list[int]:
    """The statuses of ``raw``, which must be nothing but whole, valid HTTP responses."""
    parser = _Parser()
    parser.parser.feed_data(raw)  # raises HttpParserError on anything invalid
    assert parser.begun == len(parser.statuses), f"a partial response: {raw[-300:]!r}"
    return parser.statuses


def exchange(port: int, pieces: list[bytes], *, gap_s: float = 0.0, shut: bool = False,
             limit_s: float = 8.0, quiet_s: float = 0.3) -> Answer:
    """Send ``pieces`` on a new connection (``gap_s`` apart; then shut the write side if
    ``shut``) and read until the server closes, ``limit_s`` passes, or a complete response
    is followed by ``quiet_s`` of silence (a kept-alive connection)."""
    answer = Answer()
    with socket.create_connection(("127.0.0.1", port), timeout=limit_s) as sock:
        start = time.monotonic()
        with contextlib.suppress(OSError):  # the server may close while we still send
            for i, piece in enumerate(pieces):
                if i and gap_s:
                    time.sleep(gap_s)
                sock.sendall(piece)
            if shut:
                sock.shutdown(socket.SHUT_WR)
        _read(sock, answer, start, limit_s, quiet_s)
    answer.statuses = responses(answer.raw)
    return answer


def _read(sock: socket.socket, answer: Answer, start: float, limit_s: float,
          quiet_s: float) -> None:
    parser = _Parser()
    while (left := start + limit_s - time.monotonic()) > 0:
        sock.settimeout(min(left, quiet_s) if parser.statuses else left)
        try:
            data = sock.recv(65536)
        except TimeoutError:
            if parser.statuses:
                return
            continue
        except ConnectionResetError:
            answer.closed = answer.reset = True
            break
        if not data:
            answer.closed = True
            break
        answer.raw += data
        with contextlib.suppress(httptools.HttpParserError):  # checked in full after
            parser.parser.feed_data(data)
    answer.closed_after_s = time.monotonic() - start if answer.closed else None


def request_ok(port: int, raw: bytes = HEALTH) -> None:
    """A normal request on a fresh connection is served (200)."""
    answer = exchange(port, [raw], limit_s=15)
    assert answer.statuses == [200], answer.raw[:300]


@contextlib.contextmanager
def served_gateway(tmp: Path, **server: Any) -> Iterator[tuple[int, Path]]:
    """A simulated engine process and ``kvgate serve --config`` (its ``server`` section
    ``server``) in front of it: yields the gateway's port and its log file."""
    sim_port, port = free_port(), free_port()
    sim = [sys.executable, "-m", "kvgate.engines.sim", "--port", str(sim_port), "--engine-id",
           "sim-0", "--time-scale", "0", "--log-level", "warning"]
    config = tmp / "kvgate.yaml"
    config.write_text(yaml.safe_dump(gateway_config(
        [f"http://127.0.0.1:{sim_port}"], server=server, pool={"breaker_failures": 10**6})))
    log = tmp / "kvgate.log"
    with (tmp / "sim.log").open("ab") as out:  # started alongside the gateway: less wait
        proc = subprocess.Popen(sim, stdout=out, stderr=subprocess.STDOUT)
    try:
        with running_process([KVGATE, "serve", "--config", str(config), "--port", str(port)],
                             f"http://127.0.0.1:{port}/health", log=log, limit_s=60):
            yield port, log
    finally:
        proc.terminate()
        proc.wait(10)
