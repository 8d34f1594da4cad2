"""Free loopback ports for servers started later (tests, benchmarks, the demo).

A port from ``bind(("127.0.0.1", 0))`` lies in the kernel's ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 by default), so between being picked
and being bound it can be handed out as the *source* port of any outbound loopback connection,
or taken by a TCP self-connect: a ZMQ socket that keeps reconnecting to a port nobody listens
on yet eventually connects to itself. CI saw exactly that ("Address already in use" when the
gateway bound the KV-event port its engines had been dialling for 40 s).

:func:`free_port` therefore picks below the ephemeral range, where the kernel never assigns
ports on its own, at random, checks that the port can be bound now, and never hands the same
port out twice in one process. Other processes picking at random in the same 12,000-port range
collide with probability ~1/12,000 per pair of concurrent picks.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

__all__ = ["free_port"]

#: Lowest port tried: above the registered ports most services on a developer machine listen on.
LOW_PORT = 20_000
#: Used when the kernel's range cannot be read (Linux's default lower bound).
DEFAULT_EPHEMERAL_LOW = 32_768
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
#: Ports this process handed out (bounded by the range itself, at most ~12,800 ints).
_given: set[int] = set()
_rng = random.SystemRandom()


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
            if port not in _given and _bindable(host, port):
                _given.add(port)
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port = int(sock.getsockname()[1])
    _given.add(port)
    return port
