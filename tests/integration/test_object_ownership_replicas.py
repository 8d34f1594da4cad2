"""Responses ids shared between replicas through one real Redis (``shared_state``).

Two gateway apps (replicas) in front of the same simulated engines, API keys on, sharing a
real redis-server: tenant acme's response created through replica 1 continues through replica 2
(``previous_response_id``, pinned to the engine that holds it) and is retrievable there; tenant
globex is refused on both, and nothing reaches an engine on its behalf. With Redis down,
replica 2 fails closed (503) for an id it does not hold, says so on /health and /metrics, and
resolves it once Redis is back; an id created during the outage is written when Redis returns.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

from kvgate.engines.sim.testing import RunningSim
from kvgate.middleware.app import KvgateApp
from tests.asyncq_helpers import until
from tests.integration.billing_helpers import Keys, billing_config, write_keys
from tests.integration.conftest import gateway
from tests.integration.test_object_ownership import MODEL, _acme_response, _finished
from tests.servers import RedisServer

Replica = tuple[KvgateApp, httpx.AsyncClient]


@contextlib.asynccontextmanager
async def replicas(fleet: list[RunningSim], tmp: Path, keys: Keys,
                   url: str) -> AsyncIterator[tuple[Replica, Replica]]:
    async with contextlib.AsyncExitStack() as stack:
        pair = []
        for name in ("r1", "r2"):
            (tmp / name).mkdir()
            data = billing_config([s.url for s in fleet], tmp / name, keys)
            data["shared_state"] = {"redis_url": url}
            pair.append(await stack.enter_async_context(gateway(data)))
        yield pair[0], pair[1]


def _turn(previous: str, text: str = "and then?") -> dict[str, object]:
    return {"model": MODEL, "input": text, "previous_response_id": previous,
            "max_output_tokens": 2}


async def test_a_response_continues_on_another_replica_and_no_other_tenant_sees_it(
        fleet: list[RunningSim], tmp_path: Path, redis_db: RedisServer) -> None:
    keys = write_keys(tmp_path)
    async with replicas(fleet, tmp_path, keys, redis_db.url) as ((_, c1), (app2, c2)):
        acme_id = await _acme_response(c1, keys)
        assert not app2.gateway.states.known(acme_id)  # only Redis knows it on replica 2
        before = await _finished(fleet)
        for client in (c2, c1):
            for method, path, body in (("POST", "/v1/responses", _turn(acme_id)),
                                       ("GET", f"/v1/responses/{acme_id}", None)):
                resp = await client.request(method, path, json=body, headers=keys.auth("user"))
                assert resp.status_code == 404, resp.text
                assert "buy globex" not in resp.text
        assert await _finished(fleet) == before, "globex's request reached an engine"
        own = await c2.post("/v1/responses", headers=keys.auth("admin"), json=_turn(acme_id))
        assert own.status_code == 200, own.text
        got = await c2.get(f"/v1/responses/{acme_id}", headers=keys.auth("admin"))
        assert got.status_code == 200 and got.json()["id"] == acme_id
        assert got.headers["x-kvgate-engine"] == own.headers["x-kvgate-engine"]
        assert app2.gateway.states.lookups["shared"] == 1  # cached after the first lookup
        # replica 2's answer is shared back: replica 1 continues it
        back = await c1.post("/v1/responses", headers=keys.auth("admin"),
                             json=_turn(own.json()["id"]))
        assert back.status_code == 200, back.text


async def test_redis_down_fails_closed_and_recovers(
        fleet: list[RunningSim], tmp_path: Path, redis_db: RedisServer) -> None:
    keys = write_keys(tmp_path)
    async with replicas(fleet, tmp_path, keys, redis_db.url) as ((app1, c1), (_, c2)):
        cached, unseen = await _acme_response(c1, keys), await _acme_response(c1, keys)
        ok = await c2.post("/v1/responses", headers=keys.auth("admin"), json=_turn(cached))
        assert ok.status_code == 200, ok.text  # replica 2 now holds ``cached`` itself
        await asyncio.to_thread(redis_db.stop)
        resp = await c2.post("/v1/responses", headers=keys.auth("admin"), json=_turn(unseen))
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["code"] == "state_store_unavailable"
        assert resp.headers["retry-after"] == "1"
        assert (await c2.post("/v1/responses", headers=keys.auth("admin"),
                              json=_turn(cached))).status_code == 200
        refused = await c2.post("/v1/responses", headers=keys.auth("user"), json=_turn(cached))
        assert refused.status_code == 404  # another tenant's: this replica knows its owner
        health = (await c2.get("/health", headers=keys.auth("admin"))).json()["state_ids"]
        assert health["ok"] is False and "Redis unavailable" in health["error"]
        assert "redis://" not in str(health)
        metrics = (await c2.get("/metrics", headers=keys.auth("admin"))).text
        assert "kvgate_state_ids_shared_up 0.0" in metrics
        during = await _acme_response(c1, keys)  # its write waits in replica 1's queue
        assert app1.gateway.states.shared is not None
        assert app1.gateway.states.health()["pending_writes"] == 1  # type: ignore[index]

        await asyncio.to_thread(redis_db.start)

        async def resolves(state_id: str) -> bool:
            r = await c2.post("/v1/responses", headers=keys.auth("admin"), json=_turn(state_id))
            return r.status_code == 200
        assert await until(lambda: resolves(unseen), 10)
        assert await until(lambda: resolves(during), 10)
        health = (await c2.get("/health", headers=keys.auth("admin"))).json()["state_ids"]
        assert health["ok"] is True and "error" not in health
