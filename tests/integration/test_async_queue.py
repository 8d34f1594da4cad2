"""The async-queue plugin through the gateway (create_app, in-process simulated engines, httpx
over ASGITransport, the real openai SDK): queued requests (202, results, errors, retries,
deadlines, cancel, tenant scoping), background responses, tier pricing in the ledger, metrics
and health."""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncIterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvgate.asyncq.api import Job, JobState
from kvgate.asyncq.plugin import AsyncQueue
from kvgate.asyncq.store.sqlite_store import SqliteJobStore
from kvgate.engines.sim.core.faults import FaultSpec
from kvgate.engines.sim.testing import RunningSim
from kvgate.middleware.app import KvgateApp, create_app
from kvgate.middleware.framework.composition.config import parse_config
from tests.asyncq_helpers import until
from tests.integration.billing_helpers import Keys, billing_config, ledger_rows, write_keys
from tests.integration.conftest import sim_fleet

CHAT: dict[str, Any] = {"model": "sim-model", "max_tokens": 4,
                        "messages": [{"role": "user", "content": "summarise the repo"}]}
Q = {"x-kvgate-queue": "true"}


def queue_of(app: KvgateApp) -> AsyncQueue:
    plugin = app.pipeline.plugins["async-queue"]
    assert isinstance(plugin, AsyncQueue)
    return plugin


def _config(urls: list[str], tmp: Path, keys: Keys, **queue: Any) -> dict[str, Any]:
    data = billing_config(urls, tmp, keys, tier_discounts={"queued": "0.5", "batch": "0.5"},
                          server={"retries": 0})
    params = {"backend": f"sqlite://{tmp}/jobs.sqlite", "poll_interval_s": 0.02,
              "reap_interval_s": 0.1, "backoff_s": 0.05,
              "management": {"data_dir": str(tmp / "async")}, **queue}
    data["plugins"] = [*data["plugins"], {"type": "async-queue", "params": params}]
    data["apis"] = {"responses": {"allow_background": True}}
    return data


@pytest.fixture
async def keys(tmp_path: Path) -> Keys:
    return write_keys(tmp_path)


async def _gateway(sims: list[RunningSim], tmp: Path, keys: Keys,
                   **queue: Any) -> AsyncIterator[tuple[KvgateApp, httpx.AsyncClient]]:
    app = create_app(parse_config(_config([s.url for s in sims], tmp, keys, **queue), "test"))
    async with app.running():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw",
                                     timeout=30) as client:
            yield app, client


@pytest.fixture
async def gw(tmp_path: Path, keys: Keys) -> AsyncIterator[tuple[KvgateApp, httpx.AsyncClient]]:
    async with sim_fleet(1) as sims:
        async for pair in _gateway(sims, tmp_path, keys):
            yield pair


async def _finished(app: KvgateApp, job_id: str) -> Job:
    queue = queue_of(app)

    async def done() -> Job | None:
        job = await queue.service.get(job_id)
        return job if job is not None and job.state not in (JobState.QUEUED,
                                                           JobState.RUNNING) else None
    return await until(done)


async def test_queued_request_runs_later_and_is_billed_once_at_the_tier(
        gw: tuple[KvgateApp, httpx.AsyncClient], keys: Keys) -> None:
    app, client = gw
    resp = await client.post("/v1/chat/completions", json=CHAT, headers={**Q, **keys.auth("user")})
    assert resp.status_code == 202, resp.text
    body = resp.json()
    assert body["object"] == "queued_request" and body["status"] == "queued"
    assert body["id"].startswith("qreq_")
    assert resp.headers["location"] == f"/v1/queue/requests/{body['id']}"
    job = await _finished(app, body["id"])
    assert job.state is JobState.SUCCEEDED and job.attempts == 1
    assert job.result is not None and job.result.status == 200
    answer = json.loads(job.result.body)
    assert answer["object"] == "chat.completion" and answer["usage"]["completion_tokens"] == 4
    assert job.result.engine == "sim-0"
    rows = await ledger_rows(app)
    record = rows[body["id"]]  # the job id is the ledger's request id
    assert record.service_tier == "queued" and record.tenant == "globex"
    gross = record.cost_input + record.cost_cached_input + record.cost_output
    # globex has a 25 % tenant discount; the queued tier halves what is left
    assert record.cost_discount == pytest.approx(gross * (1 - Decimal("0.75") * Decimal("0.5")),
                                                 abs=Decimal("1e-9"))
    live = await client.post("/v1/chat/completions", json=CHAT, headers=keys.auth("user"))
    assert (await ledger_rows(app))[live.headers["x-request-id"]].service_tier is None


