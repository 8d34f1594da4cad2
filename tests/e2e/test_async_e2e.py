"""Async inference on real vLLM CPU engines through ``kvgate serve``: the real ``openai`` SDK
runs an OpenAI Batch end to end (files.create -> batches.create -> poll -> files.content) on
requests sharing a long system prompt. The output lines match the requests, the engines
report cached tokens, and the ledger holds one record per request at the ``batch`` tier,
discounted, whose tokens are the output lines' usage."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import openai
import pytest

from kvgate.engines.local.launcher import LocalEngine
from kvgate.engines.local.model import SERVED_NAME
from kvgate.pricing.backends.select import open_backend
from tests.e2e.conftest import kvgate_serve, precise_plugins
from tests.integration.billing_helpers import ALL, Keys, write_keys

pytestmark = pytest.mark.e2e
BATCH_DISCOUNT = Decimal("0.5")
INPUT, CACHED, OUTPUT = Decimal("0.60"), Decimal("0.10"), Decimal("3.00")
PREFIX = ("You review pull requests for a payments service. Flag every change that touches "
          "money, rounding or idempotency, and explain why in one sentence. ") * 24
REQUESTS = 10


def _config(engines: list[LocalEngine], events_port: int, model_dir: Path, tmp: Path,
            keys: Keys) -> dict[str, Any]:
    prices = tmp / "prices.yaml"
    prices.write_text(f"models:\n  {SERVED_NAME}:\n    input_per_mtok: {INPUT}\n"
                      f"    cached_input_per_mtok: {CACHED}\n    output_per_mtok: {OUTPUT}\n")
    return {
        "pool": {"health_interval_s": 0.5, "metrics_interval_s": 0.5},
        "engines": [{"name": e.name, "url": e.url} for e in engines],
        "plugins": [
            {"type": "api-keys", "params": {"file": str(keys.path)}},
            {"type": "billing", "params": {
                "prices": str(prices), "ledger": f"sqlite://{tmp}/ledger.sqlite",
                "spool": str(tmp / "spool"),
                "tier_discounts": {"batch": str(BATCH_DISCOUNT)}}},
            {"type": "async-queue", "params": {
                "backend": f"sqlite://{tmp}/jobs.sqlite", "max_concurrency": 2,
                "management": {"data_dir": str(tmp / "mgmt"), "finalize_interval_s": 0.5}}},
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
    tmp = tmp_path_factory.mktemp("async")
    keys = write_keys(tmp)
    with kvgate_serve(_config(vllm_fleet, events_port, tiny_model, tmp, keys), tmp) as url:
        yield url, tmp, keys


def test_openai_sdk_batch_on_vllm_is_cached_and_billed_once_at_the_batch_tier(
        served: tuple[str, Path, Keys]) -> None:
    url, tmp, keys = served
    client = openai.OpenAI(base_url=url + "/v1", api_key=keys.admin, max_retries=2)
    rows: list[dict[str, Any]] = [{"custom_id": f"pr-{i}", "method": "POST",
             "url": "/v1/chat/completions",
             "body": {"model": SERVED_NAME, "max_tokens": 4, "temperature": 0,
                      "ignore_eos": True,
                      "messages": [{"role": "system", "content": PREFIX},
                                   {"role": "user", "content": f"Review change number {i}."}]}}
            for i in range(REQUESTS)]
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    uploaded = client.files.create(file=("prs.jsonl", data), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"suite": "e2e"})
    deadline = time.monotonic() + 300
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.5)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    assert batch.request_counts is not None
    assert (batch.request_counts.total, batch.request_counts.completed) == (REQUESTS, REQUESTS)
    assert batch.output_file_id is not None and batch.error_file_id is None
    out = [json.loads(x) for x in client.files.content(batch.output_file_id).content.splitlines()]
    assert sorted(o["custom_id"] for o in out) == sorted(r["custom_id"] for r in rows)
    backend = open_backend(f"sqlite://{tmp}/ledger.sqlite")
    try:
        deadline = time.monotonic() + 10
        while len(records := {r.request_id: r for r in backend.query(*ALL)}) < REQUESTS:
            assert time.monotonic() < deadline, "ledger records missing"
            time.sleep(0.1)
    finally:
        backend.close()
    assert set(records) == {o["id"] for o in out}
    hits = 0
    for o in out:
        assert o["response"]["status_code"] == 200 and o["error"] is None
        body = o["response"]["body"]
        assert body["model"] == SERVED_NAME and body["choices"][0]["message"]["content"]
        usage = body["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        rec = records[o["id"]]
        assert (rec.prompt_tokens, rec.completion_tokens, rec.cached_tokens) == (
            usage["prompt_tokens"], usage["completion_tokens"], cached)
        assert rec.service_tier == "batch" and rec.status == 200
        hit = cached or 0
        full = ((rec.prompt_tokens - hit) * INPUT + hit * CACHED
                + rec.completion_tokens * OUTPUT) / Decimal(1_000_000)
        assert rec.cost_total == full - full * BATCH_DISCOUNT
        hits += hit > 0
    assert hits >= REQUESTS // 2, "requests sharing the system prompt should hit vLLM's cache"
