"""kvgate as a LiteLLM provider: the shipped examples (docs/examples/litellm_sdk.py and
docs/examples/litellm_config.yaml, loaded from their files) run with the real LiteLLM SDK
against a kvgate served by uvicorn on loopback. Checked: the session header reaches kvgate
(echoed back, and in the ledger), and LiteLLM's cost with kvgate's exported price map equals
kvgate's ledger cost for the same request (to 1e-12 USD), also with cached tokens."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import importlib.util
import json
import os
import secrets
from asyncio.subprocess import Process
from collections.abc import AsyncIterator, Iterator
from decimal import Decimal
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
import yaml

from kvgate.middleware.app import KvgateApp
from kvgate.plugins.tenancy.auth import hash_key, new_key
from kvgate.pricing.prices import load_book, to_litellm
from tests.integration.billing_helpers import ledger_rows
from tests.integration.conftest import gateway_config, serve_gateway, sim_fleet
from tests.litellm_proxy_venv import ensure_proxy_venv
from tests.servers import free_port

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
PRICES = EXAMPLES / "prices.yaml"
SYSTEM = "You are a test of LiteLLM interop. " * 40  # spans KV blocks: cached from call 2


def _load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"kvgate_example_{name}", EXAMPLES / name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.asynccontextmanager
async def _kvgate(tmp: Path) -> AsyncIterator[tuple[KvgateApp, str, str]]:
    key = new_key()  # tenant "beta" has no discount: LiteLLM knows list prices only
    (tmp / "keys.yaml").write_text(yaml.safe_dump({"keys": [
        {"id": "beta-1", "tenant": "beta", "sha256": hash_key(key)}]}))
    async with sim_fleet(1) as sims:
        data = gateway_config([sims[0].url])
        data["plugins"] = [
            {"type": "api-keys", "params": {"file": str(tmp / "keys.yaml")}},
            {"type": "billing", "params": {"prices": str(PRICES), "auth": None,
                                           "ledger": f"sqlite://{tmp}/ledger.sqlite",
                                           "spool": str(tmp / "spool")}},
            {"type": "session-affinity-scorer"}, *data["plugins"]]
        data["profiles"][0]["plugins"].insert(2, {"ref": "session-affinity-scorer", "weight": 2})
        async with serve_gateway(data) as (app, url):
            yield app, url, key


@pytest.fixture(autouse=True)
def _restore_litellm_prices() -> Iterator[None]:
    """Registrations go into LiteLLM's process-wide price map: put it back afterwards."""
    litellm = _load_example("litellm_sdk.py").litellm_module()
    saved = dict(litellm.model_cost)
    yield
    litellm.model_cost.clear()
    litellm.model_cost.update(saved)


def _exported_map(tmp: Path) -> Path:
    """kvgate's price map for LiteLLM, as ``kvgate usage litellm-prices`` writes it."""
    path = tmp / "kvgate-prices.json"
    path.write_text(json.dumps(to_litellm(load_book(PRICES), dt.datetime.now(dt.UTC))))
    return path


def _headers(response: Any) -> dict[str, str]:
    hidden = getattr(response, "_hidden_params", {}) or {}
    raw = hidden.get("additional_headers") or {}
    return {k.removeprefix("llm_provider-").lower(): str(v) for k, v in raw.items()}


async def _check_costs(app: KvgateApp, calls: list[tuple[Any, float]], session: str) -> None:
    rows = await ledger_rows(app)
    assert len({r.session for r in rows.values()}) == 1  # one session, one digest
    cached = []
    for response, litellm_cost in calls:
        headers = _headers(response)
        assert headers["x-session-affinity"] == session  # kvgate saw the header
        row = rows[headers["x-request-id"]]
        # the ledger keeps the session as a keyed digest, never in clear (docs/operations.md)
        assert row.session is not None and row.session.startswith("hs1:")
        assert session not in row.session
        assert row.prompt_tokens == response.usage.prompt_tokens
        assert abs(row.cost_total - Decimal(repr(litellm_cost))) <= Decimal("1e-12")
        assert row.cost_total > 0
        cached.append(row.cached_tokens)
    assert cached[0] == 0 and cached[-1] is not None and cached[-1] > 0  # discount exercised


async def test_sdk_example_against_kvgate(tmp_path: Path) -> None:
    sdk = _load_example("litellm_sdk.py")
    sdk.register_kvgate_prices(str(_exported_map(tmp_path)))
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
    async with _kvgate(tmp_path) as (app, url, key):
        calls = []
        for _ in range(2):
            calls.append(await asyncio.to_thread(sdk.ask, url, key, "sim-model", "ses_sdk_1",
                                                 messages, max_tokens=5))
        await _check_costs(app, calls, "ses_sdk_1")


