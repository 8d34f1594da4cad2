"""The billing plugin through the gateway (create_app, in-process simulated engines, httpx over
ASGITransport): auth failures, budgets, the cost header and the ledger row against the issue's
formula (JSON and streams), unknown and estimated cached tokens, idempotency by request id,
client disconnects and engine failures, and the serve flags that turn billing on."""

from __future__ import annotations

import asyncio
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvgate.engines.sim.core.faults import FaultSpec
from kvgate.middleware.framework.composition.config import parse_config, with_billing
from kvgate.middleware.framework.composition.quickstart import config_from_engines
from kvgate.middleware.framework.errors import ConfigError
from kvgate.pricing.spool import SpoolError
from tests.integration.billing_helpers import (
    Keys,
    billing_config,
    billing_of,
    expected_cost,
    ledger_list,
    ledger_rows,
    long_chat,
    sse_events,
    write_keys,
)
from tests.integration.conftest import gateway, serve_gateway, sim_fleet

USAGE = "/v1/organization/usage/completions?bucket_width=1h&start_time="


def _usage_url() -> str:
    """The last hour and the next, in hourly buckets (now falls into one of them)."""
    return USAGE + str(int(time.time()) - 3600) + f"&end_time={int(time.time()) + 3600}"
AUTH_CASES = [
    # (case, role or raw header, path, status, code)
    ("no key", None, "chat", 401, "invalid_api_key"),
    ("unknown key", "Bearer kvg-not-a-key", "chat", 401, "invalid_api_key"),
    ("not bearer", "Basic YWxhZGRpbjpvcGVu", "chat", 401, "invalid_api_key"),
    ("model not allowed", "narrow", "chat", 403, "model_not_allowed"),
    ("usage api, no key", None, "usage", 401, "invalid_api_key"),
    ("usage api, not admin", "user", "usage", 403, "admin_required"),
    ("usage api, admin", "admin", "usage", 200, None),
    ("chat, ok", "user", "chat", 200, None),
]


def _headers(keys: Keys, who: str | None) -> dict[str, str]:
    if who is None:
        return {}
    if " " in who:
        return {"authorization": who}
    return keys.auth(who)


async def test_auth_failures_in_openai_shape(tmp_path: Path) -> None:
    keys = write_keys(tmp_path)
    async with sim_fleet(1) as sims, \
            gateway(billing_config([sims[0].url], tmp_path, keys)) as (app, client):
        for case, who, path, status, code in AUTH_CASES:
            headers = _headers(keys, who)
            if path == "chat":
                resp = await client.post("/v1/chat/completions", json=long_chat(),
                                         headers=headers)
            else:
                resp = await client.get(_usage_url(), headers=headers)
            assert resp.status_code == status, (case, resp.text)
            if code is not None:
                error = resp.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}, case
                assert error["code"] == code, case
                assert error["type"] in {"authentication_error", "permission_error"}, case
        rows = await ledger_rows(app)
    assert [r.key_id for r in rows.values()] == ["globex-1"]  # rejected requests cost nothing


async def test_budget_exceeded_is_429_insufficient_quota(tmp_path: Path) -> None:
    keys = write_keys(tmp_path)
    async with sim_fleet(1) as sims:
        data = billing_config([sims[0].url], tmp_path, keys)
        async with gateway(data) as (app, client):
            first = await client.post("/v1/chat/completions", json=long_chat(),
                                      headers=keys.auth("budget"))
            assert first.status_code == 200
            assert Decimal(first.headers["x-kvgate-cost-usd"]) > Decimal("0.00001")
            second = await client.post("/v1/chat/completions", json=long_chat(1),
                                       headers=keys.auth("budget"))
            assert second.status_code == 429
            assert second.json()["error"]["code"] == "insufficient_quota"
            other = await client.post("/v1/chat/completions", json=long_chat(),
                                      headers=keys.auth("admin"))
            assert other.status_code == 200
            rows = await ledger_rows(app)
        assert sorted(r.key_id for r in rows.values()) == ["acme-admin", "acme-budget"]
        async with gateway(data) as (_, client):  # the spend is read back from the ledger
            again = await client.post("/v1/chat/completions", json=long_chat(2),
                                      headers=keys.auth("budget"))
            assert again.status_code == 429


