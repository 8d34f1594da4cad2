"""Billing on real vLLM CPU engines: a multi-turn session through ``kvgate serve`` with the
api-keys and billing plugins. The ledger rows carry the engine-reported cached tokens
(multiples of vLLM's CPU block size, 128, and > 0 from the second turn) and the discounted
cost; ``kvgate usage export`` (CSV and JSONL) and the Usage API agree with the ledger."""

from __future__ import annotations

import csv
import json
import subprocess
import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvgate.engines.local.launcher import LocalEngine
from kvgate.engines.local.model import SERVED_NAME
from kvgate.pricing.records import LedgerRecord
from tests.e2e.conftest import KVGATE, kvgate_serve, precise_plugins
from tests.integration.billing_helpers import (
    Keys,
    expected_cost,
    final_ledger_rows,
    sse_events,
    write_keys,
)

pytestmark = pytest.mark.e2e
BLOCK = 128  # vLLM's CPU KV block size
PREFIX = ("You are the billing auditor of a small shop. Every answer must be checked against "
          "the ledger, line by line, before it is signed. ") * 24  # ~ 650 tokens: > 2 blocks
TURNS = [(False, None), (False, None), (True, False), (True, True)]  # (stream, include_usage)


def _prices(tmp: Path) -> Path:
    path = tmp / "prices.yaml"
    path.write_text(f"models:\n  {SERVED_NAME}:\n    input_per_mtok: 0.60\n"
                    "    cached_input_per_mtok: 0.10\n    output_per_mtok: 3.00\n"
                    "tenants:\n  globex: {discount: 0.25}\n")
    return path


def _config(engines: list[LocalEngine], events_port: int, model_dir: Path, tmp: Path,
            keys: Keys) -> dict[str, Any]:
    return {
        "pool": {"health_interval_s": 0.5, "metrics_interval_s": 0.5},
        "engines": [{"name": e.name, "url": e.url} for e in engines],
        "plugins": [
            {"type": "api-keys", "params": {"file": str(keys.path)}},
            {"type": "billing", "params": {
                "prices": str(_prices(tmp)), "ledger": f"sqlite://{tmp}/ledger.sqlite",
                "spool": str(tmp / "spool")}},
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
def billed(vllm_fleet: list[LocalEngine], events_port: int, tiny_model: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, Keys]]:
    tmp = tmp_path_factory.mktemp("billing")
    keys = write_keys(tmp)
    with kvgate_serve(_config(vllm_fleet, events_port, tiny_model, tmp, keys), tmp) as url:
        yield url, tmp, keys


def _turn(url: str, keys: Keys, messages: list[dict[str, str]], rid: str, stream: bool,
          include_usage: bool | None) -> tuple[httpx.Response, str]:
    body: dict[str, Any] = {"model": SERVED_NAME, "messages": messages, "max_tokens": 8,
                            "temperature": 0, "ignore_eos": True, "stream": stream}
    if include_usage is not None:
        body["stream_options"] = {"include_usage": include_usage}
    resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=120,
                      headers={**keys.auth("user"), "x-request-id": rid})
    assert resp.status_code == 200, resp.text
    if not stream:
        return resp, resp.json()["choices"][0]["message"]["content"]
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]"
    assert any(e.get("usage") for e in events[:-1]) == bool(include_usage)
    return resp, "".join(e["choices"][0]["delta"].get("content") or ""
                         for e in events[:-1] if e.get("choices"))


def _usage_api(url: str, keys: Keys, expect: int) -> dict[str, Any]:
    now = int(time.time())
    query = (f"/v1/organization/usage/completions?start_time={now - 3600}&end_time="
             f"{now + 3600}&bucket_width=1h&group_by=model,project_id")
    deadline = time.monotonic() + 10
    while True:  # committed records only: the writer batches every 50 ms
        page: dict[str, Any] = httpx.get(url + query, headers=keys.auth("admin")).json()
        seen = sum(r["num_model_requests"] for b in page["data"] for r in b["results"])
        if seen >= expect or time.monotonic() > deadline:
            return page
        time.sleep(0.1)


