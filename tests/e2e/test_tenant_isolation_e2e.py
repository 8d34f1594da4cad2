"""Tenant isolation on two real vLLM CPU engines behind ``kvgate serve`` (api-keys, cache-salt,
precise prefix matching from the engines' KV events): the same long prompt from two tenants --
the second tenant's first request is not cached (not even on the engine holding the first
tenant's blocks), its repeat is, and every prediction the gateway checks against the engines'
reported ``cached_tokens`` lands within one block (a salt-blind hash would be off by the whole
prompt)."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvgate.engines.local.launcher import LocalEngine
from kvgate.engines.local.model import SERVED_NAME
from kvgate.plugins.tenancy.cache_salt import derive_salt, tenant_scope
from kvgate.plugins.tenancy.gateway_secret import CACHE_SALT_PURPOSE, load_secret
from tests.e2e.conftest import kvgate_serve, precise_plugins
from tests.integration.billing_helpers import Keys, write_keys

pytestmark = pytest.mark.e2e
WORDS = ("river", "stone", "lantern", "harbor", "copper", "meadow", "signal", "orbit", "canvas",
         "thunder", "velvet", "garden", "pixel", "summit", "cobalt", "ember", "glacier", "prism")


def _config(engines: list[LocalEngine], events_port: int, model_dir: Path, tmp: Path,
            keys: Keys) -> dict[str, Any]:
    return {
        "pool": {"health_interval_s": 0.5, "metrics_interval_s": 0.5},
        "engines": [{"name": e.name, "url": e.url} for e in engines],
        "plugins": [
            {"type": "api-keys", "params": {"file": str(keys.path)}},
            {"type": "cache-salt", "params": {"secret_file": str(tmp / "secret"),
                                              "secret_env": "KVGATE_TEST_UNSET_SECRET"}},
            *precise_plugins(events_port, model_dir),
            {"type": "health-filter"}, {"type": "model-filter"}, {"type": "token-load-scorer"},
            {"type": "prefix-cache-scorer"}, {"type": "max-score-picker"},
        ],
        "profiles": [{"name": "default", "plugins": [
            {"ref": "health-filter"}, {"ref": "model-filter"},
            {"ref": "prefix-cache-scorer", "weight": 3}, {"ref": "token-load-scorer", "weight": 1},
            {"ref": "max-score-picker"}]}],
    }


@pytest.fixture(scope="module")
def served(vllm_fleet: list[LocalEngine], events_port: int, tiny_model: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, Keys]]:
    tmp = tmp_path_factory.mktemp("isolation")
    keys = write_keys(tmp)  # user: tenant globex; admin: tenant acme
    with kvgate_serve(_config(vllm_fleet, events_port, tiny_model, tmp, keys), tmp) as url:
        _warm_up(url, vllm_fleet, keys.auth("admin"))
        yield url, tmp, keys


def _blocks(url: str, admin: dict[str, str]) -> float:
    for line in httpx.get(url + "/metrics", headers=admin).text.splitlines():
        if line.startswith("kvgate_kv_index_blocks "):
            return float(line.split()[1])
    return 0.0


def _warm_up(url: str, engines: list[LocalEngine], admin: dict[str, str]) -> None:
    """Events an engine published before the gateway's socket was up are lost: prompts straight
    to each engine until the gateway's index grows from them."""
    for engine in engines:
        for i in range(20):
            before = _blocks(url, admin)
            body = {"model": SERVED_NAME, "max_tokens": 1,
                    "prompt": f"warm up {engine.name} {i} " + "word " * 300}
            assert httpx.post(engine.url + "/v1/completions", json=body,
                              timeout=300).status_code == 200
            time.sleep(0.5)
            if _blocks(url, admin) > before:
                break
        else:
            raise AssertionError(f"no KV events from {engine.name}")


def _chat(question: str, salt: str | None = None) -> dict[str, Any]:
    rng = random.Random(20261125)
    text = " ".join(rng.choice(WORDS) for _ in range(700))  # ~1400 tokens: ~10 blocks of 128
    body: dict[str, Any] = {"model": SERVED_NAME, "max_tokens": 2, "temperature": 0,
                            "messages": [{"role": "system", "content": f"Handbook: {text}"},
                                         {"role": "user", "content": question}]}
    if salt is not None:
        body["cache_salt"] = salt
    return body


def _ask(url: str, headers: dict[str, str], body: dict[str, Any]) -> tuple[str | None, int]:
    resp = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=300)
    assert resp.status_code == 200, resp.text
    cached = resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    time.sleep(1.0)  # the engine's BlockStored events reach the gateway
    return resp.headers.get("x-kvgate-engine"), int(cached or 0)


def _predictions(url: str, admin: dict[str, str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", headers=admin).text.splitlines():
        if line.startswith("kvgate_kv_predictions_total{"):
            head, value = line.rsplit(" ", 1)
            result = head.split('result="')[1].split('"')[0]
            out[result] = out.get(result, 0.0) + float(value)
    return out


def test_same_prompt_two_tenants(served: tuple[str, Path, Keys],
                                 vllm_fleet: list[LocalEngine]) -> None:
    url, tmp, keys = served
    acme, globex = keys.auth("admin"), keys.auth("user")
    home, cached = _ask(url, acme, _chat("first question"))
    assert cached == 0
    engine, cached = _ask(url, acme, _chat("second question"))
    assert (engine, cached >= 128) == (home, True), (engine, cached)  # own repeat: cached
    other, cached = _ask(url, globex, _chat("first question"))
    assert cached == 0, (other, cached)  # same prompt, other tenant: nothing shared
    if other != home:  # it went elsewhere: ask the engine holding acme's blocks directly
        key = load_secret("KVGATE_TEST_UNSET_SECRET", str(tmp / "secret")).derive(
            CACHE_SALT_PURPOSE)
        salt = derive_salt(key, tenant_scope("globex"))
        holder = next(e for e in vllm_fleet if e.name == home)
        assert _ask(holder.url, {}, _chat("direct question", salt))[1] == 0
    engine, cached = _ask(url, globex, _chat("second question"))
    assert (engine, cached >= 128) == (other, True), (engine, cached)  # its repeat is
    predictions = _predictions(url, acme)
    assert predictions.get("within_block", 0) >= 4, predictions
    assert not predictions.get("over") and not predictions.get("under"), predictions
