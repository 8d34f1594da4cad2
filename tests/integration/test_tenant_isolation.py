"""Tenant isolation through the gateway (in-process ASGI) in front of simulated engines that
publish real ZMQ KV events: with API keys on, ``cache-salt`` gives each tenant its own
``cache_salt``; the same long prompt from two tenants shares no cached tokens, each tenant's
repeat is cached and routed to the engine holding it, the precise predictions agree with what
the engines report (a salt-blind hash would predict the other tenant's blocks: ``over``), and
tenants of an opt-in sharing group share."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from kvgate.engines.sim.core.config import KvEventsConfig, SimConfig
from kvgate.engines.sim.testing import RunningSim, serve_sim
from kvgate.middleware.app import KvgateApp, create_app
from kvgate.middleware.framework.composition.config import parse_config
from kvgate.plugins.load.session_affinity import session_key
from kvgate.plugins.prefix.events.subscriber import KvEventsSubscriber
from kvgate.plugins.tenancy.auth import hash_key, new_key
from kvgate.plugins.tenancy.gateway_secret import SESSION_PURPOSE, GatewaySecret, session_digest
from tests.integration.billing_helpers import billing_config, ledger_rows, long_chat, write_keys
from tests.integration.conftest import gateway
from tests.servers import free_port

TENANTS = ("acme", "globex", "initech")
FAST_POOL = {"health_interval_s": 0.1, "metrics_interval_s": 0.1, "health_timeout_s": 1.0}
#: ~640 sim tokens: forty 16-token blocks
LONG = "You are the support assistant of a large company. " + "Policy clause words. " * 150


def _keys(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    keys = {t: new_key() for t in TENANTS}
    entries = [{"id": f"{t}-1", "tenant": t, "sha256": hash_key(k)} for t, k in keys.items()]
    path = tmp_path / "keys.yaml"
    path.write_text(yaml.safe_dump({"keys": entries}))
    return path, keys


def _config(urls: list[str], events: str, keys: Path, secret: Path) -> dict[str, Any]:
    return {
        "pool": FAST_POOL,
        "engines": [{"name": f"sim-{i}", "url": u} for i, u in enumerate(urls)],
        "plugins": [
            {"type": "api-keys", "params": {"file": str(keys)}},
            {"type": "cache-salt", "params": {"secret_file": str(secret),
                                              "share_groups": {"public": ["globex", "initech"]}}},
            {"type": "tokenizer", "params": {"tokenizer": {"kind": "module", "module": "sim"}}},
            {"type": "kv-events", "params": {"bind": events, "connect": False}},
            {"type": "prefix-cache-producer", "params": {"mode": "auto", "learned_ttl_s": 0}},
            {"type": "health-filter"}, {"type": "model-filter"},
            {"type": "prefix-cache-scorer"}, {"type": "least-in-flight-scorer"},
            {"type": "max-score-picker"},
        ],
        "profiles": [{"name": "default", "plugins": [
            {"ref": "health-filter"}, {"ref": "model-filter"},
            {"ref": "prefix-cache-scorer", "weight": 3},
            {"ref": "least-in-flight-scorer", "weight": 1}, {"ref": "max-score-picker"}]}],
    }


@contextlib.asynccontextmanager
async def _stack(tmp_path: Path, engines: int
                 ) -> AsyncIterator[tuple[list[RunningSim], KvgateApp, httpx.AsyncClient,
                                          dict[str, str]]]:
    events = f"tcp://127.0.0.1:{free_port()}"
    keys_file, keys = _keys(tmp_path)
    async with contextlib.AsyncExitStack() as stack:
        sims = [await stack.enter_async_context(serve_sim(SimConfig(
            engine_id=f"sim-{i}", time_scale=0, seed=i,
            kv_events=KvEventsConfig(endpoint=events, topic=f"kv@sim-{i}"))))
            for i in range(engines)]
        app = create_app(parse_config(_config([s.url for s in sims], events, keys_file,
                                              tmp_path / "secret"), "test"))
        await stack.enter_async_context(app.running())
        client = await stack.enter_async_context(httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=30))
        await _warm_up(sims, app)
        yield sims, app, client, keys


def _kv(app: KvgateApp) -> KvEventsSubscriber:
    plugin = app.pipeline.plugins["kv-events"]
    assert isinstance(plugin, KvEventsSubscriber)
    return plugin


async def _warm_up(sims: list[RunningSim], app: KvgateApp) -> None:
    """Until each sim's events reach the gateway's socket (earlier ones are dropped)."""
    for i, sim in enumerate(sims):
        async with httpx.AsyncClient(base_url=sim.url) as c:
            for _ in range(200):
                await c.post("/reset_prefix_cache")
                await asyncio.sleep(0.02)
                if _kv(app).health_state.last_event(f"sim-{i}") is not None:
                    break
            else:
                raise AssertionError(f"no KV events from sim-{i}")


async def _ask(client: httpx.AsyncClient, app: KvgateApp, key: str,
               user: str = "question") -> tuple[str, int]:
    """(engine, cached tokens reported) of one chat request; waits for its KV events."""
    before = _kv(app).index.stats.stored_blocks
    resp = await client.post("/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                             json={"model": "sim-model", "max_tokens": 2, "messages": [
                                 {"role": "system", "content": LONG},
                                 {"role": "user", "content": user}]})
    assert resp.status_code == 200, resp.text
    for _ in range(100):  # the engine stores at least the new last block
        if _kv(app).index.stats.stored_blocks > before:
            break
        await asyncio.sleep(0.02)
    cached = resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return resp.headers["x-kvgate-engine"], int(cached)


async def _predictions(app: KvgateApp) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in app.metrics_page().decode().splitlines():
        if line.startswith("kvgate_kv_predictions_total{"):
            head, value = line.rsplit(" ", 1)
            result = head.split('result="')[1].split('"')[0]
            out[result] = out.get(result, 0.0) + float(value)
    return out


async def test_one_engine_tenants_share_nothing_but_their_own(tmp_path: Path) -> None:
    async with _stack(tmp_path, 1) as (_, app, client, keys):
        assert (await _ask(client, app, keys["acme"]))[1] == 0
        assert (await _ask(client, app, keys["acme"], "again"))[1] > 500  # its own repeat
        assert (await _ask(client, app, keys["globex"]))[1] == 0  # same prompt, other tenant
        assert (await _ask(client, app, keys["globex"], "again"))[1] > 500
        assert (await _ask(client, app, keys["initech"], "third"))[1] > 500  # globex's group
        predictions = await _predictions(app)
        assert predictions.get("within_block", 0) == 5, predictions
        assert not predictions.get("over") and not predictions.get("under"), predictions


async def test_two_engines_prefix_routing_follows_the_salt(tmp_path: Path) -> None:
    async with _stack(tmp_path, 2) as (_, app, client, keys):
        home, _ = await _ask(client, app, keys["acme"])
        for turn in range(3):  # acme's repeats go where acme's blocks are, cached
            engine, cached = await _ask(client, app, keys["acme"], f"turn {turn}")
            assert (engine, cached > 500) == (home, True)
        other, cached = await _ask(client, app, keys["globex"])
        assert cached == 0  # wherever it went: acme's blocks are not globex's
        engine, cached = await _ask(client, app, keys["initech"], "shared")
        assert (engine, cached > 500) == (other, True)  # the group's blocks, found and routed
        predictions = await _predictions(app)
        assert not predictions.get("over") and not predictions.get("under"), predictions


async def test_ledger_stores_session_ids_as_keyed_digests(fleet: list[RunningSim],
                                                          tmp_path: Path) -> None:
    """A session header's value never reaches the ledger: its record holds ``hs1:`` + the
    HMAC of the session key with the gateway secret, which an operator recomputes."""
    keys = write_keys(tmp_path)
    secret = "x" * 40
    data = billing_config([s.url for s in fleet], tmp_path, keys,
                          plugins_before=[{"type": "session-affinity-scorer"}],
                          secret_file=str(tmp_path / "none"), secret_env="TEST_KVGATE_SECRET")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TEST_KVGATE_SECRET", secret)
        async with gateway(data) as (app, client):
            for i, session in enumerate(("conv-private-1", "conv-private-1", "conv-private-2")):
                resp = await client.post("/v1/chat/completions", json=long_chat(i), headers={
                    **keys.auth("user"), "x-session-id": session, "x-request-id": f"s{i}"})
                assert resp.status_code == 200
            rows = await ledger_rows(app)
    key = GatewaySecret(secret.encode(), "env").derive(SESSION_PURPOSE)
    want = [session_digest(key, session_key("globex", "sim-model", s))
            for s in ("conv-private-1", "conv-private-1", "conv-private-2")]
    assert [rows[f"s{i}"].session for i in range(3)] == want
    assert want[0] != want[2] and "none" not in _names(tmp_path)  # the env var was used
    assert b"conv-private" not in _all_bytes(tmp_path)  # ledger, spool: never in clear


def _names(root: Path) -> set[str]:
    return {p.name for p in root.iterdir()}


def _all_bytes(root: Path) -> bytes:
    return b"".join(p.read_bytes() for p in root.rglob("*") if p.is_file())


async def test_health_and_errors_show_no_engine_address_without_an_admin_key(
        fleet: list[RunningSim], tmp_path: Path) -> None:
    """/health with API keys on: only its status for anyone but an admin key, which gets the
    engines' URLs and the addresses quoted in errors; /v1/models and /metrics quote no address
    either. A client's 502 does not quote the engine's address."""
    keys = write_keys(tmp_path)  # admin: acme admin key; user: globex
    dead = f"http://127.0.0.1:{free_port()}"
    data = billing_config([*(s.url for s in fleet), dead], tmp_path, keys)
    data["server"] = {"retries": 0}
    async with gateway(data) as (_, client):
        for _ in range(40):  # until the dead engine's probe failed
            body = (await client.get("/health", headers=keys.auth("admin"))).json()
            if any(e["last_error"] for e in body["engines"]):
                break
            await asyncio.sleep(0.05)
        for headers in ({}, keys.auth("user"), {"authorization": "Bearer kvg-wrong"}):
            public = await client.get("/health", headers=headers)
            assert public.status_code == 200 and public.json() == {"status": "ok"}
        admin = (await client.get("/health", headers=keys.auth("admin"))).json()
        assert {e["url"] for e in admin["engines"]} == {*(s.url for s in fleet), dead}
        assert any("127.0.0.1" in (e["last_error"] or "") for e in admin["engines"])
        for path in ("/v1/models", "/metrics"):  # names and counters, no addresses
            assert "127.0.0.1" not in (await client.get(path, headers=keys.auth("admin"))).text
    direct = {"engines": [{"name": "e", "url": dead}], "plugins": [], "profiles": [
        {"name": "default", "plugins": [{"ref": "p"}]}]}
    direct["plugins"] = [{"type": "max-score-picker", "name": "p"}]
    direct["server"] = {"retries": 0}
    direct["pool"] = {"startup_probe_timeout_s": 0}
    async with gateway(direct) as (_, client):
        resp = await client.post("/v1/chat/completions", json=long_chat())
        assert resp.status_code == 502 and "127.0.0.1" not in resp.text, resp.text
        assert "cannot reach engine" in resp.text
