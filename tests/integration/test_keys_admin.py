"""The key administration API in-process (plugins/tenancy/keys_admin.py over the api-keys plugin):
401/403 in OpenAI's shape, every operation through httpx with the openai SDK as the client
whose key is managed, the secret shown once, a revoke refused at once on the same replica, a
rotation's grace period, the keys file, the catalog and the price book reloaded on change with
the last good version kept on a bad edit, and schemathesis over the app's own OpenAPI."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from kvgate.engines.sim.testing import RunningSim
from kvgate.middleware.app import KvgateApp
from kvgate.plugins.tenancy.auth import ApiKeys
from kvgate.plugins.tenancy.keys_model import KeyEntry, KeysFile, hash_key, new_key
from kvgate.plugins.tenancy.keys_store import update_file
from tests.asyncq_helpers import until
from tests.integration.conftest import gateway, gateway_config

ADMIN, USER = new_key(), new_key()
CHAT: dict[str, Any] = {"model": "sim-model", "max_tokens": 2,
                        "messages": [{"role": "user", "content": "hi"}]}
PRICES = "models:\n  sim-model: {input_per_mtok: '0.60', cached_input_per_mtok: '0.10', " \
         "output_per_mtok: '3.00'}\n"


@dataclass
class Gw:
    app: KvgateApp
    client: httpx.AsyncClient
    tmp: Path

    def auth(self, key: str) -> dict[str, str]:
        return {"authorization": f"Bearer {key}"}

    async def admin(self, method: str, path: str, body: Any = None) -> httpx.Response:
        return await self.client.request(method, "/v1/admin" + path, json=body,
                                         headers=self.auth(ADMIN))

    def sdk(self, key: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url="http://gw/v1", api_key=key, max_retries=0,
                                  http_client=self.client)

    async def works(self, key: str, model: str = "sim-model") -> bool:
        try:
            await self.sdk(key).chat.completions.create(**{**CHAT, "model": model})
        except openai.AuthenticationError:
            return False
        except openai.NotFoundError:
            if model == "sim-model":
                raise
            return False
        return True

    @property
    def keys(self) -> ApiKeys:
        plugin = self.app.pipeline.plugins["api-keys"]
        assert isinstance(plugin, ApiKeys)
        return plugin


def _write_keys(path: Path) -> None:
    path.write_text(yaml.safe_dump({"keys": [
        {"id": "root", "tenant": "ops", "sha256": hash_key(ADMIN), "admin": True},
        {"id": "user-1", "tenant": "acme", "sha256": hash_key(USER)}]}))


@contextlib.asynccontextmanager
async def admin_gateway(sims: list[RunningSim], tmp: Path) -> AsyncIterator[Gw]:
    keys, catalog, prices = tmp / "keys.yaml", tmp / "catalog.yaml", tmp / "prices.yaml"
    _write_keys(keys)
    catalog.write_text(yaml.safe_dump({"models": [
        {"name": "sim-model", "aliases": ["sim"], "pool": {}}]}))
    prices.write_text(PRICES)
    data = gateway_config([s.url for s in sims])
    data["plugins"] = [
        {"type": "catalog", "params": {"file": str(catalog), "prices": str(prices)}},
        {"type": "api-keys", "params": {"file": str(keys), "catalog": "catalog",
                                        "watch_interval_s": 0.05}},  # reload: the default
        *data["plugins"]]
    async with gateway(data) as (app, client):
        yield Gw(app, client, tmp)


@pytest.fixture
async def gw(fleet: list[RunningSim], tmp_path: Path) -> AsyncIterator[Gw]:
    async with admin_gateway(fleet, tmp_path) as g:
        yield g


AUTH_CASES = [
    ("no key", None, 401, "invalid_api_key"),
    ("unknown key", "kvg-unknown", 401, "invalid_api_key"),
    ("not an admin", USER, 403, "admin_key_required"),
    ("admin", ADMIN, 200, None),
]


async def test_admin_keys_only(gw: Gw) -> None:
    """One gateway for the whole table (startup is the slow part)."""
    for case, key, status, code in AUTH_CASES:
        for method, path in (("GET", "/v1/admin/keys"), ("POST", "/v1/admin/reload")):
            resp = await gw.client.request(method, path,
                                           headers={} if key is None else gw.auth(key))
            assert resp.status_code == status, (case, path, resp.text)
            if code is not None:
                error = resp.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}
                assert error["code"] == code, case
    schema = (await gw.client.get("/v1/admin/openapi.json")).json()  # no key needed
    assert "/v1/admin/keys/{key_id}/rotate" in schema["paths"]


async def test_key_lifecycle(gw: Gw) -> None:
    created = await gw.admin("POST", "/keys", {"tenant": "acme", "models": ["sim"],
                                                "limits": {"requests_per_min": 60}})
    assert created.status_code == 200, created.text
    body = created.json()
    secret, key_id = body["key"], body["id"]
    assert key_id == "acme-3" and body["models"] == ["sim"] and body["status"] == "active"
    assert await gw.works(secret)
    assert gw.keys.principal_for(key_id).models == frozenset({"sim-model"})  # type: ignore[union-attr]
    # the secret is shown once: never listed, never stored
    listed = await gw.admin("GET", "/keys")
    one = await gw.admin("GET", f"/keys/{key_id}")
    for text in (listed.text, one.text, (gw.tmp / "keys.yaml").read_text()):
        assert secret not in text and '"key"' not in text
    assert "sha256" not in listed.text + one.text
    assert [k["id"] for k in listed.json()["data"]] == ["root", "user-1", key_id]

    patched = await gw.admin("PATCH", f"/keys/{key_id}", {
        "budget_usd": "12.50", "limits": {"max_concurrent": 2}})
    assert patched.json()["budget_usd"] == "12.50"
    principal = gw.keys.principal_for(key_id)
    assert principal is not None and principal.budget_usd == Decimal("12.50")
    assert principal.limits.max_concurrent == 2 and principal.limits.requests_per_min is None
    tenant = await gw.admin("PUT", "/tenants/acme", {"budget_usd": "100",
                                                      "limits": {"requests_per_min": 10}})
    assert tenant.status_code == 200, tenant.text
    principal = gw.keys.principal_for(key_id)
    assert principal is not None and principal.tenant_budget_usd == Decimal("100")
    assert principal.tenant_limits.requests_per_min == 10

    rotated = (await gw.admin("POST", f"/keys/{key_id}/rotate", {"grace_s": 3600})).json()
    assert rotated["id"] == key_id and rotated["previous_valid_until"] is not None
    assert await gw.works(secret) and await gw.works(rotated["key"])  # grace period
    again = (await gw.admin("POST", f"/keys/{key_id}/rotate")).json()
    assert not await gw.works(secret) and not await gw.works(rotated["key"])
    assert await gw.works(again["key"])

    revoked = await gw.admin("POST", f"/keys/{key_id}/revoke")
    assert revoked.json()["status"] == "revoked"
    assert not await gw.works(again["key"])  # at once, on this replica
    assert gw.keys.principal_for(key_id) is None


ERROR_CASES = [
    ("unknown model", "POST", "/keys", {"tenant": "acme", "models": ["nope"]}, 400),
    ("id taken", "POST", "/keys", {"tenant": "acme", "id": "user-1"}, 409),
    ("bad tenant", "POST", "/keys", {"tenant": "a b"}, 400),
    ("extra field", "POST", "/keys", {"tenant": "acme", "sha256": "0" * 64}, 400),
    ("negative budget", "PATCH", "/keys/user-1", {"budget_usd": "-1"}, 400),
    ("no such key", "POST", "/keys/ghost/revoke", None, 404),
    ("bad grace", "POST", "/keys/user-1/rotate", {"grace_s": -1}, 400),
    ("bad limits", "PUT", "/tenants/acme", {"limits": {"requests_per_min": 0}}, 400),
    ("no such path", "GET", "/nothing", None, 404),
    ("wrong method", "DELETE", "/keys", None, 405),
]


async def test_admin_errors_are_openai_shaped(gw: Gw) -> None:
    before = (gw.tmp / "keys.yaml").read_text()
    for case, method, path, body, status in ERROR_CASES:
        resp = await gw.admin(method, path, body)
        assert resp.status_code == status, (case, resp.text)
        error = resp.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], case
    assert (gw.tmp / "keys.yaml").read_text() == before  # nothing written


async def test_keys_file_edit_reloads_and_a_bad_edit_keeps_the_last_good(gw: Gw) -> None:
    path, extra = gw.tmp / "keys.yaml", new_key()
    update_file(path, lambda kf: kf.model_copy(update={"keys": (*kf.keys, KeyEntry(
        id="hand-1", tenant="acme", sha256=hash_key(extra)))}))
    assert await until(lambda: gw.works(extra), 10)

    async def degraded(why: str) -> bool:
        health = (await gw.client.get("/health", headers=gw.auth(ADMIN))).json()
        health = health["plugins"]["api-keys"]
        return health.get("ok") is False and why in health["reload_error"]
    path.write_text("")  # a writer that truncated the file and has not written yet
    assert await until(lambda: degraded("keys file is empty"), 10)
    assert await gw.works(extra) and await gw.works(USER)  # not read as "no keys"
    path.write_text("keys: [{id: broken")
    assert await until(lambda: degraded("invalid keys file"), 10)
    assert await gw.works(extra) and await gw.works(USER)  # the last good keys serve
    metrics = (await gw.client.get("/metrics", headers=gw.auth(ADMIN))).text
    assert "kvgate_config_reload_degraded 1.0" in metrics
    write = await gw.admin("POST", "/keys", {"tenant": "acme"})
    assert write.status_code == 503 and write.json()["error"]["code"] == "keys_store_unavailable"
    _write_keys(path)  # fixed (and hand-1 removed)
    assert await until(lambda: _not(gw.works(extra)), 10)
    health = (await gw.client.get("/health", headers=gw.auth(ADMIN))).json()
    health = health["plugins"]["api-keys"]
    assert "reload_error" not in health and health["reloads"] >= 2


async def _not(probe: Any) -> bool:
    return not await probe


async def test_catalog_and_prices_reload_on_change_and_admin_call(gw: Gw) -> None:
    catalog, prices = gw.tmp / "catalog.yaml", gw.tmp / "prices.yaml"
    catalog.write_text(yaml.safe_dump({"models": [
        {"name": "sim-model", "aliases": ["sim", "fresh"], "pool": {}}]}))
    assert await until(lambda: gw.works(USER, "fresh"), 10)
    prices.write_text(PRICES.replace("'3.00'", "'4.00'"))

    async def repriced() -> bool:
        card = (await gw.client.get("/v1/models/sim-model", headers=gw.auth(USER))).json()
        return bool(card["pricing"]["output_per_mtok"] == "4")
    await until(repriced, 10)
    catalog.write_text(yaml.safe_dump({"models": [
        {"name": "sim-model", "pool": {"engines": ["no-such-engine"]}}]}))
    answer = await gw.admin("POST", "/reload")
    assert answer.json() == {"object": "admin.reload", "replicas_notified": False,
                             "reloaded": {"keys": True, "catalog": False}}
    assert await gw.works(USER, "fresh")  # the last good catalog serves
    health = (await gw.client.get("/health", headers=gw.auth(ADMIN))).json()
    health = health["plugins"]["api-keys"]
    assert "no-such-engine" in health["reload.catalog"]["reload_error"]


def test_admin_api_fuzz_no_5xx_and_openai_shaped_errors(tmp_path: Path) -> None:
    """Schemathesis over /v1/admin/openapi.json, a bounded derandomised number of examples."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    from kvgate.middleware.app import create_app
    from kvgate.middleware.framework.composition.config import parse_config

    async def app_of() -> Any:
        keys = tmp_path / "keys.yaml"
        _write_keys(keys)
        data = gateway_config(["http://127.0.0.1:9"])
        data["plugins"] = [{"type": "api-keys", "params": {"file": str(keys)}},
                           *data["plugins"]]
        return create_app(parse_config(data, "fuzz"))
    app = asyncio.run(app_of())
    plugin = app.pipeline.plugins["api-keys"]
    assert isinstance(plugin, ApiKeys) and plugin.app is not None
    schema = schemathesis.openapi.from_asgi("/v1/admin/openapi.json", plugin.app)
    operations = [r.ok() for r in schema.get_all_operations()]  # type: ignore[union-attr]
    assert len(operations) == 9

    def check(case: Any) -> None:
        response = case.call(headers={"authorization": f"Bearer {ADMIN}"})
        assert response.status_code < 500, (case.method, case.path, response.text)
        if response.status_code >= 400:
            err = json.loads(response.content)["error"]
            assert set(err) == {"message", "type", "param", "code"}, err
    for operation in operations:
        settings(max_examples=6, deadline=None, derandomize=True, database=None,
                 suppress_health_check=list(HealthCheck))(
            given(case=operation.as_strategy())(check))()
    assert KeysFile.model_validate(yaml.safe_load((tmp_path / "keys.yaml").read_text()))


