"""Free loopback ports for servers started later (tests, benchmarks, the demo).

A port from ``bind(("127.0.0.1", 0))`` lies in the kernel's ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 by default), so between being picked
and being bound it can be handed out as the *source* port of any outbound loopback connection,
or taken by a TCP self-connect: a ZMQ socket that keeps reconnecting to a port nobody listens
on yet eventually connects to itself. CI saw exactly that ("Address already in use" when the
gateway bound the KV-event port its engines had been dialling for 40 s).

:func:`free_port` therefore picks below the ephemeral range, where the kernel never assigns
ports on its own, at random, checks that the port can be bound now, and never hands the same
port out twice on this machine within an hour: each pick is claimed by creating a marker file
with ``O_EXCL`` in a per-user directory under the temp dir, so concurrent processes (the test
process, the servers it starts, other test runs) never receive the same port while one of them
has yet to bind it. A claim older than :data:`CLAIM_HOLD_S` is stale and may be taken again;
the directory holds at most one marker per port of the range (~12,800 empty files).
"""

from __future__ import annotations

import os
import random
import socket
import tempfile
import time
from pathlib import Path

__all__ = ["free_port"]

#: Lowest port tried: above the registered ports most services on a developer machine listen on.
LOW_PORT = 20_000
#: Used when the kernel's range cannot be read (Linux's default lower bound).
DEFAULT_EPHEMERAL_LOW = 32_768
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
#: How long a handed-out port stays claimed [s]: longer than any test module or benchmark
#: holds a port before binding it (engines take minutes to start on a loaded machine).
CLAIM_HOLD_S = 3600.0
_rng = random.SystemRandom()


def _claims() -> Path:
    return Path(tempfile.gettempdir()) / f"kvgate-ports-{os.getuid()}"


def _claim(port: int) -> bool:
    """Claim ``port`` for this caller unless another process claimed it within the hold."""
    directory = _claims()
    directory.mkdir(mode=0o700, exist_ok=True)
    marker = directory / str(port)
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        return True
    except FileExistsError:
        try:
            if time.time() - marker.stat().st_mtime < CLAIM_HOLD_S:
                return False
            marker.touch()  # a stale claim: take it over
            return True
        except OSError:
            return False


def _ephemeral_low() -> int:
    try:
        return int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return DEFAULT_EPHEMERAL_LOW


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that is free now and outside the kernel's ephemeral range.

    Falls back to a kernel-chosen port only when the range below it is exhausted (or too narrow
    to search: a kernel configured with a low ephemeral range)."""
    high = _ephemeral_low() - 1
    if high - LOW_PORT >= 1000:
        for _ in range(200):
            port = _rng.randint(LOW_PORT, high)
            if _bindable(host, port) and _claim(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
