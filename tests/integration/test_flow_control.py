"""Flow control end to end (create_app + simulated engines in-process, httpx over ASGI):
priority order, shedding in each API's shape with Retry-After, exactly-once, a queued client
that leaves, key caps on the priority header, config validation and the quick-start default."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from kvgate.middleware.app import KvgateApp, create_app
from kvgate.middleware.framework.composition.config import parse_config
from kvgate.middleware.framework.composition.quickstart import config_from_engines
from kvgate.middleware.framework.errors import ConfigError
from kvgate.middleware.observe.access_log import LOGGER
from kvgate.plugins.flow.plugin import FlowControl
from kvgate.plugins.load.session_table import session_digest
from kvgate.plugins.tenancy.keys_model import hash_key, new_key
from tests.integration.conftest import gateway, gateway_config, sim_fleet

CHAT = "/v1/chat/completions"


def _body(text: str, max_tokens: int = 8, stream: bool = False) -> dict[str, Any]:
    return {"model": "sim-model", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": stream, "messages": [{"role": "user", "content": text}]}


def _flow_config(urls: list[str], **params: Any) -> dict[str, Any]:
    data = gateway_config(urls)
    data["plugins"].append({"type": "flow-control",
                            "params": {"max_in_flight_per_engine": 1, "learn": False,
                                       "reserve_fraction": 0, **params}})
    return data


def _flow(app: KvgateApp) -> FlowControl:
    plugin = next(p for p in app.pipeline.plugins.values() if isinstance(p, FlowControl))
    return plugin


async def _until(predicate: Callable[[], bool], limit_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + limit_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def _held(**params: Any) -> AsyncIterator[tuple[KvgateApp, httpx.AsyncClient, Any]]:
    """One engine, one slot, taken by a long request (the returned task) while the test runs."""
    async with sim_fleet(1, time_scale=0.2) as sims, \
            gateway(_flow_config([sims[0].url], **params)) as (app, client):
        hold = asyncio.create_task(client.post(CHAT, json=_body("hold", 400)))
        await _until(lambda: app.pool.snapshot()[0].in_flight_requests == 1)
        yield app, client, hold
        await hold


async def test_bands_leave_the_queue_by_priority() -> None:
    async with _held() as (app, client, _):
        flow, order = _flow(app), []

        async def send(band: str) -> None:
            resp = await client.post(CHAT, json=_body(band), headers={"x-kvgate-priority": band})
            assert resp.status_code == 200
            assert resp.headers["x-kvgate-priority"] == band
            order.append(band)
        tasks = []
        for n, band in enumerate(("batch", "standard", "interactive"), 1):
            tasks.append(asyncio.create_task(send(band)))
            await _until(lambda: flow.queued() == n)  # noqa: B023 - awaited in this turn
        await asyncio.gather(*tasks)
        assert order == ["interactive", "standard", "batch"]


@pytest.mark.parametrize(("api", "path", "body", "shape"), [
    ("openai", CHAT, _body("x"), lambda j: j["error"]["code"]),
    ("anthropic", "/v1/messages",
     {"model": "sim-model", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]},
     lambda j: (j["type"], j["error"]["type"])),
])
async def test_a_full_band_refuses_with_retry_after_in_the_api_shape(
        api: str, path: str, body: dict[str, Any], shape: Callable[[Any], Any]) -> None:
    async with _held(bands={"standard": {"max_queued": 1}}) as (app, client, _):
        waiting = asyncio.create_task(client.post(path, json=body))
        await _until(lambda: _flow(app).queued() == 1)
        refused = await client.post(path, json=body)
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == "1"
        expected = "queue_full" if api == "openai" else ("error", "rate_limit_error")
        assert shape(refused.json()) == expected
        assert (await waiting).status_code == 200
        metrics = (await client.get("/metrics")).text
        assert 'kvgate_flow_shed_total{band="standard",reason="queue_full",tenant="anonymous"}' \
            in metrics


async def test_ttl_expiry_refuses_and_nothing_is_dispatched(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    async with _held(bands={"standard": {"ttl_s": 0.2}}) as (app, client, _):
        engine_before = app.pool.snapshot()[0].in_flight_requests
        resp = await client.post(CHAT, json=_body("late"), headers={"x-request-id": "late-1"})
        line = next(json.loads(r.getMessage()) for r in caplog.records
                    if r.name == LOGGER and "late-1" in r.getMessage())
        assert line["flow_band"] == "standard" and line["flow_shed"] == "flow_ttl"
        assert line["flow_wait_ms"] >= 200
        # one tenant holding the whole fleet: its own excess -> 429
        assert resp.status_code == 429 and resp.json()["error"]["code"] == "flow_ttl"
        assert "retry-after" in resp.headers
        assert _flow(app).queued() == 0
        assert app.pool.snapshot()[0].in_flight_requests == engine_before


async def test_a_queued_client_that_leaves_is_dropped_and_never_dispatched() -> None:
    async with sim_fleet(1, time_scale=0.2) as sims, \
            gateway(_flow_config([sims[0].url])) as (app, client):
        engine = sims[0].engine
        hold = asyncio.create_task(client.post(CHAT, json=_body("hold", 300)))
        await _until(lambda: app.pool.snapshot()[0].in_flight_requests == 1)
        flow = _flow(app)
        gone = asyncio.create_task(client.post(CHAT, json=_body("gone", stream=True)))
        await _until(lambda: flow.queued() == 1)
        gone.cancel()  # the client leaves (ASGITransport sends http.disconnect)
        with pytest.raises(asyncio.CancelledError):
            await gone
        await _until(lambda: flow.queued() == 0)
        assert (await hold).status_code == 200
        await _until(lambda: flow.pending == 0 and not flow.queue.in_flight)
        metrics = (await client.get("/metrics")).text
        assert 'kvgate_flow_client_gone_total{band="standard"} 1.0' in metrics
        assert engine.scheduler.stats.finished["stop"] + engine.scheduler.stats.finished[
            "length"] == 1  # only the holding request reached the engine


async def test_every_admitted_request_completes_exactly_once() -> None:
    """40 concurrent requests through 2 slots: all answered once, the engines finished 40, and
    the gate's books are balanced at the end."""
    async with sim_fleet(2, time_scale=0.02) as sims, \
            gateway(_flow_config([s.url for s in sims])) as (app, client):
        flow = _flow(app)
        answers = await asyncio.gather(*(client.post(
            CHAT, json=_body(f"r{i}", 16, stream=i % 2 == 0),
            headers={"x-session-affinity": f"s{i % 5}"}) for i in range(40)))
        assert [r.status_code for r in answers] == [200] * 40
        finished = sum(s.engine.scheduler.stats.finished["length"] for s in sims)
        assert finished == 40
        assert flow.pending == 0 and flow.queued() == 0 and not flow.queue.in_flight
        health = (await client.get("/health")).json()["plugins"]["flow-control"]
        assert health["queued"]["standard"] == 0 and health["sessions"] == 5


