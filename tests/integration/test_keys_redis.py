"""Keys in Redis shared by two in-process gateways (replicas) over one real redis-server: the
first replica seeds Redis from its file and the second's file is then ignored; a key created
or revoked through one is honoured by the other; an admin reload reaches the other replica's
catalog; a Redis outage keeps the last good keys, refuses admin writes with a 503 in OpenAI's
shape, shows on /health and /metrics, and the revoke goes through once Redis is back."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import yaml

from kvgate.engines.sim.testing import RunningSim
from kvgate.plugins.tenancy.keys_model import hash_key, new_key
from tests.asyncq_helpers import until
from tests.integration.conftest import gateway, gateway_config
from tests.integration.test_keys_admin import ADMIN, USER, Gw
from tests.servers import RedisServer

ONLY_B = new_key()


@contextlib.asynccontextmanager
async def replica(sims: list[RunningSim], tmp: Path, name: str, redis_url: str,
                  extra_keys: list[dict[str, Any]], **params: Any) -> AsyncIterator[Gw]:
    root = tmp / name
    root.mkdir()
    (root / "keys.yaml").write_text(yaml.safe_dump({"keys": [
        {"id": "root", "tenant": "ops", "sha256": hash_key(ADMIN), "admin": True},
        {"id": "user-1", "tenant": "acme", "sha256": hash_key(USER)}, *extra_keys]}))
    (root / "catalog.yaml").write_text(yaml.safe_dump({"models": [
        {"name": "sim-model", "pool": {}}]}))
    data = gateway_config([s.url for s in sims])
    data["shared_state"] = {"redis_url": redis_url}  # the default of api-keys' redis_url
    data["plugins"] = [
        {"type": "catalog", "params": {"file": str(root / "catalog.yaml")}},
        {"type": "api-keys", "params": {"file": str(root / "keys.yaml"), "catalog": "catalog",
                                        "reload": ["catalog"], "poll_interval_s": 0.1,
                                        "redis_timeout_s": 0.5, **params}},
        *data["plugins"]]
    async with gateway(data) as (app, client):
        yield Gw(app, client, root)


async def _refuses(gw: Gw, key: str) -> bool:
    return not await gw.works(key)


async def test_two_replicas_share_keys_through_redis(fleet: list[RunningSim], tmp_path: Path,
                                                     redis_db: RedisServer) -> None:
    async with replica(fleet, tmp_path, "a", redis_db.url, []) as a, \
            replica(fleet, tmp_path, "b", redis_db.url,
                    [{"id": "only-b", "tenant": "b", "sha256": hash_key(ONLY_B)}],
                    watch_interval_s=3600) as b:
        assert await b.works(USER)
        assert not await b.works(ONLY_B)  # Redis was seeded by a: b's file is not used
        created = (await a.admin("POST", "/keys", {"tenant": "acme"})).json()
        assert await until(lambda: b.works(created["key"]), 10)
        assert (await b.admin("POST", f"/keys/{created['id']}/revoke")).status_code == 200
        assert not await b.works(created["key"])
        assert await until(lambda: _refuses(a, created["key"]), 10)

        (b.tmp / "catalog.yaml").write_text(yaml.safe_dump({"models": [
            {"name": "sim-model", "aliases": ["fresh"], "pool": {}}]}))
        assert (await a.admin("POST", "/reload")).json()["replicas_notified"] is True
        assert await until(lambda: b.works(USER, "fresh"), 10)  # b's file watch is off


async def test_redis_outage_keeps_the_last_good_keys(fleet: list[RunningSim], tmp_path: Path,
                                                     redis_db: RedisServer) -> None:
    async with replica(fleet, tmp_path, "a", redis_db.url, []) as a, \
            replica(fleet, tmp_path, "b", redis_db.url, []) as b:
        victim = (await a.admin("POST", "/keys", {"tenant": "acme"})).json()
        assert await until(lambda: b.works(victim["key"]), 10)
        await asyncio.to_thread(redis_db.stop)

        async def degraded() -> bool:
            health = (await b.client.get("/health", headers=b.auth(ADMIN))).json()
            health = health["plugins"]["api-keys"]
            return health.get("ok") is False and "Redis unavailable" in health["reload_error"]
        await until(degraded, 10)
        assert await b.works(USER) and await b.works(victim["key"])  # last good keys
        metrics = (await b.client.get("/metrics", headers=b.auth(ADMIN))).text
        assert "kvgate_config_reload_degraded 1.0" in metrics
        refused = await a.admin("POST", f"/keys/{victim['id']}/revoke")
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["code"] == "keys_store_unavailable"
        assert "redis://" not in refused.text
        assert await a.works(victim["key"])  # nothing changed

        await asyncio.to_thread(redis_db.start)
        assert (await a.admin("POST", f"/keys/{victim['id']}/revoke")).status_code == 200
        assert await until(lambda: _refuses(b, victim["key"]), 10)

        async def recovered() -> bool:  # its next reload (the refusal may come first)
            health = (await b.client.get("/health", headers=b.auth(ADMIN))).json()
            health = health["plugins"]["api-keys"]
            return "reload_error" not in health and health["store"] == "redis"
        assert await until(recovered, 10)
