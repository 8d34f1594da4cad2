"""free_port: below the kernel's ephemeral range, bindable, never handed out twice."""

from __future__ import annotations

import os
import socket
import time

import pytest

from kvgate.engines import ports


def test_ports_are_below_the_ephemeral_range_distinct_and_bindable() -> None:
    low = ports._ephemeral_low()
    picked = [ports.free_port() for _ in range(50)]
    assert len(set(picked)) == len(picked)
    for port in picked:
        assert ports.LOW_PORT <= port < low
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_in_use_is_not_bindable() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        taken = busy.getsockname()[1]
        assert not ports._bindable("127.0.0.1", taken)


def test_a_claimed_port_is_refused_to_other_callers_until_stale(
        tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvgate.engines.ports.tempfile.gettempdir", lambda: str(tmp_path))
    assert ports._claim(25_000) is True
    assert ports._claim(25_000) is False  # another process asking now
    marker = ports._claims() / "25000"
    old = time.time() - ports.CLAIM_HOLD_S - 1
    os.utime(marker, (old, old))
    assert ports._claim(25_000) is True  # stale: taken over