@pytest.mark.parametrize(("headers", "param"), [
    ({"x-kvgate-queue": "maybe"}, "x-kvgate-queue"),
    ({**Q, "x-kvgate-queue-priority": "high"}, "x-kvgate-queue-priority"),
    ({**Q, "x-kvgate-queue-priority": "1000"}, "x-kvgate-queue-priority"),
    ({**Q, "x-kvgate-queue-deadline-s": "-5"}, "x-kvgate-queue-deadline-s"),
    ({**Q, "x-kvgate-queue-deadline-s": "soon"}, "x-kvgate-queue-deadline-s"),
    ({**Q, "x-kvgate-queue-deadline-s": "99999999"}, "x-kvgate-queue-deadline-s"),
])
async def test_bad_queue_headers_are_400(gw: tuple[KvgateApp, httpx.AsyncClient], keys: Keys,
                                         headers: dict[str, str], param: str) -> None:
    _, client = gw
    resp = await client.post("/v1/chat/completions", json=CHAT,
                             headers={**headers, **keys.auth("user")})
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == param


async def test_refused_requests_are_refused_before_queueing(
        gw: tuple[KvgateApp, httpx.AsyncClient], keys: Keys) -> None:
    app, client = gw
    no_key = await client.post("/v1/chat/completions", json=CHAT, headers=Q)
    assert no_key.status_code == 401
    narrow = await client.post("/v1/chat/completions", json=CHAT,
                               headers={**Q, **keys.auth("narrow")})
    assert narrow.status_code == 403
    assert await queue_of(app).store.counts() == {}


async def test_engine_4xx_fails_the_job_with_the_engines_body(
        gw: tuple[KvgateApp, httpx.AsyncClient], keys: Keys) -> None:
    app, client = gw
    bad = {**CHAT, "max_tokens": 10**9}
    resp = await client.post("/v1/chat/completions", json=bad, headers={**Q, **keys.auth("user")})
    job = await _finished(app, resp.json()["id"])
    assert job.state is JobState.FAILED and job.attempts == 1
    assert job.result is not None and job.result.status == 400
    assert json.loads(job.result.body)["error"]["message"]


async def test_engine_5xx_is_retried_with_backoff(tmp_path: Path, keys: Keys) -> None:
    async with sim_fleet(1) as sims:
        sims[0].faults.apply(FaultSpec(fail_next=2, status=503))
        async for app, client in _gateway(sims, tmp_path, keys, max_attempts=3):
            resp = await client.post("/v1/chat/completions", json=CHAT,
                                     headers={**Q, **keys.auth("user")})
            job = await _finished(app, resp.json()["id"])
            assert job.state is JobState.SUCCEEDED and job.attempts == 3
            metrics = (await client.get("/metrics", headers=keys.auth("admin"))).text
            assert 'kvgate_async_job_retries_total{kind="queued"} 2.0' in metrics
            rows = await ledger_rows(app)
            assert rows[job.spec.id].status == 200  # one record, the final attempt's


async def test_cancel_deadline_and_tenant_scoping(tmp_path: Path, keys: Keys) -> None:
    async with sim_fleet(1) as sims:
        sims[0].faults.apply(FaultSpec(delay_first_byte_s=1.0))
        async for app, client in _gateway(sims, tmp_path, keys, max_concurrency=1):
            user = {**Q, **keys.auth("user")}
            ids = []
            for extra in ({}, {}, {"x-kvgate-queue-deadline-s": "0.3"}):
                resp = await client.post("/v1/chat/completions", json=CHAT,
                                         headers={**user, **extra})
                ids.append(resp.json()["id"])
            queue = queue_of(app)
            other = await client.get(f"/v1/queue/requests/{ids[1]}",
                                     headers=keys.auth("admin"))
            assert other.status_code == 404  # another tenant's id
            cancelled = await client.delete(f"/v1/queue/requests/{ids[1]}",
                                            headers=keys.auth("user"))
            assert cancelled.status_code == 200, cancelled.text
            assert cancelled.json()["status"] == "cancelled"
            first = await _finished(app, ids[0])
            late = await _finished(app, ids[2])
            assert first.state is JobState.SUCCEEDED
            assert (await queue.service.get(ids[1])).state is JobState.CANCELLED  # type: ignore[union-attr]
            assert late.state is JobState.EXPIRED
            seen = (await client.get(f"/v1/queue/requests/{ids[0]}",
                                     headers=keys.auth("user"))).json()
            assert seen["status"] == "succeeded" and seen["result"]["status_code"] == 200
            assert seen["result"]["body"]["object"] == "chat.completion"
            expired = (await client.get(f"/v1/queue/requests/{ids[2]}",
                                        headers=keys.auth("user"))).json()
            assert expired["result"]["body"]["error"]["code"] == "expired"


