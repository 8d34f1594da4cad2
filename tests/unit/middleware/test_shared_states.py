"""The state-id map shared through Redis (middleware/serving/shared_states.py, middleware/serving/states.py),
over an in-memory stand-in for the Redis client: values, TTL, fail-closed reads, the write
queue of an outage and its drain, and what a request without API keys gets instead."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvgate.middleware.framework.errors import ServiceUnavailable
from kvgate.middleware.serving.shared_states import MAX_ID_CHARS, SharedStates, decode, encode
from kvgate.middleware.serving.states import StateMap


class FakeRedis:
    def __init__(self) -> None:
        self.data: dict[str, tuple[str, int]] = {}
        self.down = False
        self.gets = 0

    def _check(self) -> None:
        if self.down:
            raise ConnectionError("refused")

    async def set(self, key: str, value: str, px: int) -> None:
        self._check()
        self.data[key] = (value, px)

    async def get(self, key: str) -> str | None:
        self.gets += 1
        self._check()
        found = self.data.get(key)
        return None if found is None else found[0]

    def pipeline(self, transaction: bool) -> FakePipe:
        return FakePipe(self)

    async def aclose(self) -> None:
        pass


class FakePipe:
    def __init__(self, redis: FakeRedis) -> None:
        self.redis = redis
        self.ops: list[tuple[str, str, int]] = []

    async def __aenter__(self) -> FakePipe:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        pass

    def set(self, key: str, value: str, px: int) -> None:
        self.ops.append((key, value, px))

    async def execute(self) -> None:
        self.redis._check()
        for key, value, px in self.ops:
            self.redis.data[key] = (value, px)


def _shared(redis: FakeRedis, ttl_s: float = 60.0) -> SharedStates:
    shared = SharedStates("redis://127.0.0.1:1/0", ttl_s, retry_s=0.05)
    shared._client = redis
    shared._errors = (ConnectionError,)
    return shared


def test_values_round_trip_and_junk_is_unknown() -> None:
    assert decode(encode("sim-0", "acme")) == ("sim-0", "acme")
    assert decode(encode("sim-0", None)) == ("sim-0", None)
    for junk in (None, b"not json", '{"e": 3}', '["sim-0"]', '{"e": "x", "t": 5}'):
        assert decode(junk) is None


async def test_an_id_recorded_by_one_process_is_resolved_by_another() -> None:
    redis = FakeRedis()
    one, two = StateMap(shared=_shared(redis, ttl_s=90)), StateMap(shared=_shared(redis))
    await one.record(["resp_1"], "sim-1", "acme")
    assert redis.data["kvgate:state:resp_1"][1] == 90_000  # the TTL, in ms
    await two.fetch("resp_1", "globex")
    assert two.holder("resp_1", "globex") is None  # known now, and not globex's
    assert two.holder("resp_1", "acme") == one.holder("resp_1", "acme")
    gets = redis.gets
    await two.fetch("resp_1", "acme")  # cached: no second Redis read
    assert redis.gets == gets and two.lookups["shared"] == 1
    await two.fetch("x" * (MAX_ID_CHARS + 1), "acme")  # never asked for
    assert redis.gets == gets


async def test_redis_down_fails_closed_with_keys_and_writes_wait() -> None:
    redis = FakeRedis()
    states = StateMap(shared=_shared(redis))
    redis.down = True
    with pytest.raises(ServiceUnavailable) as err:
        await states.fetch("resp_2", "acme")
    assert err.value.code == "state_store_unavailable" and err.value.status == 503
    await states.fetch("resp_2", None)  # without API keys: routed as an unknown id
    assert states.lookups["unavailable"] == 2
    await states.record(["resp_3"], "sim-0", "acme")  # kept here, queued for Redis
    assert states.holder("resp_3", "acme") is not None
    health = states.health()
    assert health is not None and health["ok"] is False and health["pending_writes"] == 1
    redis.down = False
    for _ in range(100):
        if "kvgate:state:resp_3" in redis.data:
            break
        await asyncio.sleep(0.01)
    assert decode(redis.data["kvgate:state:resp_3"][0]) == ("sim-0", "acme")
    health = states.health()
    assert health is not None and health["ok"] is True and health["pending_writes"] == 0
    await states.close()


async def test_without_shared_state_nothing_changes() -> None:
    states = StateMap()
    await states.fetch("resp_4", "acme")
    await states.record(["resp_4"], "sim-0", "acme")
    assert states.health() is None and states.holder("resp_4", "acme") is not None