async def test_keys_cli_over_the_admin_api(fleet: list[RunningSim], tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """``kvgate keys`` (kvgate.middleware.cli.main, in a thread) against the gateway on a real port;
    the admin key from ``$KVGATE_ADMIN_KEY``."""
    from kvgate.middleware.cli import main
    from tests.servers import serve_asgi

    async def cli(*argv: str) -> tuple[int, str, str]:
        code = await asyncio.to_thread(main, ["keys", *argv])
        out = capsys.readouterr()
        return code, out.out, out.err

    async with admin_gateway(fleet, tmp_path) as gw, serve_asgi(gw.app) as url:
        monkeypatch.setenv("KVGATE_ADMIN_KEY", ADMIN)
        base = ["--base-url", url + "/v1"]
        code, secret, err = await cli("create", "--tenant", "acme", "--id", "cli-1", *base)
        assert code == 0 and secret.strip().startswith("kvg-") and "cli-1" in err
        assert await gw.works(secret.strip())
        code, rotated, _ = await cli("rotate", "cli-1", "--grace-s", "60", *base)
        assert code == 0 and await gw.works(rotated.strip()) and await gw.works(secret.strip())
        code, out, _ = await cli("set-limits", "cli-1", "--requests-per-min", "7",
                                 "--budget-usd", "2.5", *base)
        assert code == 0 and json.loads(out)["limits"]["requests_per_min"] == 7
        code, out, _ = await cli("set-limits", "--tenant", "acme", "--max-concurrent", "3",
                                 *base)
        assert code == 0 and json.loads(out)["limits"]["max_concurrent"] == 3
        principal = gw.keys.principal_for("cli-1")
        assert principal is not None and principal.budget_usd == Decimal("2.5")
        assert (principal.limits.requests_per_min, principal.tenant_limits.max_concurrent) == (
            7, 3)
        code, out, _ = await cli("reload", *base)
        assert code == 0 and json.loads(out)["reloaded"] == {"keys": True, "catalog": True}
        code, _, _ = await cli("revoke", "cli-1", *base)
        assert code == 0 and not await gw.works(rotated.strip())
        code, out, _ = await cli("list", "--tenant", "acme", *base)
        assert code == 0 and [line.split()[:3] for line in out.splitlines()[1:]] == [
            ["user-1", "acme", "active"], ["cli-1", "acme", "revoked"]]
        assert secret.strip() not in out and rotated.strip() not in out
        code, _, err = await cli("revoke", "user-1", *base, "--api-key", USER)  # not an admin
        assert code == 1 and "admin_key_required" in err
        code, _, err = await cli("list", "--base-url", "http://127.0.0.1:9")
        assert code == 2 and "cannot reach" in err
