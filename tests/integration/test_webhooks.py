"""Webhooks (asyncq/webhooks.py) delivered to a real aiohttp receiver on a loopback port; the
receiver checks every signature with the ``openai`` SDK's Standard Webhooks verifier."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest

from kvgate.asyncq.api import JobSpec
from kvgate.asyncq.batch.mgmt import ManagementSettings, build_management_app, plane_of
from kvgate.asyncq.webhooks import sign
from tests.integration.batch_helpers import MemoryQueue
from tests.integration.test_batches_api import CHAT, echo, jsonl, line, sdk, wait_status
from tests.servers import free_port

SECRET = "whsec_" + base64.b64encode(random.Random(3).randbytes(32)).decode()
OTHER_SECRET = "whsec_" + base64.b64encode(random.Random(4).randbytes(32)).decode()


@dataclass
class Receiver:
    """Answers ``fail_first`` attempts with 500, then 200; keeps what it verified."""

    fail_first: int = 0
    attempts: int = 0
    events: list[dict[str, Any]] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    bad_signatures: int = 0

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.attempts += 1
        headers = {k.lower(): v for k, v in request.headers.items()}
        verifier = openai.OpenAI(api_key="unused", webhook_secret=SECRET)
        try:
            verifier.webhooks.verify_signature(body, headers)
        except openai.InvalidWebhookSignatureError:
            self.bad_signatures += 1
            return web.Response(status=400)
        with pytest.raises(openai.InvalidWebhookSignatureError):
            verifier.webhooks.verify_signature(body, headers, secret=OTHER_SECRET)
        self.ids.append(headers["webhook-id"])
        if self.attempts <= self.fail_first:
            return web.Response(status=500)
        self.events.append(json.loads(body))
        return web.Response(status=200)


@contextlib.asynccontextmanager
async def receiver(rx: Receiver, port: int | None = None) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/hook", rx.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = port or free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}/hook"
    finally:
        await runner.cleanup()


def settings(tmp: Path, url: str, **hooks: Any) -> ManagementSettings:
    return ManagementSettings(data_dir=str(tmp), finalize_interval_s=0.2, webhooks={
        "endpoints": {"acme": {"url": url, "secret": SECRET}},
        "backoff_base_s": 0.05, "backoff_max_s": 0.2, "poll_interval_s": 0.05, **hooks})


async def until(cond: Any, limit_s: float = 10.0) -> None:
    deadline = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def test_signature_matches_the_standard_webhooks_vector() -> None:
    """The Standard Webhooks spec's published example."""
    secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
    body = b'{"test": 2432232314}'
    assert sign(secret, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body) == \
        "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


async def test_batch_and_request_events_are_signed_retried_and_delivered(
        tmp_path: Path) -> None:
    rx = Receiver(fail_first=2)
    queue = MemoryQueue()
    async with receiver(rx) as url:
        app = build_management_app(queue, settings(tmp_path, url))
        plane = plane_of(app)
        async with plane.running():
            client = sdk(app)
            f = await client.files.create(file=("in.jsonl", jsonl([line("a"), line("b")])),
                                          purpose="batch")
            batch = await client.batches.create(input_file_id=f.id, endpoint=CHAT,
                                                completion_window="24h")
            await queue.run(echo)
            await wait_status(client, batch.id, {"completed"})
            spec = JobSpec(id="q-1", kind="queued", method="POST", path=CHAT,
                           body=json.dumps(line("q")["body"]).encode(), tenant="acme",
                           key_id="key-acme", created_at=time.time(), deadline=None)
            await queue.submit([spec])
            await queue.run(echo)
            await until(lambda: len(rx.events) == 4)
            registry = CollectorRegistry()
            registry.register(plane.collector())
            metrics = generate_latest(registry).decode()
    assert rx.bad_signatures == 0
    # delivery is concurrent and retried, so not ordered (receivers order by created_at)
    assert sorted((e["type"], e["data"]["id"]) for e in rx.events) == [
        ("batch.completed", batch.id), ("request.queued", "q-1"), ("request.running", "q-1"),
        ("request.succeeded", "q-1")]
    assert all(e["object"] == "event" and e["id"].startswith("evt_") for e in rx.events)
    assert len({e["id"] for e in rx.events}) == 4
    # two failed attempts were sent again under the same webhook-id
    assert rx.attempts == 6 and sorted(rx.ids) == sorted([e["id"] for e in rx.events] + rx.ids[:2])
    assert set(rx.ids[:2]) <= {e["id"] for e in rx.events}
    assert 'kvgate_webhook_events_total{outcome="delivered"} 4.0' in metrics
    assert 'kvgate_webhook_events_total{outcome="attempt_failed"} 2.0' in metrics
    assert 'kvgate_batches_finished_total{status="completed"} 1.0' in metrics


async def test_events_survive_a_restart_and_give_up_after_max_attempts(
        tmp_path: Path) -> None:
    queue = MemoryQueue()
    rx = Receiver()
    async with receiver(rx) as url:
        port = int(url.rsplit(":", 1)[1].split("/")[0])
    # the receiver is down: the event stays in the outbox while the gateway stops
    first = build_management_app(queue, settings(tmp_path, url))
    async with plane_of(first).running() as plane:
        await plane.webhooks.emit("acme", "batch.completed", {"id": "batch_1"})
        await until(lambda: plane.webhooks.counters.attempts_failed >= 1)
    assert rx.events == []
    async with receiver(rx, port):
        second = plane_of(build_management_app(queue, settings(tmp_path, url)))
        async with second.running():
            await until(lambda: len(rx.events) == 1)
    assert rx.events[0]["type"] == "batch.completed"
    assert rx.events[0]["data"] == {"id": "batch_1"}
    # an endpoint that never answers 2xx: given up after max_attempts, kept as failed
    rx_fail = Receiver(fail_first=10**6)
    async with receiver(rx_fail) as bad_url:
        third = plane_of(build_management_app(
            queue, settings(tmp_path / "b", bad_url, max_attempts=3)))
        async with third.running():
            await third.webhooks.emit("acme", "batch.failed", {"id": "batch_2"})
            await third.webhooks.emit("nobody", "batch.failed", {"id": "batch_3"})
            await until(lambda: third.webhooks.counters.failed == 1)
            assert third.webhooks.counters.enqueued == 1
    assert rx_fail.attempts == 3 and rx_fail.bad_signatures == 0