async def test_background_response_with_the_openai_sdk(
        gw: tuple[KvgateApp, httpx.AsyncClient], keys: Keys) -> None:
    app, client = gw
    sdk = openai.AsyncOpenAI(api_key=keys.user, base_url="http://gw/v1", http_client=client)
    created = await sdk.responses.create(model="sim-model", input="write a haiku",
                                         background=True, max_output_tokens=8)
    assert created.status == "queued" and created.background is True
    assert created.id.startswith("resp_")

    async def completed() -> Any:
        got = await sdk.responses.retrieve(created.id)
        assert got.status in ("queued", "in_progress", "completed", "incomplete")
        return got if got.status in ("completed", "incomplete") else None
    done = await until(completed)
    assert done.id == created.id and done.output_text
    follow = await sdk.responses.create(model="sim-model", input="and another",
                                        previous_response_id=created.id, max_output_tokens=4)
    assert follow.status in ("completed", "incomplete") and follow.id != created.id
    rows = await ledger_rows(app)
    assert rows[created.id].service_tier == "background"


async def test_background_response_cancelled_while_queued(tmp_path: Path, keys: Keys) -> None:
    async with sim_fleet(1) as sims:
        sims[0].faults.apply(FaultSpec(delay_first_byte_s=1.0))
        async for _, client in _gateway(sims, tmp_path, keys, max_concurrency=1):
            sdk = openai.AsyncOpenAI(api_key=keys.user, base_url="http://gw/v1",
                                     http_client=client)
            await client.post("/v1/chat/completions", json=CHAT,
                              headers={**Q, **keys.auth("user")})  # holds the one slot
            created = await sdk.responses.create(model="sim-model", input="hi",
                                                 background=True)
            cancelled = await sdk.responses.cancel(created.id)
            assert cancelled.status == "cancelled" and cancelled.id == created.id
            assert (await sdk.responses.retrieve(created.id)).status == "cancelled"
            other = openai.AsyncOpenAI(api_key=keys.admin, base_url="http://gw/v1",
                                       http_client=client)
            with pytest.raises(openai.NotFoundError):
                await other.responses.retrieve(created.id)


async def test_metrics_and_health(gw: tuple[KvgateApp, httpx.AsyncClient], keys: Keys) -> None:
    app, client = gw
    resp = await client.post("/v1/chat/completions", json=CHAT, headers={**Q, **keys.auth("user")})
    await _finished(app, resp.json()["id"])
    await asyncio.sleep(0.2)
    metrics = (await client.get("/metrics", headers=keys.auth("admin"))).text
    assert 'kvgate_async_jobs_finished_total{kind="queued",outcome="succeeded"} 1.0' in metrics
    assert 'kvgate_async_jobs_started_total{kind="queued"} 1.0' in metrics
    assert "kvgate_async_store_up 1.0" in metrics
    assert 'kvgate_async_job_wait_seconds_count{kind="queued"} 1.0' in metrics
    health = (await client.get("/health", headers=keys.auth("admin"))).json()
    health = health["plugins"]["async-queue"]
    assert health["backend"] == "sqlite" and health["ok"] is True


async def _is_running(queue: AsyncQueue, job_id: str) -> bool:
    job = await queue.service.get(job_id)
    return job is not None and job.state is JobState.RUNNING


async def test_a_clean_stop_gives_claimed_jobs_back(tmp_path: Path, keys: Keys) -> None:
    async with sim_fleet(1) as sims:
        sims[0].faults.apply(FaultSpec(delay_first_byte_s=5.0))
        async for app, client in _gateway(sims, tmp_path, keys, max_concurrency=1):
            ids = [(await client.post("/v1/chat/completions", json=CHAT,
                                      headers={**Q, **keys.auth("user")})).json()["id"]
                   for _ in range(3)]
            await until(functools.partial(_is_running, queue_of(app), ids[0]))
        store = SqliteJobStore(tmp_path / "jobs.sqlite")
        await store.open()
        try:
            jobs = [await store.get(i) for i in ids]
        finally:
            await store.close()
    # the one in flight and the ones in the window are queued again, not left on a lease
    assert [j.state if j else None for j in jobs] == [JobState.QUEUED] * 3
