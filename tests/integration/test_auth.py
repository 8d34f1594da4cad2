"""API keys through the gateway: 401 before any work, 403 for models outside the allow-list,
tenant and key id on the request, keys stored hashed, the keys CLI, auth switched off."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvgate.engines.sim.testing import RunningSim
from kvgate.middleware.framework.composition.config import parse_config
from kvgate.middleware.framework.composition.pipeline import build_pipeline
from kvgate.middleware.framework.composition.registry import Registry
from kvgate.middleware.framework.errors import ConfigError
from kvgate.plugins.tenancy.auth import hash_key, load_keys, new_key
from tests.integration.conftest import gateway, gateway_config, serve_gateway

CHAT: dict[str, Any] = {"model": "sim-model", "max_tokens": 2,
                        "messages": [{"role": "user", "content": "hi"}]}


def _keys_file(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    keys = {"full": new_key(), "narrow": new_key()}
    entries = [
        {"id": "acme-1", "tenant": "acme", "sha256": hash_key(keys["full"]), "admin": True},
        {"id": "beta-1", "tenant": "beta", "sha256": hash_key(keys["narrow"]),
         "models": ["other-model"]},
    ]
    path = tmp_path / "keys.yaml"
    path.write_text(yaml.safe_dump({"keys": entries}))
    return path, keys


def _with_auth(urls: list[str], params: dict[str, Any]) -> dict[str, Any]:
    data = gateway_config(urls)
    data["plugins"] = [{"type": "api-keys", "params": params}, *data["plugins"]]
    return data


CASES = [
    ("no header", None, b"{not json", 401, "invalid_api_key"),
    ("wrong scheme", "Basic abc", None, 401, "invalid_api_key"),
    ("unknown key", "Bearer kvg-nope", None, 401, "invalid_api_key"),
    ("empty bearer", "Bearer ", None, 401, "invalid_api_key"),
    ("model not allowed", "narrow", None, 403, "model_not_allowed"),
    ("ok", "full", None, 200, None),
]


@pytest.mark.parametrize(("case", "auth", "body", "status", "code"), CASES,
                         ids=[c[0] for c in CASES])
async def test_auth_statuses(fleet: list[RunningSim], tmp_path: Path, case: str,
                             auth: str | None, body: bytes | None, status: int,
                             code: str | None) -> None:
    path, keys = _keys_file(tmp_path)
    headers = {}
    if auth is not None:
        headers["authorization"] = f"Bearer {keys[auth]}" if auth in keys else auth
    async with gateway(_with_auth([s.url for s in fleet], {"file": str(path)})) as (_, client):

        resp = await client.post("/v1/chat/completions", headers=headers,
                                 content=body if body is not None else json.dumps(CHAT))
        assert resp.status_code == status, resp.text
        if code is not None:
            assert resp.json()["error"]["code"] == code


MODEL_LIST_CASES = [
    # (case, credential, status, models listed)
    ("no key", None, 401, None),
    ("unknown key", "Bearer kvg-nope", 401, None),
    ("key for every model", "full", 200, ["sim-model"]),
    ("allow-list without the engines' model", "narrow", 200, []),
]


@pytest.mark.parametrize(("case", "auth", "status", "listed"), MODEL_LIST_CASES,
                         ids=[c[0] for c in MODEL_LIST_CASES])
async def test_model_list_needs_a_key_without_a_catalog(
        fleet: list[RunningSim], tmp_path: Path, case: str, auth: str | None, status: int,
        listed: list[str] | None) -> None:
    """``GET /v1/models[/{id}]`` with keys on and no catalog: 401 without a valid key (as
    OpenAI's), and only the models the key may use."""
    path, keys = _keys_file(tmp_path)
    headers = {}
    if auth is not None:
        headers["authorization"] = f"Bearer {keys[auth]}" if auth in keys else auth
    async with gateway(_with_auth([s.url for s in fleet], {"file": str(path)})) as (_, client):
        resp = await client.get("/v1/models", headers=headers)
        assert resp.status_code == status, resp.text
        one = await client.get("/v1/models/sim-model", headers=headers)
        if listed is None:
            assert resp.json()["error"]["code"] == "invalid_api_key"
            assert one.status_code == 401
            return
        assert [card["id"] for card in resp.json()["data"]] == listed
        assert one.status_code == (200 if listed else 404), one.text


async def test_disabled_auth_says_so(fleet: list[RunningSim],
                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    async with gateway(_with_auth([s.url for s in fleet], {"disabled": True})) as (_, client):
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
    assert "authentication is DISABLED" in caplog.text


@pytest.mark.parametrize(("params", "needle"), [
    ({}, "file is required"),
    ({"file": "/nonexistent/keys.yaml"}, "cannot read keys file"),
])
def test_bad_auth_config_refuses_to_start(params: dict[str, Any], needle: str) -> None:
    data = _with_auth(["http://127.0.0.1:1"], params)
    with pytest.raises(ConfigError, match=needle):
        build_pipeline(parse_config(data, "t.yaml"), Registry.from_entry_points())


def test_two_authenticators_refused(tmp_path: Path) -> None:
    path, _ = _keys_file(tmp_path)
    data = _with_auth(["http://127.0.0.1:1"], {"file": str(path)})
    data["plugins"].insert(0, {"type": "api-keys", "name": "second", "params": {"disabled": True}})
    with pytest.raises(ConfigError, match="at most one authenticator"):
        build_pipeline(parse_config(data, "t.yaml"), Registry.from_entry_points())


def test_keys_cli_stores_only_the_hash(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    kvgate = str(Path(sys.executable).with_name("kvgate"))
    for tenant in ("acme", "acme"):
        done = subprocess.run([kvgate, "keys", "create", "--file", str(path), "--tenant", tenant,
                               "--model", "sim-model", "--budget-usd", "5"],
                              capture_output=True, text=True, check=True)
        key = done.stdout.strip()
        assert key.startswith("kvg-")
        assert key not in path.read_text()
        assert hash_key(key) in load_keys(path)
    assert [k.key_id for k in load_keys(path).values()] == ["acme-1", "acme-2"]


# ---- x-api-key (Anthropic's header) ---------------------------------------------------------

MESSAGES: dict[str, Any] = {"model": "sim-model", "max_tokens": 2,
                            "messages": [{"role": "user", "content": "hi"}]}

#: (case, Authorization value, x-api-key value, status); "full"/"narrow" name generated keys.
X_API_KEY_CASES: list[tuple[str, str | None, str | None, int]] = [
    ("x-api-key alone", None, "full", 200),
    ("x-api-key unknown", None, "kvg-nope", 401),
    ("x-api-key empty", None, "", 401),
    ("x-api-key blank", None, "  ", 401),
    ("x-api-key model not allowed", None, "narrow", 403),
    ("both, same key", "full", "full", 200),
    ("both, different keys", "full", "narrow", 401),
    ("both, one unknown", "full", "kvg-nope", 401),
    ("bad bearer with x-api-key", "Basic abc", "full", 401),
]


def _auth_headers(keys: dict[str, str], authorization: str | None,
                  api_key: str | None) -> dict[str, str]:
    headers = {}
    if authorization is not None:
        headers["authorization"] = (f"Bearer {keys[authorization]}" if authorization in keys
                                    else authorization)
    if api_key is not None:
        headers["x-api-key"] = keys.get(api_key, api_key)
    return headers


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
@pytest.mark.parametrize(("case", "authorization", "api_key", "status"), X_API_KEY_CASES,
                         ids=[c[0] for c in X_API_KEY_CASES])
async def test_x_api_key(fleet: list[RunningSim], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                         path: str, case: str, authorization: str | None, api_key: str | None,
                         status: int) -> None:
    """``x-api-key`` authenticates like ``Authorization: Bearer`` on every API; both naming
    different keys is a 401 saying so; the header never reaches plugins."""
    from kvgate.plugins.tenancy.auth import ApiKeys

    seen: list[dict[str, str]] = []
    original = ApiKeys.on_request

    async def spy(self: ApiKeys, req: Any, state: Any) -> None:
        seen.append(dict(req.headers))
        await original(self, req, state)

    monkeypatch.setattr(ApiKeys, "on_request", spy)
    keys_path, keys = _keys_file(tmp_path)
    headers = _auth_headers(keys, authorization, api_key)
    body = CHAT if path == "/v1/chat/completions" else MESSAGES
    async with gateway(_with_auth([s.url for s in fleet], {"file": str(keys_path)})) as (_, c):
        resp = await c.post(path, headers=headers, json=body)
    assert resp.status_code == status, resp.text
    if case == "both, different keys":
        assert "x-api-key" in resp.text and "different API keys" in resp.text
    if path == "/v1/messages" and status != 200:
        assert resp.json()["type"] == "error"
    for key in keys.values():
        assert key not in resp.text
    for h in seen:
        assert "x-api-key" not in h and "authorization" not in h


async def test_anthropic_sdk_api_key(fleet: list[RunningSim], tmp_path: Path) -> None:
    """The real anthropic SDK with ``api_key=`` (it sends ``x-api-key``) against the gateway
    served on loopback: accepted (plain and streamed); a wrong key raises the SDK's
    AuthenticationError, a key without the model its PermissionDeniedError."""
    import anthropic

    keys_path, keys = _keys_file(tmp_path)
    data = _with_auth([s.url for s in fleet], {"file": str(keys_path)})
    async with serve_gateway(data) as (_, url):
        def client(key: str) -> anthropic.AsyncAnthropic:
            return anthropic.AsyncAnthropic(base_url=url, api_key=key, max_retries=0)

        msg = await client(keys["full"]).messages.create(**MESSAGES)
        assert msg.usage.output_tokens == 2
        async with client(keys["full"]).messages.stream(**MESSAGES) as stream:
            final = await stream.get_final_message()
        assert final.usage.output_tokens == 2
        with pytest.raises(anthropic.AuthenticationError, match="invalid API key"):
            await client("kvg-wrong").messages.create(**MESSAGES)
        with pytest.raises(anthropic.PermissionDeniedError):
            await client(keys["narrow"]).messages.create(**MESSAGES)