STREAM_CASES = [(False, None), (True, True), (True, False), (True, None)]


@pytest.mark.parametrize(("stream", "include_usage"), STREAM_CASES)
@pytest.mark.parametrize("role", ["admin", "user"])
async def test_cost_header_and_ledger_match_the_formula(
        tmp_path: Path, stream: bool, include_usage: bool | None, role: str) -> None:
    keys = write_keys(tmp_path)
    async with sim_fleet(1) as sims, \
            gateway(billing_config([sims[0].url], tmp_path, keys)) as (app, client):
        reference = (await client.post("/v1/chat/completions", json=long_chat(),
                                       headers=keys.auth(role))).json()["usage"]
        body = long_chat(stream=stream, include_usage=include_usage)
        resp = await client.post("/v1/chat/completions", json=body,
                                 headers={**keys.auth(role), "x-request-id": "billed-1"})
        assert resp.status_code == 200
        rows = await ledger_rows(app)
    row = rows["billed-1"]
    tenant = "acme" if role == "admin" else "globex"
    assert (row.tenant, row.engine, row.outcome, row.priced) == (tenant, "sim-0", "done", True)
    assert row.cost_total == expected_cost(row.prompt_tokens, row.cached_tokens,
                                           row.completion_tokens, tenant)
    assert row.cached_source == "reported"
    assert row.cached_tokens is not None and row.cached_tokens > 0  # the second call hits
    assert row.cached_tokens % sims[0].config.block_size == 0
    assert (row.prompt_tokens, row.completion_tokens) == (reference["prompt_tokens"], 5)
    if not stream:
        usage = resp.json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == row.cached_tokens
        header = resp.headers["x-kvgate-cost-usd"]
        assert "E" not in header and Decimal(header) == row.cost_total
        return
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]"
    with_usage = [e for e in events[:-1] if e.get("usage")]
    if include_usage:
        usage = with_usage[-1]["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (
            row.prompt_tokens, row.completion_tokens)
        assert usage["prompt_tokens_details"]["cached_tokens"] == row.cached_tokens
    else:
        assert with_usage == []  # kvgate asked the engine for it, and stripped it


@pytest.mark.parametrize("estimate", [False, True])
async def test_unknown_cached_tokens(tmp_path: Path, estimate: bool) -> None:
    keys = write_keys(tmp_path)
    producers = [{"type": "tokenizer", "params": {"tokenizer": {"kind": "module",
                                                                "module": "sim"}}},
                 {"type": "prefix-cache-producer", "params": {"mode": "approximate"}}]
    async with sim_fleet(1, enable_prompt_tokens_details=False) as sims:
        data = billing_config([sims[0].url], tmp_path, keys, estimate_cached=estimate,
                              plugins_before=producers)
        async with gateway(data) as (app, client):
            for turn in (1, 2):
                resp = await client.post("/v1/chat/completions", json=long_chat(),
                                         headers={**keys.auth("admin"),
                                                  "x-request-id": f"turn-{turn}"})
                assert "prompt_tokens_details" not in resp.json()["usage"]
            rows = await ledger_rows(app)
            page = (await client.get(_usage_url(), headers=keys.auth("admin"))).json()
    first, second = rows["turn-1"], rows["turn-2"]
    # unknown is None, never 0; an estimate is flagged (the index held nothing at first)
    assert (first.cached_tokens, first.cached_source) == (
        (0, "estimated") if estimate else (None, "unknown"))
    assert first.cost_total == expected_cost(first.prompt_tokens, None, first.completion_tokens)
    if not estimate:
        assert (second.cached_tokens, second.cached_source) == (None, "unknown")
    else:  # the gateway's own record of the first request's blocks, 64 tokens each
        assert second.cached_source == "estimated"
        assert second.cached_tokens is not None
        assert 0 < second.cached_tokens <= second.prompt_tokens
        assert second.cached_tokens % 64 == 0
    assert second.cost_total == expected_cost(second.prompt_tokens, second.cached_tokens,
                                              second.completion_tokens)
    [result] = [r for b in page["data"] for r in b["results"]]
    assert result["kvgate"]["cached_unknown_requests"] == (0 if estimate else 2)
    assert result["kvgate"]["cached_estimated_requests"] == (2 if estimate else 0)
    assert result["input_cached_tokens"] == (second.cached_tokens or 0)


