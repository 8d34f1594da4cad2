"""The Batch API through the whole gateway in-process: the ``async-queue`` plugin (SQLite) runs
the batch on simulated engines, billing records each request once in the ledger at the batch
tier, and the ``openai`` SDK drives it (files.create -> batches.create -> poll ->
files.content). The management app's OpenAPI schema is served at /openapi.json."""

from __future__ import annotations

import asyncio
import json
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvgate.engines.sim.testing import RunningSim
from kvgate.middleware.cli import main
from tests.integration.billing_helpers import (
    billing_config,
    expected_cost,
    ledger_list,
    write_keys,
)
from tests.integration.conftest import gateway, serve_gateway
from tests.integration.test_batches_api import jsonl

BATCH_DISCOUNT = Decimal("0.5")
SYSTEM = "You are the batch test's shared system prompt. " * 40


def async_config(urls: list[str], tmp: Path) -> dict[str, Any]:
    keys = write_keys(tmp)
    data = billing_config(urls, tmp, keys, tier_discounts={"batch": str(BATCH_DISCOUNT)})
    data["plugins"].append({"type": "async-queue", "params": {
        "backend": f"sqlite://{tmp}/jobs.sqlite", "poll_interval_s": 0.02,
        "max_concurrency": 2,
        "management": {"data_dir": str(tmp / "mgmt"), "finalize_interval_s": 0.2}}})
    data["_admin_key"] = keys.admin
    return data


async def test_openai_sdk_batch_through_the_gateway_is_billed_once_at_the_batch_tier(
        tmp_path: Path, fleet: list[RunningSim]) -> None:
    data = async_config([s.url for s in fleet], tmp_path)
    key = data.pop("_admin_key")
    rows = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "sim-model", "max_tokens": 3,
                      "messages": [{"role": "system", "content": SYSTEM},
                                   {"role": "user", "content": f"question {i}"}]}}
            for i in range(12)]
    async with gateway(data) as (app, raw):
        client = openai.AsyncOpenAI(
            api_key=key, base_url="http://gw/v1", max_retries=0,
            http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=app)))
        f = await client.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
        batch = await client.batches.create(input_file_id=f.id,
                                            endpoint="/v1/chat/completions",
                                            completion_window="24h")
        for _ in range(600):
            batch = await client.batches.retrieve(batch.id)
            if batch.status in ("completed", "failed", "expired", "cancelled"):
                break
            await asyncio.sleep(0.05)
        assert batch.status == "completed", batch
        assert batch.request_counts is not None
        assert (batch.request_counts.completed, batch.request_counts.failed) == (12, 0)
        assert batch.output_file_id is not None and batch.error_file_id is None
        out = [json.loads(x) for x in
               (await client.files.content(batch.output_file_id)).content.splitlines()]
        records = {r.request_id: r for r in await ledger_list(app)}
        schema = (await raw.get("/openapi.json")).json()
    assert sorted(o["custom_id"] for o in out) == sorted(f"q{i}" for i in range(12))
    assert len(records) == 12 and set(records) == {o["id"] for o in out}
    hits = 0
    for o in out:
        assert o["response"]["status_code"] == 200 and o["error"] is None
        usage = o["response"]["body"]["usage"]
        rec = records[o["id"]]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        assert (rec.prompt_tokens, rec.completion_tokens, rec.cached_tokens) == (
            usage["prompt_tokens"], usage["completion_tokens"], cached)
        assert rec.service_tier == "batch" and rec.tenant == "acme"
        full = expected_cost(rec.prompt_tokens, rec.cached_tokens, rec.completion_tokens)
        assert rec.cost_total == full - full * BATCH_DISCOUNT
        hits += bool(cached)
    assert hits >= 10, "requests sharing the system prompt should hit the prefix cache"
    assert {"/v1/files", "/v1/batches", "/v1/batches/{batch_id}/cancel",
            "/v1/queue/requests/{job_id}"} <= set(schema["paths"])


async def kvgate(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """The ``kvgate`` command line's ``main`` in a worker thread (this loop keeps serving)."""
    code = await asyncio.to_thread(main, list(args))
    out, err = capsys.readouterr()
    return code, out, err


async def test_kvgate_batch_cli_against_a_served_gateway(
        tmp_path: Path, fleet: list[RunningSim], capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVGATE_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    data = async_config([s.url for s in fleet], tmp_path)
    key = data.pop("_admin_key")
    rows = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": "sim-model", "prompt": f"count to {i}", "max_tokens": 2}}
            for i in range(5)]
    infile = tmp_path / "in.jsonl"
    infile.write_bytes(jsonl(rows))
    async with serve_gateway(data) as (_, url):
        auth = ["--base-url", url, "--api-key", key]
        code, out, err = await kvgate(capsys, "batch", "submit", str(infile), "--endpoint",
                                      "/v1/completions", "--wait", "--poll", "0.1", *auth)
        assert code == 0, err
        batch_id = out.splitlines()[0]
        final = json.loads(out[len(batch_id):])
        assert final["id"] == batch_id and final["status"] == "completed"
        assert final["request_counts"] == {"total": 5, "completed": 5, "failed": 0}
        assert "5/5" in err or "completed" in err  # the progress bar / lines
        code, out, err = await kvgate(capsys, "batch", "results", batch_id, "-o",
                                      str(tmp_path / "out.jsonl"), *auth)
        assert code == 0, err
        lines = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
        assert sorted(x["custom_id"] for x in lines) == [f"c{i}" for i in range(5)]
        assert all(x["response"]["body"]["choices"][0]["text"] for x in lines)
        code, out, _ = await kvgate(capsys, "batch", "status", batch_id, *auth)
        assert code == 0 and json.loads(out)["output_file_id"] == final["output_file_id"]
        code, out, _ = await kvgate(capsys, "batch", "list", *auth)
        assert code == 0 and out.split("\t")[:2] == [batch_id, "completed"]
        code, _, err = await kvgate(capsys, "batch", "cancel", batch_id, *auth)
        assert code == 2 and "HTTP 409" in err and key not in err
        code, _, err = await kvgate(capsys, "batch", "status", batch_id, "--base-url", url)
        assert code == 2 and "HTTP 401" in err