async def test_proxy_config_example_with_litellm_router(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The proxy config's model_list, served by LiteLLM's Router (what the proxy runs)."""
    config = yaml.safe_load((EXAMPLES / "litellm_config.yaml").read_text())
    assert config["general_settings"]["forward_client_headers_to_llm_api"] is True
    exported = to_litellm(load_book(PRICES), dt.datetime.now(dt.UTC))
    for deployment in config["model_list"]:
        name = deployment["model_name"]
        assert deployment["litellm_params"]["model"] == f"openai/{name}"
        info = {k: v for k, v in deployment["model_info"].items() if k != "mode"}
        assert info == {k: v for k, v in exported[name].items()
                        if k not in ("litellm_provider", "mode")}
    sdk = _load_example("litellm_sdk.py")
    litellm = sdk.litellm_module()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hey"}]
    async with _kvgate(tmp_path) as (app, url, key):
        monkeypatch.setenv("KVGATE_API_BASE", f"{url}/v1")
        monkeypatch.setenv("KVGATE_API_KEY", key)
        router = litellm.Router(model_list=config["model_list"])
        calls = []
        for _ in range(2):
            response = await router.acompletion(
                model="sim-model", messages=messages, max_tokens=5,
                extra_headers={"x-session-affinity": "ses_router_1"})
            # the cost the Router (and so the proxy) computed from the deployment's model_info
            calls.append((response, response._hidden_params["response_cost"]))
        await _check_costs(app, calls, "ses_router_1")


#: The proxy takes ~90 s to boot on a 2-core machine (it imports all of LiteLLM's proxy app).
PROXY_BOOT_S = 240.0


async def _wait_ready(client: httpx.AsyncClient, url: str, proc: Process) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + PROXY_BOOT_S
    while loop.time() < deadline:
        if proc.returncode is not None:
            raise AssertionError(f"the LiteLLM proxy exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if (await client.get(f"{url}/health/liveliness")).status_code == 200:
                return
        await asyncio.sleep(1)
    raise AssertionError(f"the LiteLLM proxy did not start within {PROXY_BOOT_S} s")


@pytest.fixture(scope="session")
def proxy_exe() -> Path:
    """The real LiteLLM proxy, its venv built on first use (about 40 s, then reused)."""
    return ensure_proxy_venv()


@pytest.mark.e2e
@pytest.mark.slow
async def test_litellm_proxy_with_example_config(tmp_path: Path, proxy_exe: Path) -> None:
    """The real LiteLLM proxy (``litellm --config docs/examples/litellm_config.yaml``) in
    front of kvgate: the client's session header reaches kvgate through the proxy, and the
    proxy's computed cost (``x-litellm-response-cost``) equals kvgate's ledger cost."""
    exe = proxy_exe
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "yo"}]
    async with _kvgate(tmp_path) as (app, url, key), httpx.AsyncClient(timeout=60) as client:
        port = free_port()
        master = "sk-" + secrets.token_hex(32)
        env = {**os.environ, "KVGATE_API_BASE": f"{url}/v1", "KVGATE_API_KEY": key,
               "LITELLM_MASTER_KEY": master, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
        log = (tmp_path / "proxy.log").open("wb")
        proc = await asyncio.create_subprocess_exec(
            str(exe), "--config", str(EXAMPLES / "litellm_config.yaml"), "--host", "127.0.0.1",
            "--port", str(port), env=env, stdout=log, stderr=asyncio.subprocess.STDOUT)
        proxy = f"http://127.0.0.1:{port}"
        try:
            await _wait_ready(client, proxy, proc)
            answers = []
            for _ in range(2):
                resp = await client.post(f"{proxy}/v1/chat/completions", headers={
                    "authorization": f"Bearer {master}", "x-session-affinity": "ses_proxy_1"},
                    json={
                    "model": "sim-model", "messages": messages, "max_tokens": 5})
                assert resp.status_code == 200, resp.text
                answers.append(resp)
        finally:
            proc.terminate()
            await proc.wait()
            log.close()
        rows = [r for r in (await ledger_rows(app)).values() if r.session is not None]
        assert len(rows) == 2
        # the header got through: both records carry one session, kept as a keyed digest
        assert len({r.session for r in rows}) == 1
        assert all(str(r.session).startswith("hs1:") and "ses_proxy_1" not in str(r.session)
                   for r in rows)
        by_prompt = sorted(rows, key=lambda r: r.ts)
        for resp, row in zip(answers, by_prompt, strict=True):
            assert row.prompt_tokens == resp.json()["usage"]["prompt_tokens"]
            cost = Decimal(resp.headers["x-litellm-response-cost"])
            assert abs(row.cost_total - cost) <= Decimal("1e-12")
        assert by_prompt[-1].cached_tokens  # the second call hit kvgate's prefix cache