def test_multi_turn_session_is_billed_with_reported_cached_tokens(
        billed: tuple[str, Path, Keys]) -> None:
    url, tmp, keys = billed
    messages = [{"role": "system", "content": PREFIX}]
    headers: dict[str, str] = {}
    for i, (stream, include_usage) in enumerate(TURNS):
        messages.append({"role": "user", "content": f"Check entry number {i} of the ledger."})
        resp, answer = _turn(url, keys, messages, f"turn-{i}", stream, include_usage)
        messages.append({"role": "assistant", "content": answer})
        if not stream:
            headers[f"turn-{i}"] = resp.headers["x-kvgate-cost-usd"]
            usage = resp.json()["usage"]
            headers[f"usage-{i}"] = json.dumps(usage)
    rows = final_ledger_rows(tmp / "ledger.sqlite", [f"turn-{i}" for i in range(len(TURNS))])
    page = _usage_api(url, keys, len(TURNS))
    for rid, r in sorted(rows.items()):
        print(f"{rid}: engine {r.engine}, prompt {r.prompt_tokens}, cached {r.cached_tokens}, "
              f"completion {r.completion_tokens}, cost {r.cost_total}")
    _check_rows(rows, headers)
    _check_usage_api(page, rows)
    for fmt in ("csv", "jsonl"):
        _check_export(tmp, fmt, rows)


def _check_rows(rows: dict[str, LedgerRecord], headers: dict[str, str]) -> None:
    previous = 0
    for i in range(len(TURNS)):
        r = rows[f"turn-{i}"]
        assert (r.tenant, r.model, r.outcome, r.priced) == ("globex", SERVED_NAME, "done", True)
        assert r.cached_source == "reported" and r.cached_tokens is not None
        assert r.cached_tokens % BLOCK == 0
        assert r.prompt_tokens > previous > 0 or i == 0  # the session grows every turn
        if i > 0:  # the same engine holds the whole previous prompt's full blocks
            assert r.cached_tokens > 2 * BLOCK
            assert r.cached_tokens >= (previous // BLOCK - 1) * BLOCK
        previous = r.prompt_tokens
        assert r.completion_tokens == 8
        assert r.cost_total == expected_cost(r.prompt_tokens, r.cached_tokens,
                                             r.completion_tokens, "globex")
        assert r.cost_total < expected_cost(r.prompt_tokens, 0, r.completion_tokens, "globex") \
            or i == 0  # the cached prefix is billed at the cached price
        if f"turn-{i}" in headers:
            assert Decimal(headers[f"turn-{i}"]) == r.cost_total
            usage = json.loads(headers[f"usage-{i}"])
            assert usage["prompt_tokens_details"]["cached_tokens"] == r.cached_tokens
            assert usage["prompt_tokens"] == r.prompt_tokens


def _check_usage_api(page: dict[str, Any], rows: dict[str, LedgerRecord]) -> None:
    [result] = [r for b in page["data"] for r in b["results"]]
    assert (result["model"], result["project_id"]) == (SERVED_NAME, "globex")
    assert result["num_model_requests"] == len(rows)
    assert result["input_tokens"] == sum(r.prompt_tokens for r in rows.values())
    assert result["input_cached_tokens"] == sum(r.cached_tokens or 0 for r in rows.values())
    assert result["output_tokens"] == sum(r.completion_tokens for r in rows.values())
    assert Decimal(result["kvgate"]["cost_usd"]) == sum(
        (r.cost_total for r in rows.values()), Decimal(0))


def _check_export(tmp: Path, fmt: str, rows: dict[str, LedgerRecord]) -> None:
    out = tmp / f"export.{fmt}"
    subprocess.run([KVGATE, "usage", "export", "--ledger", f"sqlite://{tmp}/ledger.sqlite",
                    "--since", "2020-01-01", "--until", "2100-01-01", "--format", fmt,
                    "--out", str(out)], check=True, capture_output=True, timeout=60)
    lines = out.read_text().splitlines()
    if fmt == "jsonl":
        got = {str(r.client_request_id): r for r in map(LedgerRecord.from_json, lines)}
        assert got == rows
        return
    exported = {e["client_request_id"]: e for e in csv.DictReader(lines)}
    assert sorted(exported) == sorted(rows)
    for rid, e in exported.items():
        r = rows[rid]
        assert (int(e["prompt_tokens"]), int(e["cached_tokens"]), int(e["completion_tokens"]),
                Decimal(e["cost_total"])) == (r.prompt_tokens, r.cached_tokens,
                                              r.completion_tokens, r.cost_total)
