"""Fault tests of the async queue: SIGKILL of a real ``kvgate serve`` process mid-queue
(SQLite): after a restart every job has exactly one result and one ledger record, some of them
run twice (at-least-once, billed once); a Redis outage pauses pulling, refuses submits with a
503 in OpenAI's shape, shows on /health and /metrics, is logged once, and loses nothing."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sqlite3
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
import yaml

from kvgate.asyncq.api import JobState
from kvgate.engines.sim.core.faults import FaultSpec
from kvgate.middleware.app import KvgateApp, create_app
from kvgate.middleware.framework.composition.config import parse_config
from tests.asyncq_helpers import PersistentRedis, until
from tests.integration.billing_helpers import PRICES_YAML, write_keys
from tests.integration.conftest import DEFAULT_PROFILE, FAST_POOL, gateway_config, sim_fleet
from tests.integration.test_async_queue import CHAT, Q, queue_of
from tests.servers import REDIS_SERVER, free_port, running_process

KVGATE = str(Path(sys.executable).with_name("kvgate"))
JOBS = 120


def _serve_config(tmp: Path, engines: list[str], keys: Path) -> Path:
    prices = tmp / "prices.yaml"
    prices.write_text(PRICES_YAML)
    data: dict[str, Any] = {
        "engines": [{"name": f"sim-{i}", "url": u} for i, u in enumerate(engines)],
        "pool": FAST_POOL, **DEFAULT_PROFILE,
    }
    data["plugins"] = [
        {"type": "api-keys", "params": {"file": str(keys)}},
        {"type": "billing", "params": {"prices": str(prices),
                                       "ledger": f"sqlite://{tmp}/ledger.sqlite",
                                       "spool": str(tmp / "spool")}},
        *data["plugins"],
        {"type": "async-queue", "params": {
            "backend": f"sqlite://{tmp}/jobs.sqlite", "lease_s": 2.0, "max_concurrency": 8,
            "reap_interval_s": 0.2, "management": None,
            "headroom": {"max_jobs_per_engine": 8}}},
    ]
    path = tmp / "kvgate.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _job_states(db: Path) -> dict[str, tuple[str, int, int | None]]:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return {r[0]: (r[1], r[2], r[3]) for r in conn.execute(
            "SELECT id, state, attempts, res_status FROM jobs")}


def _ledger(db: Path) -> dict[str, tuple[int, str | None, int]]:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return {r[0]: (r[1], r[2], r[3]) for r in conn.execute(
            "SELECT request_id, COUNT(*), MAX(service_tier), MAX(status) FROM kvgate_usage "
            "GROUP BY request_id")}


async def _submit(url: str, auth: dict[str, str]) -> list[str]:
    async with aiohttp.ClientSession() as session:
        async def one(i: int) -> str:
            body = {**CHAT, "max_tokens": 48,
                    "messages": [{"role": "user", "content": f"job {i}: explain it"}]}
            async with session.post(url + "/v1/chat/completions", json=body,
                                    headers={**Q, **auth}) as resp:
                assert resp.status == 202, await resp.text()
                return str((await resp.json())["id"])
        return list(await asyncio.gather(*(one(i) for i in range(JOBS))))


def test_sigkill_mid_queue_every_job_one_result_and_one_record(tmp_path: Path) -> None:
    keys = write_keys(tmp_path)
    ports = [free_port() for _ in range(3)]
    sims = [[sys.executable, "-m", "kvgate.engines.sim", "--port", str(p), "--time-scale", "1"]
            for p in ports[:2]]
    config = _serve_config(tmp_path, [f"http://127.0.0.1:{p}" for p in ports[:2]], keys.path)
    serve = [KVGATE, "serve", "--config", str(config), "--port", str(ports[2])]
    url = f"http://127.0.0.1:{ports[2]}"
    log = tmp_path / "kvgate.log"
    jobs_db = tmp_path / "jobs.sqlite"
    with contextlib.ExitStack() as stack:
        for i, port in enumerate(ports[:2]):
            stack.enter_context(running_process(
                sims[i], f"http://127.0.0.1:{port}/health", log=tmp_path / f"sim{i}.log"))
        with running_process(serve, url + "/health", log=log, limit_s=30) as gw:
            ids = asyncio.run(_submit(url, keys.auth("user")))

            async def some_done() -> bool:
                states = await asyncio.to_thread(_job_states, jobs_db)
                return sum(s == "succeeded" for s, _, _ in states.values()) >= 10
            asyncio.run(until(some_done, 30))
            os.kill(gw.pid, signal.SIGKILL)
            gw.wait()
        at_kill = _job_states(jobs_db)
        with running_process(serve, url + "/health", log=log, limit_s=30):
            async def all_done() -> bool:
                states = await asyncio.to_thread(_job_states, jobs_db)
                return all(s == "succeeded" for s, _, _ in states.values())
            asyncio.run(until(all_done, 60))
        # SIGTERM: a clean stop writes the ledger's spool
    states = _job_states(jobs_db)
    ledger = _ledger(tmp_path / "ledger.sqlite")
    running_at_kill = {i for i, (s, _, _) in at_kill.items() if s == "running"}
    print(f"{JOBS} jobs; at the kill: "
          f"{sum(s == 'succeeded' for s, _, _ in at_kill.values())} done, "
          f"{len(running_at_kill)} running; attempts after restart: "
          f"{sorted({a for _, a, _ in states.values()})}")
    assert set(states) == set(ids)
    assert all(s == "succeeded" and r == 200 for s, _, r in states.values())
    assert running_at_kill, "the kill came while jobs ran"
    assert all(states[i][1] >= 2 for i in running_at_kill)  # run again after the restart
    assert set(ledger) == set(ids)  # one record per job, none else ...
    assert all(n == 1 and tier == "queued" and status == 200
               for n, tier, status in ledger.values())  # ... exactly once, final


@pytest.fixture
def redis_db(tmp_path: Path) -> Any:
    if REDIS_SERVER is None:
        pytest.skip("redis-server not installed")
    server = PersistentRedis(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@contextlib.asynccontextmanager
async def _redis_gateway(urls: list[str], redis_url: str, tmp: Path, engine: str = "sim-0",
                         ) -> AsyncIterator[tuple[KvgateApp, httpx.AsyncClient]]:
    data = gateway_config(urls)
    data["engines"][0]["name"] = engine
    data["plugins"] = [*data["plugins"], {"type": "async-queue", "params": {
        "backend": redis_url, "lease_s": 1.5, "max_concurrency": 1, "poll_interval_s": 0.02,
        "reap_interval_s": 0.1, "management": None}}]
    app = create_app(parse_config(data, "test"))
    async with app.running():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw",
                                     timeout=30) as client:
            yield app, client


async def test_redis_outage_pauses_pulling_and_loses_nothing(
        redis_db: PersistentRedis, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvgate.asyncq.runner")
    async with sim_fleet(1) as sims, \
            _redis_gateway([sims[0].url], redis_db.url, tmp_path) as (app, client):
        sims[0].faults.apply(FaultSpec(delay_first_byte_s=0.4))
        queue = queue_of(app)
        ids = [(await client.post("/v1/chat/completions", json=CHAT, headers=Q)).json()["id"]
               for _ in range(4)]
        await asyncio.sleep(0.2)  # the first runs, three wait
        await asyncio.to_thread(redis_db.stop)
        refused = await client.post("/v1/chat/completions", json=CHAT, headers=Q)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "queue_unavailable"
        assert set(refused.json()["error"]) == {"message", "type", "param", "code"}

        async def down() -> bool:
            health = (await client.get("/health")).json()["plugins"]["async-queue"]
            return health["ok"] is False
        await until(down, 10)
        assert "kvgate_async_store_up 0.0" in (await client.get("/metrics")).text
        await asyncio.sleep(1.0)  # pulling stays paused (and logs no more)
        await asyncio.to_thread(redis_db.start)

        async def up() -> bool:  # until then a new request is refused (503, Retry-After)
            health = (await client.get("/health")).json()["plugins"]["async-queue"]
            return health["ok"] is True
        await until(up, 10)
        late = (await client.post("/v1/chat/completions", json=CHAT, headers=Q)).json()["id"]

        async def finished() -> bool:
            jobs = [await queue.service.get(i) for i in [*ids, late]]
            return all(j is not None and j.state is JobState.SUCCEEDED for j in jobs)
        await until(finished, 30)
        assert "kvgate_async_store_up 1.0" in (await client.get("/metrics")).text
    outages = [r for r in caplog.records if "job store unavailable" in r.getMessage()]
    assert len(outages) == 1, [r.getMessage() for r in outages]
    assert "kvgate_async_store_outages_total 1.0" in app.metrics.render().decode()


async def test_two_replicas_share_one_redis_queue(redis_db: PersistentRedis,
                                                  tmp_path: Path) -> None:
    async with sim_fleet(2) as sims:
        sims[0].faults.apply(FaultSpec(delay_first_byte_s=0.2))
        sims[1].faults.apply(FaultSpec(delay_first_byte_s=0.2))
        async with _redis_gateway([sims[0].url], redis_db.url, tmp_path) as (a, client), \
                _redis_gateway([sims[1].url], redis_db.url, tmp_path, "sim-1") as (b, _):
            ids = [(await client.post("/v1/chat/completions", json=CHAT,
                                      headers=Q)).json()["id"] for _ in range(8)]
            queue = queue_of(a)

            async def finished() -> list[Any] | None:
                jobs = [await queue.service.get(i) for i in ids]
                done = all(j is not None and j.state is JobState.SUCCEEDED for j in jobs)
                return jobs if done else None
            jobs = await until(finished, 30)
    # replica a only reaches sim-0, replica b only sim-1: both pulled from the one queue,
    # and each job ran once
    assert {j.result.engine for j in jobs} == {"sim-0", "sim-1"}
    assert all(j.attempts == 1 for j in jobs)
    assert queue_of(a).consumer != queue_of(b).consumer