async def test_a_reused_client_request_id_is_billed_per_request(tmp_path: Path) -> None:
    """Two requests with one client ``x-request-id``: two records (kvgate's own ids), both
    carrying the client's id, and each made final over its durable usage-time write."""
    keys = write_keys(tmp_path)
    async with sim_fleet(1) as sims, \
            gateway(billing_config([sims[0].url], tmp_path, keys)) as (app, client):
        for turn, max_tokens in enumerate((3, 7)):
            resp = await client.post("/v1/chat/completions",
                                     json=long_chat(turn, max_tokens=max_tokens),
                                     headers={**keys.auth("admin"), "x-request-id": "dup"})
            assert resp.status_code == 200 and resp.headers["x-request-id"] == "dup"
        rows = await ledger_list(app)
        ledger = billing_of(app).ledger
        assert ledger is not None
        accepted = ledger.stats.accepted
    assert [r.client_request_id for r in rows] == ["dup", "dup"]
    assert len({r.request_id for r in rows}) == 2 and "dup" not in {r.request_id for r in rows}
    assert [r.completion_tokens for r in rows] == [3, 7]
    assert all(r.outcome == "done" and r.cost_total > 0 for r in rows)
    assert accepted == 4  # per request: durable at usage time, final at completion


FAILURES = [
    # (case, faults on sim-0, stream, retries, outcome, status, engine, tokens processed)
    ("engine 503, no retry", {"fail_next": 1, "status": 503}, False, 0,
     "upstream_error", 502, "sim-0", False),
    ("engine 503, retried", {"fail_next": 1, "status": 503}, False, 1,
     "done", 200, "sim-1", True),
    ("stream cut mid-way", {"drop_after_chunks": 3}, True, 1,
     "upstream_error", 200, "sim-0", True),
]


@pytest.mark.parametrize(("case", "faults", "stream", "retries", "outcome", "status",
                          "engine", "processed"), FAILURES, ids=[f[0] for f in FAILURES])
async def test_engine_failure_is_one_record(
        tmp_path: Path, case: str, faults: dict[str, Any], stream: bool, retries: int,
        outcome: str, status: int, engine: str, processed: bool) -> None:
    keys = write_keys(tmp_path)
    async with sim_fleet(2) as sims:
        data = billing_config([s.url for s in sims], tmp_path, keys,
                              server={"retries": retries}, picker="round-robin-picker")
        async with gateway(data) as (app, client):
            sims[0].faults.apply(FaultSpec(**faults))  # round robin: sim-0 is tried first
            body = long_chat(stream=stream, max_tokens=20)
            resp = await client.post("/v1/chat/completions", json=body,
                                     headers={**keys.auth("admin"), "x-request-id": "f-1"})
            assert resp.status_code == status, case
            rows = await ledger_rows(app)
        assert sims[0].faults.fail_next == 0 and sims[0].faults.drop_streams == 0, case
    assert list(rows) == ["f-1"], case
    row = rows["f-1"]
    assert (row.outcome, row.status, row.engine) == (outcome, status, engine), case
    assert (row.prompt_tokens > 0) == processed, case
    if outcome == "upstream_error" and processed:  # what reached the client, unpriced usage
        assert 0 < row.completion_tokens <= 3
        assert not row.priced
        assert row.cached_source == "unknown"
    assert row.cost_total == expected_cost(row.prompt_tokens, row.cached_tokens,
                                           row.completion_tokens)


