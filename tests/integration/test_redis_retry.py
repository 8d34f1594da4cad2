"""Every kvgate Redis client survives a Redis restart without a false outage
(plugins/common/redis_retry.py): the connection pooled before the restart fails once, the client
retries on a fresh one; a Redis that is really down still fails at once."""

from __future__ import annotations

import time

import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from kvgate.plugins.common.redis_retry import stale_connection_retry
from tests.servers import RedisServer


def _client(url: str, retry: bool) -> Redis:
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    policy = stale_connection_retry() if retry else Retry(NoBackoff(), 0)
    return Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0, retry=policy)


@pytest.mark.parametrize("retry", [True, False])
async def test_a_connection_pooled_before_a_restart(retry: bool) -> None:
    server = RedisServer()
    server.start()
    client = _client(server.url, retry)
    try:
        assert await client.set("k", "v")  # the pool now holds a connection to this server
        server.stop()
        server.start()  # same port, a new process: the pooled connection is stale
        if retry:
            assert await client.set("k", "w")  # retried on a fresh connection
        else:  # the control: without the policy the first command after the restart fails
            with pytest.raises(RedisConnectionError):
                await client.set("k", "w")
    finally:
        await client.aclose()
        server.stop()


async def test_a_redis_that_is_down_still_fails_at_once() -> None:
    server = RedisServer()
    server.start()
    client = _client(server.url, retry=True)
    try:
        assert await client.set("k", "v")
        server.stop()
        started = time.monotonic()
        with pytest.raises(RedisConnectionError):
            await client.set("k", "w")
        assert time.monotonic() - started < 1.0  # refused twice, not waited out
    finally:
        await client.aclose()


class _ScriptClient:
    """A client whose scripts fail as redis-py does through uvloop when Redis dies while a
    connection is being set up."""

    def register_script(self, _script: str) -> object:
        async def call(**_kwargs: object) -> object:
            raise RuntimeError("unable to perform operation on <TCPTransport closed=True>; "
                               "the handler is closed")
        return call


async def test_a_transport_closed_during_connect_is_the_store_down() -> None:
    """Seen while Redis was SIGKILLed under load: redis-py raised RuntimeError, which became a
    500 instead of the quota store's fail-closed 503 (plugins/redis_retry.redis_errors)."""
    from kvgate.plugins.quotas.model import Ask
    from kvgate.plugins.quotas.redis_store import RedisStore, StoreDown

    store = RedisStore(_ScriptClient(), prefix="kvgate:q:", timeout_s=1.0)  # type: ignore[arg-type]
    ask = Ask(request_id="r", scopes=(), input_tokens=1, output_tokens=1, cost_units=0,
              lease_ms=1000)
    with pytest.raises(StoreDown, match="RuntimeError"):
        await store.admit(ask, 0)
