"""What the catalog + LiteLLM backend path adds to a provider call.

Sequential chat completions to the OpenAI-compatible stand-in (tests/integration/fake_providers),
once straight through ``litellm.acompletion`` and once through kvgate (catalog, api-keys,
billing with its SQLite ledger; the client is httpx over ASGITransport in the same event loop):

    .venv/bin/python -m bench.litellm_overhead [N]

Prints the median and p90 latency of each, in milliseconds, and their ratio, and writes them to
``bench/results/litellm-overhead-<time>.json``.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from bench.overhead import RESULTS_DIR
from kvgate.engines.litellm_provider import load_litellm
from kvgate.plugins.catalog.plugin import Catalog
from tests.integration.catalog_helpers import provider_stack

MESSAGES = [{"role": "user", "content": "hello there"}]
WARMUP = 20


async def _measure(name: str, call: Callable[[], Awaitable[None]], n: int) -> dict[str, float]:
    for _ in range(WARMUP):
        await call()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        await call()
        times.append(time.perf_counter() - start)
    times.sort()
    median_ms, p90_ms = statistics.median(times) * 1e3, times[int(0.9 * n)] * 1e3
    print(f"{name}: n={n} median {median_ms:.2f} ms p90 {p90_ms:.2f} ms")
    return {"n": n, "median_ms": median_ms, "p90_ms": p90_ms}


async def main(n: int) -> None:
    litellm = load_litellm()
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as mp:
        async with provider_stack(Path(tmp), mp) as s:
            catalog = s.app.pipeline.plugins["catalog"]
            assert isinstance(catalog, Catalog)
            spec = catalog.entries["gpt-x"].provider
            assert spec is not None
            base = spec.api_base

            async def direct() -> None:
                await litellm.acompletion(model="openai/gpt-x", api_base=base, api_key="sk-test",
                                          messages=MESSAGES, max_tokens=5, max_retries=0)

            async def via_kvgate() -> None:
                resp = await s.client.post("/v1/chat/completions", headers=s.keys.auth("admin"),
                                           json={"model": "gpt-x", "max_tokens": 5,
                                                 "messages": MESSAGES})
                assert resp.status_code == 200

            results = {"direct": await _measure("litellm.acompletion direct", direct, n),
                       "kvgate": await _measure("through kvgate (catalog, api-keys, billing)",
                                                via_kvgate, n)}
    ratio = results["kvgate"]["median_ms"] / results["direct"]["median_ms"]
    print(f"kvgate / direct, median: {ratio:.3f}")
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    out = RESULTS_DIR / f"litellm-overhead-{stamp}.json"
    out.write_text(json.dumps({"benchmark": "litellm-overhead", "results": results,
                               "median_ratio": ratio}, indent=2))
    print(f"JSON: {out}")


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 200))
