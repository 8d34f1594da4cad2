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

from engines.sim.testing import RunningSim
from middleware.config import parse_config
from middleware.errors import ConfigError
from middleware.pipeline import build_pipeline
from middleware.registry import Registry
from plugins.auth import hash_key, load_keys, new_key
from tests.integration.conftest import gateway, gateway_config

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
