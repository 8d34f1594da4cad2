"""What the ``quotas`` plugin adds to a request: its admission (request hook) plus its
settlement (request-end hook), in process, for a key without limits (no store call), the
in-process store, and Redis (a real ``redis-server`` on loopback: one script call each way).
Writes bench/results/quotas.json.

    python -m bench.quotas [--requests 5000] [--concurrency 32] [--trials 3]

Figures are the median over trials of the mean cost per request (sequential: latency added to
one request; concurrent: the plugin's throughput with ``concurrency`` requests in flight).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

from kvgate.middleware.framework.types import Api, CycleState, InferenceRequest
from kvgate.plugins.billing.plugin import Billing
from kvgate.plugins.quotas.plugin import Quotas
from kvgate.plugins.tenancy.auth import ApiKey, Limits
from tests.integration.billing_helpers import PRICES_YAML
from tests.plugin_helpers import NoLookup
from tests.servers import RedisServer

BIG = Limits(requests_per_min=10**9, input_tokens_per_min=10**12,
             output_tokens_per_min=10**12, max_concurrent=10**6)
KEYS = {
    "no limits": ApiKey("free", "t", None, False, None),
    "limits (key + tenant)": ApiKey("lim", "t", None, False, None, BIG, tenant_limits=BIG),
    "limits + budgets": ApiKey("bud", "t", None, False, Decimal(10**6), BIG,
                               tenant_budget_usd=Decimal(10**6), tenant_limits=BIG),
}


def _req(key: ApiKey, i: int) -> InferenceRequest:
    r = InferenceRequest(request_id=f"r{i}", api=Api.CHAT, model="sim-model",
                         body={"max_tokens": 64},
                         headers={}, stream=False, client_wants_usage=False,
                         prompt_token_estimate=500, received_at=time.monotonic())
    r.principal, r.tenant, r.key_id = key, key.tenant, key.key_id
    return r


async def _one(q: Quotas, key: ApiKey, i: int) -> None:
    req, state = _req(key, i), CycleState()
    await q.on_request(req, state)
    await q.on_request_end(req, state, 200)


async def _trial(q: Quotas, key: ApiKey, n: int, concurrency: int) -> float:
    """Mean seconds per request."""
    sem = asyncio.Semaphore(concurrency)

    async def bounded(i: int) -> None:
        async with sem:
            await _one(q, key, i)
    t0 = time.perf_counter()
    await asyncio.gather(*(bounded(i) for i in range(n)))
    return (time.perf_counter() - t0) / n


async def _measure(q: Quotas, n: int, concurrency: int, trials: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, key in KEYS.items():
        await _trial(q, key, min(n, 200), 1)  # warm-up (script load, scopes)
        seq = [await _trial(q, key, n, 1) for _ in range(trials)]
        par = [await _trial(q, key, n, concurrency) for _ in range(trials)]
        out[name] = {"sequential_us": round(statistics.median(seq) * 1e6, 1),
                     "concurrent_us": round(statistics.median(par) * 1e6, 1)}
    return out


class _Lookup:
    def __init__(self, billing: Billing) -> None:
        self.billing = billing

    def lookup(self, name: str) -> object:
        return self.billing


async def main(n: int, concurrency: int, trials: int) -> dict[str, Any]:
    results: dict[str, Any] = {"requests": n, "concurrency": concurrency, "trials": trials}
    with tempfile.TemporaryDirectory() as tmp:
        prices = Path(tmp) / "prices.yaml"
        prices.write_text(PRICES_YAML)
        billing = Billing("billing", Billing.Params(prices=str(prices), auth=None), NoLookup())
    lookup = _Lookup(billing)  # prices budgets; no ledger (nothing to seed)
    local = Quotas("quotas", Quotas.Params(), lookup)
    await local.start()
    results["in-process"] = await _measure(local, n, concurrency, trials)
    await local.stop()
    server = RedisServer()
    server.start()
    try:
        shared = Quotas("quotas", Quotas.Params.model_validate(
            {"redis_url": server.url, "redis_timeout_s": 5.0}), lookup)
        await shared.start()
        results["redis"] = await _measure(shared, n, concurrency, trials)
        await shared.stop()
    finally:
        server.stop()
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    report = asyncio.run(main(args.requests, args.concurrency, args.trials))
    out = Path(__file__).parent / "results" / "quotas.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