async def test_a_request_that_waited_is_placed_on_the_fleet_as_it_is_then() -> None:
    """Late binding: 2 engines of 1 slot, 12 requests with one session (placement's pin) wait
    in the gateway; each is scheduled on the in-flight counts when it leaves the queue, not
    those of when it arrived (both engines busy then): no engine ever holds more than one."""
    async with sim_fleet(2, time_scale=0.05) as sims, \
            gateway(_flow_config([s.url for s in sims])) as (_, client):
        most = [0, 0]
        done = asyncio.Event()

        async def watch() -> None:
            while not done.is_set():
                for i, sim in enumerate(sims):
                    held = sim.engine.num_running + sim.engine.num_waiting
                    most[i] = max(most[i], held)
                await asyncio.sleep(0.002)
        watcher = asyncio.create_task(watch())
        answers = await asyncio.gather(*(client.post(
            CHAT, json=_body(f"same prompt {i}", 24), headers={"x-session-affinity": "s"})
            for i in range(12)))
        done.set()
        await watcher
        assert [r.status_code for r in answers] == [200] * 12
        assert most == [1, 1]


def _keys(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    secrets = {"capped": new_key(), "vip": new_key()}
    entries = [
        {"id": "capped-1", "tenant": "t1", "sha256": hash_key(secrets["capped"]),
         "max_priority": "standard"},
        {"id": "vip-1", "tenant": "t2", "sha256": hash_key(secrets["vip"]),
         "priority": "interactive"},
    ]
    path = tmp_path / "keys.yaml"
    path.write_text(yaml.safe_dump({"keys": entries}))
    return path, secrets


@pytest.mark.parametrize(("key", "header", "status", "band"), [
    ("capped", "interactive", 200, "standard"),  # capped by the key's max_priority
    ("capped", None, 200, "standard"),
    ("capped", "batch", 200, "batch"),
    ("vip", None, 200, "interactive"),  # the key's default band
    ("vip", "urgent", 400, None),
])
async def test_priority_header_is_capped_by_the_key(
        tmp_path: Path, key: str, header: str | None, status: int, band: str | None) -> None:
    path, secrets = _keys(tmp_path)
    async with sim_fleet(1) as sims:
        data = _flow_config([sims[0].url], max_in_flight_per_engine=8)
        data["plugins"].insert(0, {"type": "api-keys", "params": {"file": str(path)}})
        async with gateway(data) as (_, client):
            headers = {"authorization": f"Bearer {secrets[key]}"}
            if header is not None:
                headers["x-kvgate-priority"] = header
            resp = await client.post(CHAT, json=_body("p"), headers=headers)
            assert resp.status_code == status
            assert resp.headers.get("x-kvgate-priority") == band


@pytest.mark.parametrize(("params", "message"), [
    ({"bands": {"urgent": {}}}, "unknown band"),
    ({"max_kv_usage": 1.5}, "max_kv_usage"),
    ({"default_band": "background"}, "default_band"),
    ({"typo": True}, "typo"),
])
def test_bad_params_fail_at_startup(params: dict[str, Any], message: str) -> None:
    data = gateway_config(["http://127.0.0.1:1"])
    data["plugins"].append({"type": "flow-control", "params": params})
    with pytest.raises(ConfigError, match=message):
        create_app(parse_config(data, "test"))


def test_flow_control_is_on_in_the_quick_start() -> None:
    config = config_from_engines(["http://127.0.0.1:1"])
    assert any(p.type == "flow-control" for p in config.plugins)
    app = create_app(config)
    assert len(app.pipeline.gates) == 1


async def test_replicas_share_the_tenants_served_tokens(redis_db: Any) -> None:
    """Two replicas on one Redis: what tenant A was served through replica 1 raises A's
    counter on replica 2, so replica 2 puts B first."""
    async with sim_fleet(1) as sims:
        data = _flow_config([sims[0].url], max_in_flight_per_engine=8,
                            redis_url=redis_db.url, share_interval_s=0.05)
        async with gateway(data) as (app1, c1), gateway(data) as (app2, _):
            one, two = _flow(app1), _flow(app2)
            answers = await asyncio.gather(*(c1.post(CHAT, json=_body(f"a{i}", 32))
                                             for i in range(4)))
            assert all(r.status_code == 200 for r in answers)
            served = one.fair.own["anonymous"]
            assert served > 0
            await _until(lambda: two.fair.counter("anonymous") >= served)
            assert two.fair.counter("anonymous") > two.fair.counter("B")
            health = (await c1.get("/health")).json()["plugins"]["flow-control"]
            assert health["shared_load"] == "ok"
            metrics = (await c1.get("/metrics")).text
            assert "kvgate_flow_shared_down 0.0" in metrics


async def test_replicas_share_each_sessions_service(redis_db: Any) -> None:
    """A session served through replica 1 has that service on replica 2 too (least attained
    service ranks it by its whole service there), keyed by a digest: the session id never
    reaches Redis; /health and /metrics say so; Redis killed: degraded, requests still served."""
    async with sim_fleet(1) as sims:
        data = _flow_config([sims[0].url], max_in_flight_per_engine=8,
                            redis_url=redis_db.url, share_interval_s=0.05)
        async with gateway(data) as (app1, c1), gateway(data) as (app2, c2):
            one, two = _flow(app1), _flow(app2)
            for turn in range(2):
                resp = await c1.post(CHAT, json=_body(f"turn {turn}", 16),
                                     headers={"x-session-affinity": "agent-7"})
                assert resp.status_code == 200
            digest = session_digest("agent-7")
            served = one.fair.attained("anonymous", digest)
            assert served > 0
            await _until(lambda: two.fair.attained("anonymous", digest) == served)
            assert two.fair.attained("anonymous", session_digest("other")) == 0
            health = (await c2.get("/health")).json()["plugins"]["flow-control"]
            assert health["shared_sessions"] == "ok"
            metrics = (await c2.get("/metrics")).text
            assert 'kvgate_flow_shared_sessions_items_total{outcome="received"} 2.0' in metrics
            assert "kvgate_flow_shared_sessions_down 0.0" in metrics
            redis_db.stop()
            resp = await c1.post(CHAT, json=_body("turn 3", 16),
                                 headers={"x-session-affinity": "agent-7"})
            assert resp.status_code == 200
            assert one.fair.attained("anonymous", digest) > served
            await _until(lambda: one.shared is not None and one.shared.sessions is not None
                         and one.shared.sessions.stats.down)
            health = (await c1.get("/health")).json()["plugins"]["flow-control"]
            assert health["shared_sessions"].startswith("degraded")


@pytest.mark.parametrize("share_limits", [True, False])
async def test_replicas_share_an_engines_limit_by_demand(redis_db: Any,
                                                         share_limits: bool) -> None:
    """Two replicas on one Redis in front of an engine of 4 seats, 12 requests through the
    first: sharing the limits (the default), it learns the engine's limit for the fleet and
    takes it, and the idle replica keeps only its next request's slot; /health and /metrics
    show the fleet's limit and the demand. Not sharing, the idle replica keeps its own limit
    (its share of what it saw the engine queue), far above what the engine has free."""
    async with sim_fleet(1, max_num_seqs=4, time_scale=1.0) as sims:
        data = gateway_config([sims[0].url])
        data["plugins"].append({"type": "flow-control", "params": {
            "redis_url": redis_db.url, "share_interval_s": 0.05, "reserve_fraction": 0,
            "share_limits": share_limits}})
        async with gateway(data) as (app1, c1), gateway(data) as (app2, c2):
            one, two = _flow(app1), _flow(app2)
            busy = [asyncio.create_task(c1.post(CHAT, json=_body(f"q{i}", 300)))
                    for i in range(12)]

            def limits(flow: FlowControl) -> tuple[int, int]:
                view = flow.current_view()
                assert view is not None
                return view.engines[0].limit, view.engines[0].learned

            # learning happens as the gate reads the fleet (an admission, a pump, a scrape)
            await _until(lambda: limits(one)[1] == 4)  # the engine queued: cut to its batch
            await _until(lambda: limits(two)[1] < 32)  # seen there too
            if share_limits:
                await _until(lambda: two.saturation.peers is not None
                             and two.saturation.peers.demand >= 4)
                assert limits(one) == (4, 4)  # the fleet's limit, all of it here
                # (a scrape read before the other's in-flight count cut less: the next cut)
                await _until(lambda: limits(two) == (1, 4))
                health = (await c2.get("/health")).json()["plugins"]["flow-control"]
                assert health["fleet_limits"] == {"sim-0": 4}
                assert health["demand"]["others"] >= 4
                metrics = (await c2.get("/metrics")).text
                assert 'kvgate_flow_engine_learned_limit{engine="sim-0"} 4.0' in metrics
                assert 'kvgate_flow_engine_limit{engine="sim-0"} 1.0' in metrics
            else:
                assert two.saturation.peers is None
                assert limits(two)[0] >= 8
            answers = await asyncio.gather(*busy)
            assert all(r.status_code == 200 for r in answers)


async def test_no_healthy_engine_is_a_503_at_once_not_a_wait() -> None:
    """With every engine out of rotation there is no headroom to wait for: the request is not
    queued (a client would wait out the band's TTL) but answered by the dispatcher's 503."""
    async with _held(bands={"standard": {"ttl_s": 30}}) as (app, client, _):
        app.pool.report_failure(app.pool.snapshot()[0].id, "test: engine gone")
        resp = await asyncio.wait_for(client.post(CHAT, json=_body("x")), timeout=5)
        assert resp.status_code == 503
        assert _flow(app).queued() == 0
