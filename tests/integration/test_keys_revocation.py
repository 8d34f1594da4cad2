"""Revocations that survive Redis losing its data (plugins/tenancy/keys_revoked.py).

Keys in a real redis-server seeded from each replica's keys file: a key revoked through the
admin API, and a secret rotated out, stay refused after ``FLUSHALL`` and a restart (which seeds
Redis again from the file); a running replica whose revocation list knows what Redis lost
writes it back, so a replica started elsewhere (its own file, no list) refuses it too. The list
is checked on reload (a line another process adds is honoured), and a list that cannot be
written turns the revoke into a 503 naming it (the revoke can be sent again).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from redis import Redis

from kvgate.engines.sim.testing import RunningSim
from kvgate.plugins.tenancy.keys_model import hash_key
from kvgate.plugins.tenancy.keys_revoked import parse_list
from tests.asyncq_helpers import until
from tests.integration.conftest import gateway, gateway_config
from tests.integration.test_keys_admin import ADMIN, USER, Gw
from tests.servers import REDIS_SERVER, RedisServer


@pytest.fixture
def redis_db() -> Iterator[RedisServer]:
    if REDIS_SERVER is None:
        pytest.skip("redis-server not installed")
    server = RedisServer()
    server.start()
    yield server
    server.stop()


def flushall(server: RedisServer) -> None:
    client = Redis.from_url(server.url)
    try:
        client.flushall()
    finally:
        client.close()


def _keys_file(root: Path) -> Path:
    """``root/keys.yaml`` (admin ``root`` of ops, ``user-1`` of acme), written once."""
    root.mkdir(exist_ok=True)
    keys = root / "keys.yaml"
    if not keys.exists():
        keys.write_text(yaml.safe_dump({"keys": [
            {"id": "root", "tenant": "ops", "sha256": hash_key(ADMIN), "admin": True},
            {"id": "user-1", "tenant": "acme", "sha256": hash_key(USER)}]}))
    return keys


@contextlib.asynccontextmanager
async def replica(sims: list[RunningSim], root: Path, redis_url: str,
                  **params: Any) -> AsyncIterator[Gw]:
    """A gateway whose keys are in Redis, seeded from ``root/keys.yaml`` (a restart keeps the
    folder, its file and its revocation list)."""
    keys = _keys_file(root)
    data = gateway_config([s.url for s in sims])
    data["plugins"] = [{"type": "api-keys", "params": {
        "file": str(keys), "redis_url": redis_url, "poll_interval_s": 0.1,
        "redis_timeout_s": 0.5, **params}}, *data["plugins"]]
    async with gateway(data) as (app, client):
        yield Gw(app, client, root)


async def _refuses(gw: Gw, key: str) -> bool:
    return not await gw.works(key)


async def test_a_revoked_key_stays_refused_after_redis_loses_its_data(
        fleet: list[RunningSim], tmp_path: Path, redis_db: RedisServer) -> None:
    root = tmp_path / "a"
    async with replica(fleet, root, redis_db.url) as a:
        assert await a.works(USER)
        assert (await a.admin("POST", "/keys/user-1/revoke")).status_code == 200
        assert not await a.works(USER)
        listed = parse_list((root / "keys.yaml.revoked").read_text(), "list")
        assert {r.id for r in listed.values()} == {"user-1"}
        assert a.keys.health()["revocations"] == 1
    flushall(redis_db)  # Redis loses everything; the keys file never knew of the revoke
    async with replica(fleet, root, redis_db.url) as again:
        assert not await again.works(USER)
        shown = (await again.admin("GET", "/keys/user-1")).json()
        assert shown["status"] == "revoked"  # the seed carried the revocation into Redis
        assert await again.works(ADMIN)


async def test_a_rotated_out_secret_stays_refused_after_redis_loses_its_data(
        fleet: list[RunningSim], tmp_path: Path, redis_db: RedisServer) -> None:
    root = tmp_path / "a"
    async with replica(fleet, root, redis_db.url) as a:
        rotated = await a.admin("POST", "/keys/user-1/rotate", {"grace_s": 0})
        assert rotated.status_code == 200 and await a.works(rotated.json()["key"])
        assert not await a.works(USER)
    flushall(redis_db)
    async with replica(fleet, root, redis_db.url) as again:
        assert not await again.works(USER)  # the file's secret is the rotated-out one


async def test_a_running_replica_writes_lost_revocations_back_to_redis(
        fleet: list[RunningSim], tmp_path: Path, redis_db: RedisServer) -> None:
    async with replica(fleet, tmp_path / "a", redis_db.url) as a:
        assert (await a.admin("POST", "/keys/user-1/revoke")).status_code == 200
        flushall(redis_db)
        # a replica elsewhere: its own keys file, no revocation list; it seeds Redis again
        async with replica(fleet, tmp_path / "b", redis_db.url) as b:
            assert await until(lambda: _refuses(b, USER), 10)  # a wrote it back
            assert not await a.works(USER)
            assert (tmp_path / "b" / "keys.yaml.revoked").exists()  # b keeps it now too


async def test_the_list_is_checked_on_reload(fleet: list[RunningSim], tmp_path: Path,
                                             redis_db: RedisServer) -> None:
    root = tmp_path / "a"
    async with replica(fleet, root, redis_db.url) as a:
        assert await a.works(USER)
        (root / "keys.yaml.revoked").write_text(yaml.safe_dump({"revoked": [
            {"sha256": hash_key(USER), "id": "user-1", "at": "2020-01-01T00:00:00Z"}]}))
        assert (await a.admin("POST", "/reload")).status_code == 200
        assert not await a.works(USER)
        (root / "keys.yaml.revoked").write_text("revoked: [{bad: 1}]")
        assert (await a.admin("POST", "/reload")).status_code == 200
        health = a.keys.health()
        assert "invalid revocation list" in str(health["revocations_error"])
        assert not await a.works(USER)  # the last good list stays


async def test_an_unwritable_list_makes_the_revoke_a_503(
        fleet: list[RunningSim], tmp_path: Path, redis_db: RedisServer) -> None:
    blocked = tmp_path / "no-such-dir" / "revoked"
    async with replica(fleet, tmp_path / "a", redis_db.url,
                       revocations_file=str(blocked)) as a:
        refused = await a.admin("POST", "/keys/user-1/revoke")
        assert refused.status_code == 503, refused.text
        assert "revocation list" in refused.json()["error"]["message"]
        assert not await a.works(USER)  # revoked all the same
        assert "cannot be written" in str(a.keys.health()["revocations_write_error"])
        blocked.parent.mkdir()
        assert (await a.admin("POST", "/keys/user-1/revoke")).status_code == 200
        assert {r.id for r in parse_list(blocked.read_text(), "l").values()} == {"user-1"}
