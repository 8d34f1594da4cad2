"""Fixtures shared by the unit tests: a real ``redis-server`` for the plugins that talk to one."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.servers import REDIS_SERVER, RedisServer, redis_running


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A fresh ``redis-server`` on a free loopback port (skipped without one, or without the
    ``redis`` package)."""
    if REDIS_SERVER is None:
        pytest.skip("redis-server not installed (apt-get install -y redis-server)")
    pytest.importorskip("redis", reason="the 'redis' package is not installed (kvgate[redis])")
    with redis_running() as server:
        yield server