@pytest.mark.parametrize("stream", [True, False])
async def test_client_disconnect_is_one_record(tmp_path: Path, stream: bool) -> None:
    keys = write_keys(tmp_path)
    # time_scale 1: a 2,000-token answer takes ~10 s, so it is running when the client leaves
    async with sim_fleet(1, time_scale=1.0) as sims, \
            serve_gateway(billing_config([sims[0].url], tmp_path, keys)) as (app, url):
        body = {**long_chat(stream=stream, max_tokens=2000), "ignore_eos": True}
        headers = {**keys.auth("admin"), "x-request-id": "gone"}
        async with aiohttp.ClientSession() as session:
            if stream:
                resp = await session.post(url + "/v1/chat/completions", json=body,
                                          headers=headers)
                assert (await resp.content.readany()).startswith(b"data: ")
                resp.close()
            else:
                pending = asyncio.create_task(session.post(
                    url + "/v1/chat/completions", json=body, headers=headers))
                for _ in range(500):
                    if sims[0].engine.num_running:
                        break
                    await asyncio.sleep(0.01)
                pending.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await pending
        for _ in range(250):
            rows = await ledger_rows(app)
            if rows:
                break
            await asyncio.sleep(0.02)
    assert list(rows) == ["gone"]
    row = rows["gone"]
    assert (row.outcome, row.status) == ("client_disconnect", 200 if stream else 499)
    assert row.prompt_tokens > 0 and not row.priced
    assert (row.cached_tokens, row.cached_source) == (None, "unknown")
    assert row.completion_tokens < 2000


def test_serve_flags_compose_billing(tmp_path: Path) -> None:
    quick = with_billing(config_from_engines(["http://127.0.0.1:9"]), prices="p.yaml",
                         ledger="sqlite:///tmp/l.db")
    assert [(p.type, p.params) for p in quick.plugins[:2]] == [
        ("api-keys", {"disabled": True}),
        ("billing", {"prices": "p.yaml", "ledger": "sqlite:///tmp/l.db"})]
    keyed = with_billing(quick, keys="keys.yaml", prices="q.yaml")
    assert [(p.type, p.params) for p in keyed.plugins[:2]] == [
        ("api-keys", {"disabled": False, "file": "keys.yaml"}),
        ("billing", {"prices": "q.yaml", "ledger": "sqlite:///tmp/l.db"})]
    assert len(keyed.plugins) == len(quick.plugins)  # overridden, not added twice
    plain = config_from_engines(["http://127.0.0.1:9"])
    assert with_billing(plain) == plain
    with pytest.raises(ConfigError, match="need --prices"):
        with_billing(plain, ledger="sqlite:///tmp/l.db")
    filed = parse_config({**plain.model_dump(exclude={"source"}), "server": {"port": 1}}, "f")
    assert with_billing(filed, prices="p.yaml").server.port == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_unwritable_spool_fails_the_request(tmp_path: Path, stream: bool,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """No answer is completed that has no durable record (a full disk, injected)."""
    keys = write_keys(tmp_path)
    async with sim_fleet(1) as sims, \
            serve_gateway(billing_config([sims[0].url], tmp_path, keys)) as (app, url):
        ledger = billing_of(app).ledger
        assert ledger is not None

        def disk_full(lines: list[bytes]) -> None:
            raise SpoolError("spool: No space left on device")

        monkeypatch.setattr(ledger._spool, "append", disk_full)
        async with aiohttp.ClientSession() as session, session.post(
                url + "/v1/chat/completions", json=long_chat(stream=stream),
                headers=keys.auth("admin")) as resp:
            if stream:  # the headers went out before the usage came: the stream is cut
                assert resp.status == 200
                with pytest.raises(aiohttp.ClientPayloadError):
                    await resp.read()
            else:
                assert resp.status == 500
                assert (await resp.json())["error"]["code"] == "internal_error"
        assert ledger.stats.accepted == 0
