"""Prefill/decode disaggregation on a real vLLM CPU NixlConnector pair, through ``kvgate serve``
(``vllm-nixl`` connector, billing on): the answer at temperature 0 equals a non-disaggregated
run, the decode engine's ``external_kv_transfer`` prompt tokens rise by the prompt length, and
the client's and the ledger's cached tokens equal the prefill engine's own cache hit."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvgate.engines.local.fleet import start_pd_pair
from kvgate.engines.local.launcher import LocalEngine, stop
from kvgate.engines.local.model import SERVED_NAME
from kvgate.engines.vllm import VllmAdapter
from kvgate.middleware.framework.composition.quickstart import pd_config_data
from kvgate.plugins.tenancy.cache_salt import derive_salt, tenant_scope
from kvgate.plugins.tenancy.gateway_secret import CACHE_SALT_PURPOSE, GatewaySecret
from kvgate.pricing.backends.select import open_backend
from tests.e2e.conftest import kvgate_serve
from tests.integration.billing_helpers import ALL, Keys, sse_events, write_keys

pytestmark = pytest.mark.e2e
PROMPT = ("The prefill engine computes this prompt and the decode engine pulls its KV cache "
          "over NIXL; the answer must not change. ") * 20  # ~ 500 tokens: several blocks


@pytest.fixture(scope="module")
def pd_pair(tiny_model: Path) -> Iterator[list[LocalEngine]]:
    engines = start_pd_pair()
    try:
        yield engines
    finally:
        for engine in engines:
            stop(engine)


def _metrics(engine: LocalEngine) -> dict[str, float]:
    m = VllmAdapter().parse_metrics(httpx.get(engine.url + "/metrics", timeout=10).text, 0.0)
    return {"external": m.extra.get("prompt_tokens_external_kv_transfer", 0.0),
            "hits": m.prefix_cache_hits or 0.0}


def _body(content: str, stream: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"model": SERVED_NAME, "max_tokens": 12, "temperature": 0,
                            "ignore_eos": True, "stream": stream,
                            "messages": [{"role": "user", "content": content}]}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _config(engines: list[LocalEngine], tmp: Path, keys: Keys) -> dict[str, Any]:
    prefill, decode = engines
    data = pd_config_data([prefill.url], [decode.url], "nixl")
    prices = tmp / "prices.yaml"
    prices.write_text(f"models:\n  {SERVED_NAME}:\n    input_per_mtok: 0.60\n"
                      "    cached_input_per_mtok: 0.10\n    output_per_mtok: 3.00\n")
    data["plugins"] = [
        {"type": "api-keys", "params": {"file": str(keys.path)}},
        {"type": "billing", "params": {"prices": str(prices),
                                       "ledger": f"sqlite://{tmp}/ledger.sqlite",
                                       "spool": str(tmp / "spool")}},
        *data["plugins"]]
    data["pool"] = {"health_interval_s": 0.5, "metrics_interval_s": 0.5}
    return data


def _tenant_salt(config: dict[str, Any], tmp: Path, tenant: str) -> str:
    """Give the config's cache-salt plugin a known secret; the salt it will inject for
    ``tenant``."""
    salting = [p for p in config["plugins"] if p["type"] == "cache-salt"]
    assert salting, "the P/D preset salts requests when API keys are on"
    secret = "pd-e2e-" + "s" * 40
    (tmp / "secret").write_text(secret)
    salting[0]["params"] = {**salting[0].get("params", {}), "secret_file": str(tmp / "secret"),
                            "secret_env": "KVGATE_TEST_UNSET_SECRET"}
    key = GatewaySecret(secret.encode(), "test").derive(CACHE_SALT_PURPOSE)
    return derive_salt(key, tenant_scope(tenant))


def _answer(resp: httpx.Response, stream: bool) -> tuple[str, dict[str, Any]]:
    assert resp.status_code == 200, resp.text
    if not stream:
        data = resp.json()
        assert "kv_transfer_params" not in data
        return data["choices"][0]["message"]["content"], data["usage"]
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]"
    usage = next(e["usage"] for e in events[:-1] if e.get("usage"))
    text = "".join(e["choices"][0]["delta"].get("content") or ""
                   for e in events[:-1] if e.get("choices"))
    return text, usage


@pytest.mark.parametrize("stream", [False, True])
def test_nixl_pair_through_kvgate(pd_pair: list[LocalEngine], tmp_path: Path,
                                  stream: bool) -> None:
    prefill, decode = pd_pair
    content = f"[{'stream' if stream else 'json'}] {PROMPT}"
    keys = write_keys(tmp_path)
    config = _config(pd_pair, tmp_path, keys)
    # the non-disaggregated run, on the prefill engine itself: it also warms its cache, so the
    # two-hop run has a non-zero prefill hit to report. The default preset salts every request
    # with its tenant's cache salt (the user key's tenant, globex): the warm-up carries it too
    salt = _tenant_salt(config, tmp_path, "globex")
    ref = httpx.post(prefill.url + "/v1/chat/completions", json={**_body(content),
                     "cache_salt": salt}, timeout=120)
    assert ref.status_code == 200, ref.text
    expected = ref.json()["choices"][0]["message"]["content"]
    with kvgate_serve(config, tmp_path) as url:
        p0, d0 = _metrics(prefill), _metrics(decode)
        resp = httpx.post(url + "/v1/chat/completions", json=_body(content, stream), timeout=120,
                          headers={**keys.auth("user"), "x-request-id": f"pd-{stream}"})
        text, usage = _answer(resp, stream)
        assert resp.headers["x-kvgate-engine"] == "decode-0"
        assert resp.headers["x-kvgate-prefill-engine"] == "prefill-0"
        p1, d1 = _metrics(prefill), _metrics(decode)
    print(json.dumps({"usage": usage, "prefill_hits": p1["hits"] - p0["hits"],
                      "decode_external": d1["external"] - d0["external"]}))
    assert text == expected
    prompt = usage["prompt_tokens"]
    assert d1["external"] - d0["external"] == pytest.approx(prompt, abs=1)
    prefill_hit = p1["hits"] - p0["hits"]
    assert prefill_hit > 0
    assert usage["prompt_tokens_details"]["cached_tokens"] == prefill_hit
    backend = open_backend(f"sqlite://{tmp_path}/ledger.sqlite")
    try:
        rows = {str(r.client_request_id): r for r in backend.query(*ALL)}
    finally:
        backend.close()
    assert rows[f"pd-{stream}"].cached_tokens == prefill_hit
    assert rows[f"pd-{stream}"].prompt_tokens == prompt
