"""What the catalog + LiteLLM backend path adds to a provider call (not a test; run it).

Sequential chat completions to the OpenAI-compatible stand-in (tests/integration/fake_providers),
once straight through ``litellm.acompletion`` and once through kvgate (catalog, api-keys,
billing with its SQLite ledger; the client is httpx over ASGITransport in the same event loop):

    .venv/bin/python -m tests.integration.bench_litellm_overhead [N]

Prints the median and p90 latency of each, in milliseconds.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from engines.litellm_provider import load_litellm
from plugins.catalog import Catalog
from tests.integration.catalog_helpers import provider_stack

MESSAGES = [{"role": "user", "content": "hello there"}]
WARMUP = 20


async def _measure(name: str, call: Callable[[], Awaitable[None]], n: int) -> None:
    for _ in range(WARMUP):
        await call()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        await call()
        times.append(time.perf_counter() - start)
    times.sort()
    print(f"{name}: n={n} median {statistics.median(times) * 1e3:.2f} ms "
          f"p90 {times[int(0.9 * n)] * 1e3:.2f} ms")


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

            await _measure("litellm.acompletion direct", direct, n)
            await _measure("through kvgate (catalog, api-keys, billing)", via_kvgate, n)


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 200))
