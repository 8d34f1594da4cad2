"""``/metrics`` and ``/health`` without secrets (docs/security.md, "Metrics and health"): with
API keys on, the API port serves tenant series and the full health report to an admin key only
(``/metrics``: 401 without a valid key, 403 for a tenant's key; ``/health``: just its status);
the admin port (``server.admin_port``) serves both without a key; with auth off, nothing
changes."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvgate.engines.sim.testing import RunningSim
from tests.integration.billing_helpers import Keys, billing_config, ledger_list, write_keys
from tests.integration.conftest import gateway, gateway_config
from tests.servers import free_port, running_process

CHAT = {"model": "sim-model", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
KVGATE = str(Path(sys.executable).with_name("kvgate"))
PRICES = Path(__file__).resolve().parents[2] / "docs/examples/prices.yaml"
TENANT_SERIES = 'kvgate_cost_usd_total{model="sim-model",tenant="globex"}'


@contextlib.asynccontextmanager
async def _gateway(fleet: list[RunningSim], tmp: Path, auth: bool
                   ) -> AsyncIterator[tuple[httpx.AsyncClient, str, Keys]]:
    """The gateway (API keys and billing, or neither) after one billed request by globex;
    yields its client, its admin port's URL ("" without one) and the keys."""
    keys = write_keys(tmp)
    urls = [s.url for s in fleet]
    if auth:
        data: dict[str, Any] = billing_config(urls, tmp, keys, server={"admin_port": 0})
    else:
        data = gateway_config(urls)
    async with gateway(data) as (app, client):
        resp = await client.post("/v1/chat/completions", json=CHAT, headers=keys.auth("user"))
        assert resp.status_code == 200, resp.text
        if auth:
            assert len(await ledger_list(app)) == 1  # billed: the tenant's series exist
        admin = getattr(app, "admin", None)  # None: no admin port
        admin_url = "" if admin is None else f"http://127.0.0.1:{admin.port}"
        yield client, admin_url, keys


def _headers(keys: Keys, who: str) -> dict[str, str]:
    if who == "anonymous":
        return {}
    if who == "bad key":
        return {"authorization": "Bearer kvg-not-a-key"}
    return keys.auth(who)  # "user": globex's key; "admin": acme's admin key


def _check_body(resp: httpx.Response, expect: str) -> None:
    if expect == "error":  # OpenAI's error shape, nothing a tenant could learn from
        assert set(resp.json()) == {"error"} and resp.json()["error"]["message"]
        assert "globex" not in resp.text and "acme" not in resp.text
    elif expect == "tenant series":
        assert TENANT_SERIES in resp.text
    elif expect == "series, no tenant":
        assert "kvgate_requests_total" in resp.text and "tenant=" not in resp.text
    elif expect == "status only":
        assert resp.json() == {"status": "ok"}
    elif expect == "full health":
        body = resp.json()
        assert body["status"] == "ok" and all(e["url"] for e in body["engines"])
        assert {"api-keys", "quotas"} <= set(body["plugins"])
    else:  # "public health": engines and plugins, engine URLs hidden (as before)
        assert expect == "public health"
        body = resp.json()
        assert body["status"] == "ok" and body["engines"]
        assert all("url" not in e for e in body["engines"]) and "127.0.0.1" not in resp.text


#: (case, API keys on, who calls, path, status, what the answer shows)
API_PORT: list[tuple[str, bool, str, str, int, str]] = [
    ("keys on: anonymous /metrics", True, "anonymous", "/metrics", 401, "error"),
    ("keys on: bad key /metrics", True, "bad key", "/metrics", 401, "error"),
    ("keys on: tenant key /metrics", True, "user", "/metrics", 403, "error"),
    ("keys on: admin key /metrics", True, "admin", "/metrics", 200, "tenant series"),
    ("keys on: anonymous /health", True, "anonymous", "/health", 200, "status only"),
    ("keys on: bad key /health", True, "bad key", "/health", 200, "status only"),
    ("keys on: tenant key /health", True, "user", "/health", 200, "status only"),
    ("keys on: admin key /health", True, "admin", "/health", 200, "full health"),
    ("auth off: anonymous /metrics", False, "anonymous", "/metrics", 200, "series, no tenant"),
    ("auth off: anonymous /health", False, "anonymous", "/health", 200, "public health"),
]


@pytest.mark.parametrize(("case", "auth", "who", "path", "status", "expect"), API_PORT,
                         ids=[c[0] for c in API_PORT])
