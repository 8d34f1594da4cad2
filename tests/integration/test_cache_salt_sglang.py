"""SGLang engines ignore ``cache_salt``: with API keys of two tenants and ``cache-salt`` in
front of a pool where one engine is labelled ``engine: sglang``, the gateway says so at
startup (WARNING), on /health (the cache-salt section of the admin view) and on /metrics
(``kvgate_cache_salt_unisolated_engines``); a vLLM-only pool, or auth off, says nothing."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from kvgate.engines.sim.testing import RunningSim
from tests.integration.billing_helpers import Keys, write_keys
from tests.integration.conftest import gateway, gateway_config

GAUGE = "kvgate_cache_salt_unisolated_engines"


def _config(fleet: list[RunningSim], tmp: Path, keys: Keys | None,
            sglang: bool) -> dict[str, Any]:
    data = gateway_config([s.url for s in fleet])
    if sglang:
        data["engines"][1]["labels"] = {"engine": "sglang"}
    auth = {"file": str(keys.path)} if keys is not None else {"disabled": True}
    data["plugins"] = [{"type": "api-keys", "params": auth},
                       {"type": "cache-salt", "params": {"secret_file": str(tmp / "secret")}},
                       *data["plugins"]]
    return data


async def test_an_sglang_engine_behind_salted_tenants_is_named_everywhere(
        fleet: list[RunningSim], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    keys = write_keys(tmp_path)  # tenants acme and globex
    with caplog.at_level(logging.WARNING, "kvgate.plugins.cache_salt"):
        async with gateway(_config(fleet, tmp_path, keys, sglang=True)) as (_, client):
            warned = [r.getMessage() for r in caplog.records if "ignore cache_salt" in
                      r.getMessage()]
            assert len(warned) == 1 and "sim-1" in warned[0] and "sim-0" not in warned[0]
            health = (await client.get("/health", headers=keys.auth("admin"))).json()
            section = health["plugins"]["cache-salt"]
            assert section["unisolated_engines"] == ["sim-1"]
            assert "SGLang ignores cache_salt" in section["warning"]
            metrics = (await client.get("/metrics", headers=keys.auth("admin"))).text
            assert f"{GAUGE} 1.0" in metrics


@pytest.mark.parametrize(("sglang", "auth"), [(False, True), (True, False)])
async def test_nothing_is_said_without_sglang_or_without_tenants(
        fleet: list[RunningSim], tmp_path: Path, caplog: pytest.LogCaptureFixture,
        sglang: bool, auth: bool) -> None:
    keys = write_keys(tmp_path)
    with caplog.at_level(logging.WARNING, "kvgate.plugins.cache_salt"):
        async with gateway(_config(fleet, tmp_path, keys if auth else None,
                                   sglang)) as (_, client):
            assert not [r for r in caplog.records if "ignore cache_salt" in r.getMessage()]
            section = (await client.get("/health", headers=keys.auth("admin"))).json()
            assert "unisolated_engines" not in str(section)
            metrics = (await client.get("/metrics", headers=keys.auth("admin"))).text
            assert f"{GAUGE} 0.0" in metrics
