"""The ``quotas`` plugin's Redis outage policy against a real ``redis-server`` stopped and
started again: rate limits fail open to the replica's own buckets, budgets fail closed (503
``budget_unavailable`` with ``Retry-After``), settlements made during the outage are kept and
replayed, /health, the metrics and one WARNING say so, and Redis restarted empty is seeded
again. Also: what a request reserves (estimates), and the reset format of the headers."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvgate.middleware.framework.errors import ConfigError, RateLimited, ServiceUnavailable
from kvgate.middleware.framework.types import Api, CycleState, InferenceRequest
from kvgate.plugins.billing.plugin import Billing
from kvgate.plugins.quotas.plugin import Quotas, _duration
from kvgate.plugins.tenancy.auth import ApiKey, Limits
from tests.asyncq_helpers import until
from tests.integration.billing_helpers import PRICES_YAML
from tests.servers import REDIS_SERVER, RedisServer, redis_running

pytest.importorskip("redis", reason="the 'redis' package is not installed (kvgate[redis])")

BUDGETED = ApiKey("b", "acme", None, False, Decimal("1.00"), tenant_budget_usd=Decimal("5"))
LIMITED = ApiKey("l", "acme", None, False, None, Limits(requests_per_min=1000))
FREE = ApiKey("f", "acme", None, False, None)


class Lookup:
    def __init__(self, **plugins: object) -> None:
        self.plugins = plugins

    def lookup(self, name: str) -> object:
        if name not in self.plugins:
            raise ConfigError(f"plugin {name!r} is referenced but not declared before it")
        return self.plugins[name]


def _billing(tmp: Path) -> Billing:
    (tmp / "prices.yaml").write_text(PRICES_YAML)
    return Billing("billing", Billing.Params(prices=str(tmp / "prices.yaml"), auth=None),
                   Lookup())


def _quotas(tmp: Path, **params: Any) -> Quotas:
    return Quotas("quotas", Quotas.Params.model_validate(params), Lookup(billing=_billing(tmp)))


def _req(key: ApiKey, rid: str, body: dict[str, Any] | None = None) -> InferenceRequest:
    r = InferenceRequest(request_id=rid, api=Api.CHAT, model="sim-model", body=body or {},
                         headers={}, stream=False, client_wants_usage=False,
                         prompt_token_estimate=100, received_at=time.monotonic())
    r.principal, r.tenant, r.key_id = key, key.tenant, key.key_id
    return r


async def _admit(q: Quotas, key: ApiKey, rid: str) -> tuple[InferenceRequest, CycleState]:
    req, state = _req(key, rid), CycleState()
    await q.on_request(req, state)
    return req, state


def _metrics(q: Quotas) -> str:
    registry = CollectorRegistry()
    registry.register(q.collector())
    return generate_latest(registry).decode()


@pytest.fixture
async def redis_quotas(tmp_path: Path) -> AsyncIterator[tuple[Quotas, RedisServer]]:
    if REDIS_SERVER is None:
        pytest.skip("redis-server not installed")
    with redis_running() as server:  # stopped after the test (it was left running)
        q = _quotas(tmp_path, redis_url=server.url, redis_timeout_s=2.0, redis_retry_s=0.1)
        await q.start()
        try:
            yield q, server
        finally:
            await q.stop()
        server.stop()


async def test_outage_fails_open_for_limits_and_closed_for_budgets(
        redis_quotas: tuple[Quotas, RedisServer], caplog: pytest.LogCaptureFixture) -> None:
    q, server = redis_quotas
    caplog.set_level(logging.WARNING, logger="kvgate.plugins.quotas")
    before = await _admit(q, BUDGETED, "before")  # admitted through Redis, settles later
    assert q.counts["seeds"] == 2  # the key and its tenant, seeded from the (empty) ledger
    server.stop()
    with pytest.raises(ServiceUnavailable) as closed:
        await _admit(q, BUDGETED, "during-b")
    assert closed.value.status == 503 and closed.value.code == "budget_unavailable"
    assert int(closed.value.headers["retry-after"]) >= 1
    req, state = await _admit(q, LIMITED, "during-l")  # fail open: local buckets
    await q.on_request_end(req, state, 200)
    await q.on_request_end(*before, 200)  # kept for replay
    assert (q.health()["state"], q.health()["pending_settlements"]) == ("down", 1)
    assert 'kvgate_quota_store_up{backend="redis"} 0.0' in _metrics(q)
    assert q.counts["fallback_admissions"] == 1 and q.counts["closed_rejections"] == 1
    server.start()  # back, empty

    async def replayed() -> bool:
        return q.health()["state"] == "ok" and not q.pending
    await until(replayed, 10)
    assert q.counts["settlements_replayed"] == 1
    await q.on_request_end(*await _admit(q, BUDGETED, "after"), 200)  # seeded again
    assert q.counts["seeds"] == 4
    warnings = [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "redis://" not in caplog.text  # the URL (it may hold a password) is never logged


async def test_estimates_and_refusals_in_process(tmp_path: Path) -> None:
    q = _quotas(tmp_path)
    cases: list[tuple[dict[str, Any], int]] = [({"max_tokens": 7}, 7), ({"max_completion_tokens": 9, "max_tokens": 7}, 9),
             ({"max_output_tokens": 11}, 11), ({}, 4096), ({"max_tokens": True}, 4096)]
    for i, (body, output) in enumerate(cases):
        req, state = _req(BUDGETED, f"e{i}", body), CycleState()
        await q.on_request(req, state)
        ticket = state.get(q._ticket)
        assert ticket is not None and ticket.ask.output_tokens == output, body
        assert ticket.ask.input_tokens == 125 + 16  # estimate x prompt_factor + overhead
        await q.on_request_end(req, state, 200)
    free_req, free_state = _req(FREE, "free"), CycleState()
    await q.on_request(free_req, free_state)
    assert free_state.get(q._ticket) is None  # nothing applies: no store call, no ticket
    broke = ApiKey("x", "acme", None, False, Decimal("0"))
    with pytest.raises(RateLimited) as refused:
        await _admit(q, broke, "broke")
    assert refused.value.code == "insufficient_quota"
    assert 'kvgate_quota_rejections_total{dimension="budget",scope="key"} 1.0' in _metrics(q)


@pytest.mark.parametrize(("ms", "text"), [(0, "0ms"), (20, "20ms"), (1000, "1s"),
                                          (1001, "2s"), (59_500, "1m0s"), (360_000, "6m0s")])
def test_reset_format(ms: int, text: str) -> None:
    assert _duration(ms) == text