async def test_api_port_serves_tenant_series_and_internals_to_admin_keys_only(
        fleet: list[RunningSim], tmp_path: Path, case: str, auth: bool, who: str, path: str,
        status: int, expect: str) -> None:
    async with _gateway(fleet, tmp_path, auth) as (client, _, keys):
        resp = await client.get(path, headers=_headers(keys, who))
    assert resp.status_code == status, resp.text
    _check_body(resp, expect)


#: (case, method, path, status, what the answer shows): the admin port, keys on, no key sent.
ADMIN_PORT: list[tuple[str, str, str, int, str]] = [
    ("metrics", "GET", "/metrics", 200, "tenant series"),
    ("health", "GET", "/health", 200, "full health"),
    ("no API on it", "POST", "/v1/chat/completions", 404, "error"),
    ("GET only", "POST", "/metrics", 405, "error"),
]


@pytest.mark.parametrize(("case", "method", "path", "status", "expect"), ADMIN_PORT,
                         ids=[c[0] for c in ADMIN_PORT])
async def test_admin_port_serves_metrics_and_full_health_without_a_key(
        fleet: list[RunningSim], tmp_path: Path, case: str, method: str, path: str,
        status: int, expect: str) -> None:
    async with _gateway(fleet, tmp_path, auth=True) as (_, admin_url, _keys):
        assert admin_url
        async with httpx.AsyncClient(base_url=admin_url, timeout=10) as http:
            resp = await http.request(method, path, json=CHAT if method == "POST" else None)
    assert resp.status_code == status, resp.text
    _check_body(resp, expect)


async def test_admin_port_is_closed_when_the_gateway_stops(
        fleet: list[RunningSim], tmp_path: Path) -> None:
    async with _gateway(fleet, tmp_path, auth=True) as (_, admin_url, _keys):
        pass
    async with httpx.AsyncClient(base_url=admin_url, timeout=2) as http:
        with pytest.raises(httpx.ConnectError):
            await http.get("/metrics")


def test_serve_admin_port_flag_with_keys(tmp_path: Path) -> None:
    """The issue's command line, real processes: ``kvgate serve --keys --prices --ledger
    --admin-port``; the API port refuses /metrics without an admin key and says only its
    status on /health, the admin port serves both without one."""
    keys = write_keys(tmp_path)
    sim_port, port, admin_port = free_port(), free_port(), free_port()
    sim = [sys.executable, "-m", "kvgate.engines.sim", "--port", str(sim_port), "--time-scale", "0"]
    serve = [KVGATE, "serve", "--engine", f"http://127.0.0.1:{sim_port}", "--port", str(port),
             "--keys", str(keys.path), "--prices", str(PRICES), "--ledger",
             f"sqlite:///{tmp_path}/ledger.sqlite", "--admin-port", str(admin_port)]
    api, admin = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}"
    with running_process(sim, f"http://127.0.0.1:{sim_port}/health"), \
            running_process(serve, f"{admin}/health", log=tmp_path / "kvgate.log",
                            cwd=tmp_path, limit_s=60):  # a loaded machine starts slowly
        chat = httpx.post(f"{api}/v1/chat/completions", json=CHAT, headers=keys.auth("user"))
        assert chat.status_code == 200, chat.text
        deadline = time.monotonic() + 10  # billing counts once the dispatch has completed
        while 'tenant="globex"' not in httpx.get(f"{admin}/metrics").text:
            assert time.monotonic() < deadline, "the billed request never reached /metrics"
            time.sleep(0.05)
        cases = [(api, "/metrics", {}, 401), (api, "/metrics", keys.auth("user"), 403),
                 (api, "/metrics", keys.auth("admin"), 200), (admin, "/metrics", {}, 200),
                 (api, "/health", {}, 200), (admin, "/health", {}, 200)]
        answers = [(httpx.get(base + path, headers=headers), status)
                   for base, path, headers, status in cases]
    for resp, status in answers:
        assert resp.status_code == status, (resp.url, resp.text)
    assert "globex" not in answers[0][0].text + answers[1][0].text
    assert 'tenant="globex"' in answers[2][0].text and 'tenant="globex"' in answers[3][0].text
    assert answers[4][0].json() == {"status": "ok"}
    assert answers[5][0].json()["engines"][0]["url"] == f"http://127.0.0.1:{sim_port}"
