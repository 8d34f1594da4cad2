"""A gateway with the catalog, api-keys and billing plugins in front of one simulated engine and
two stand-in providers (OpenAI- and Anthropic-compatible servers on loopback) reached through
the real ``litellm`` library."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from kvgate.engines.sim.testing import RunningSim
from kvgate.middleware.app import KvgateApp
from tests.integration.billing_helpers import Keys, write_keys
from tests.integration.conftest import gateway, gateway_config, serve_gateway, sim_fleet
from tests.integration.fake_providers import FakeProvider, anthropic_app, openai_app, serve

PRICES = """\
models:
  sim-model: {input_per_mtok: "0.60", cached_input_per_mtok: "0.10", output_per_mtok: "3.00"}
  gpt-x: {input_per_mtok: "2.50", cached_input_per_mtok: "1.25", output_per_mtok: "10.00"}
  claude-x: {input_per_mtok: "3.00", cached_input_per_mtok: "0.30", output_per_mtok: "15.00",
             cache_write_per_mtok: "3.75"}
"""


@dataclass
class Stack:
    app: KvgateApp
    client: httpx.AsyncClient
    sim: RunningSim
    openai: FakeProvider
    anthropic: FakeProvider
    keys: Keys


def catalog_models(openai_url: str, anthropic_url: str) -> list[dict[str, Any]]:
    def provider(model: str, url: str, env: str, **extra: Any) -> dict[str, Any]:
        return {"model": model, "api_base": url, "api_key_env": env, "timeout_s": 10, **extra}

    return [
        {"name": "sim-model", "aliases": ["sim"], "pool": {"engines": ["sim-0"]},
         "fallbacks": ["gpt-x"], "context_length": 32768},
        {"name": "gpt-x", "aliases": ["gpt"],
         "provider": provider("openai/gpt-x", openai_url + "/v1", "KVG_OPENAI_KEY")},
        {"name": "claude-x", "aliases": ["claude"], "modalities": ["text", "image"],
         "provider": provider("anthropic/claude-x", anthropic_url, "KVG_ANTHROPIC_KEY",
                              retries=1, retry_backoff_s=0)},
        {"name": "claude-once", "provider": provider("anthropic/claude-x", anthropic_url,
                                                     "KVG_ANTHROPIC_KEY")},
        {"name": "claude-missing", "provider": provider("anthropic/claude-missing",
                                                        anthropic_url, "KVG_ANTHROPIC_KEY")},
    ]


def stack_config(sim_url: str, tmp: Path, keys: Keys, models: list[dict[str, Any]],
                 extra_plugins: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    (tmp / "catalog.yaml").write_text(yaml.safe_dump({"models": models}))
    (tmp / "prices.yaml").write_text(PRICES)
    data = gateway_config([sim_url])
    data["plugins"] = [
        {"type": "catalog", "params": {"file": str(tmp / "catalog.yaml"),
                                       "prices": str(tmp / "prices.yaml")}},
        {"type": "api-keys", "params": {"file": str(keys.path), "catalog": "catalog"}},
        {"type": "billing", "params": {"prices": str(tmp / "prices.yaml"),
                                       "ledger": f"sqlite://{tmp}/ledger.sqlite",
                                       "spool": str(tmp / "spool")}},
        *(extra_plugins or []), *data["plugins"]]
    return data


@contextlib.asynccontextmanager
async def provider_stack(tmp: Path, monkeypatch: pytest.MonkeyPatch,
                         narrow_models: list[str] | None = None,
                         served: bool = False) -> AsyncIterator[Stack]:
    """The stack; ``served``: kvgate behind uvicorn on loopback (real connections, so a
    client can go away), else in-process through ASGITransport."""
    monkeypatch.setenv("KVG_OPENAI_KEY", "sk-test")
    monkeypatch.setenv("KVG_ANTHROPIC_KEY", "sk-test")
    fo, fa = FakeProvider(), FakeProvider()
    keys = write_keys(tmp)
    entries = yaml.safe_load(keys.path.read_text())  # allow-lists name catalog models
    entries["keys"][2]["models"] = narrow_models or ["sim"]
    keys.path.write_text(yaml.safe_dump(entries))
    async with sim_fleet(1) as sims, serve(openai_app(fo)) as ou, serve(anthropic_app(fa)) as au:
        data = stack_config(sims[0].url, tmp, keys, catalog_models(ou, au))
        if not served:
            async with gateway(data) as (app, client):
                yield Stack(app, client, sims[0], fo, fa, keys)
            return
        async with serve_gateway(data) as (app, url), httpx.AsyncClient(
                base_url=url, timeout=30) as client:
            yield Stack(app, client, sims[0], fo, fa, keys)
