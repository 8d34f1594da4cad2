"""The ``quotas`` plugin in one in-process gateway over simulated engines (its in-process store):
OpenAI's ``x-ratelimit-*`` headers, 429 with ``Retry-After``, a concurrency slot released on
every outcome (answer, engine error, client disconnect, never dispatched), tenant budgets shared
by the tenant's keys, deferred runs held to budgets only, and ``kvgate serve``'s default of
adding the plugin whenever a keys file is used."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from kvgate.engines.sim.core.faults import FaultSpec
from kvgate.middleware.framework.composition.config import parse_config, with_billing, with_quotas
from kvgate.plugins.quotas.plugin import Quotas
from kvgate.plugins.tenancy.auth import hash_key, new_key
from tests.asyncq_helpers import until
from tests.integration.billing_helpers import billing_config, long_chat, write_keys
from tests.integration.conftest import gateway, sim_fleet

KEYS: dict[str, tuple[str, dict[str, Any]]] = {
    "rpm": ("acme", {"limits": {"requests_per_min": 3, "output_tokens_per_min": 1000}}),
    "one": ("acme", {"limits": {"max_concurrent": 1}}),
    "t1": ("initech", {}),
    "t2": ("initech", {}),
    "free": ("acme", {}),
}
TENANTS = {"initech": {"budget_usd": "0.0003"}}


def _keys(tmp: Path) -> tuple[Path, dict[str, str]]:
    secrets = {k: new_key() for k in KEYS}
    entries = [{"id": k, "tenant": t, "sha256": hash_key(secrets[k]), **extra}
               for k, (t, extra) in KEYS.items()]
    path = tmp / "quota-keys.yaml"
    path.write_text(yaml.safe_dump({"keys": entries, "tenants": TENANTS}))
    return path, secrets


@pytest.fixture
async def setup(tmp_path: Path) -> AsyncIterator[tuple[Any, httpx.AsyncClient, dict[str, str],
                                                       Any]]:
    keys = write_keys(tmp_path)
    path, secrets = _keys(tmp_path)
    async with sim_fleet(1) as sims:
        data = billing_config([sims[0].url], tmp_path, keys)
        data["plugins"][0]["params"]["file"] = str(path)
        async with gateway(data) as (app, client):
            yield app, client, secrets, sims[0]


def _auth(secrets: dict[str, str], key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {secrets[key]}"}


async def test_ratelimit_headers_then_429_with_retry_after(setup: Any) -> None:
    _, client, secrets, _ = setup
    seen = []
    for i in range(4):
        resp = await client.post("/v1/chat/completions", json=long_chat(i, max_tokens=100),
                                 headers=_auth(secrets, "rpm"))
        seen.append(resp)
    assert [r.status_code for r in seen] == [200, 200, 200, 429]
    assert [r.headers["x-ratelimit-remaining-requests"] for r in seen[:3]] == ["2", "1", "0"]
    assert {r.headers["x-ratelimit-limit-requests"] for r in seen[:3]} == {"3"}
    assert {r.headers["x-ratelimit-limit-tokens"] for r in seen[:3]} == {"1000"}
    # the reservation (100) is corrected with the real output (5 tokens) at completion
    assert int(seen[2].headers["x-ratelimit-remaining-tokens"]) >= 1000 - 3 * 100
    assert seen[0].headers["x-ratelimit-reset-requests"].endswith("s")
    refused = seen[3]
    assert refused.json()["error"]["code"] == "rate_limited"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert 1 <= int(refused.headers["retry-after"]) <= 20  # one request refills in 20 s
    # as OpenAI's 429s: the refused bucket's headers, nothing left until the reset
    assert refused.headers["x-ratelimit-limit-requests"] == "3"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert refused.headers["x-ratelimit-reset-requests"].endswith("s")


async def test_concurrency_slot_released_on_every_outcome(setup: Any) -> None:
    app, client, secrets, sim = setup
    auth = _auth(secrets, "one")
    ok = await client.post("/v1/chat/completions", json=long_chat(0), headers=auth)
    assert ok.status_code == 200
    missing = await client.post("/v1/chat/completions", headers=auth,
                                json={**long_chat(1), "model": "no-such-model"})
    assert missing.status_code == 404  # refused after admission, never dispatched
    sim.faults.apply(FaultSpec(fail_next=1, status=400))  # the engine refuses it
    failed = await client.post("/v1/chat/completions", json=long_chat(2), headers=auth)
    assert failed.status_code == 400
    sim.faults.apply(FaultSpec(delay_first_byte_s=5.0))
    slow = asyncio.create_task(client.post("/v1/chat/completions", json=long_chat(3),
                                           headers=auth))
    quotas = app.pipeline.plugins["quotas"]
    assert isinstance(quotas, Quotas)

    async def holding() -> bool:
        return quotas.local.in_flight() == 1
    await until(holding, 10)
    busy = await client.post("/v1/chat/completions", json=long_chat(4), headers=auth)
    assert busy.status_code == 429 and busy.json()["error"]["code"] == "rate_limited"
    slow.cancel()  # the client leaves mid-request
    with pytest.raises(asyncio.CancelledError):
        await slow

    async def released() -> bool:
        return quotas.local.in_flight() == 0
    await until(released, 10)
    sim.faults.apply(FaultSpec(delay_first_byte_s=0.0))
    again = await client.post("/v1/chat/completions", json=long_chat(5), headers=auth)
    assert again.status_code == 200
    metrics = app.metrics_page().decode()
    assert 'kvgate_quota_rejections_total{dimension="concurrent",scope="key"} 1.0' in metrics


async def test_tenant_budget_binds_all_its_keys(setup: Any) -> None:
    _, client, secrets, _ = setup
    statuses = []
    for i in range(12):
        resp = await client.post("/v1/chat/completions", json=long_chat(i),
                                 headers=_auth(secrets, ("t1", "t2")[i % 2]))
        statuses.append((resp.status_code, resp.json().get("error", {}).get("code")))
    assert statuses[0] == (200, None)
    assert statuses[-2:] == [(429, "insufficient_quota")] * 2  # both keys, one budget
    free = await client.post("/v1/chat/completions", json=long_chat(0),
                             headers=_auth(secrets, "free"))
    assert free.status_code == 200 and "x-ratelimit-limit-requests" not in free.headers


def test_serve_adds_quotas_whenever_a_keys_file_is_used(tmp_path: Path) -> None:
    cases = [({"keys": "k.yaml", "prices": "p.yaml"}, True),
             ({"prices": "p.yaml"}, False),  # no keys file: authentication off
             ({}, False)]
    for flags, expected in cases:
        config = with_quotas(with_billing(parse_config({}, "t"), **flags))
        types = [p.type for p in config.plugins]
        assert ("quotas" in types) is expected, (flags, types)
        if expected:
            assert types.index("quotas") > types.index("billing") > types.index("api-keys")
    # keys kept in Redis alone (no file) are keys too: with shared state, or the plugin's own URL
    redis_keys = [{"type": "api-keys", "params": {"redis_url": "redis://h:6379/0"}},
                  {"type": "billing", "params": {}}]
    shared_keys = [{"type": "api-keys", "params": {"file": None}}, {"type": "billing"}]
    for data in ({"plugins": redis_keys},
                 {"plugins": shared_keys, "shared_state": {"redis_url": "redis://h:6379/0"}}):
        types = [p.type for p in with_quotas(parse_config(data, "t")).plugins]
        assert types == ["api-keys", "billing", "quotas"], (data, types)
