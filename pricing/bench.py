"""Ledger throughput: ``python -m kvgate.pricing.bench [--records N] [--concurrency C] ...``.

``concurrency`` coroutines submit records back to back (as completion hooks would), into a
fresh SQLite ledger (or ``--ledger URL``) with its spool in a temporary directory. Prints one
JSON line: accepted/s (records durable in the spool), committed/s (in the database, i.e. until
``sync()`` returns), submit latency percentiles, and the spool group size used.
``--max-group 1`` forces one fsync per record (the comparison in docs/billing.md).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import tempfile
import time
from decimal import Decimal
from pathlib import Path

from kvgate.pricing.backends.select import open_backend
from kvgate.pricing.ledger import Ledger
from kvgate.pricing.records import LedgerRecord


def _record(i: int, now: dt.datetime) -> LedgerRecord:
    return LedgerRecord(
        request_id=f"bench-{i}", ts=now, tenant=f"t{i % 7}", key_id=f"k{i % 13}",
        model="kimi-k2.5", engine=f"e{i % 4}", prompt_tokens=10_000, completion_tokens=500,
        cached_tokens=8_000, cached_source="reported", cost_input=Decimal("0.0012"),
        cost_cached_input=Decimal("0.0008"), cost_output=Decimal("0.0015"),
        cost_cache_write=Decimal(0), cost_discount=Decimal(0), cost_total=Decimal("0.0035"),
        outcome="done", status=200, ttft_s=0.05, total_s=1.5, session=f"s{i % 100}")


async def run(records: int, concurrency: int, max_group: int, ledger_url: str | None,
              workdir: Path) -> dict[str, float | int]:
    url = ledger_url or f"sqlite://{workdir / 'ledger.sqlite'}"
    ledger = Ledger(open_backend(url), workdir / "spool", max_group=max_group)
    await ledger.start()
    now = dt.datetime.now(dt.UTC)
    latencies: list[float] = []

    async def worker(first: int) -> None:
        for i in range(first, records, concurrency):
            t = time.perf_counter()
            await ledger.submit(_record(i, now))
            latencies.append(time.perf_counter() - t)

    start = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    accepted = time.perf_counter() - start
    await ledger.sync()
    committed = time.perf_counter() - start
    await ledger.stop()
    latencies.sort()
    return {"records": records, "concurrency": concurrency, "max_group": max_group,
            "accepted_per_s": round(records / accepted), "committed_per_s":
            round(records / committed), "submit_p50_ms": round(latencies[len(latencies) // 2]
                                                              * 1000, 3),
            "submit_p99_ms": round(latencies[int(len(latencies) * 0.99)] * 1000, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvgate.pricing.bench", description=__doc__)
    parser.add_argument("--records", type=int, default=50_000)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--max-group", type=int, default=4096)
    parser.add_argument("--ledger", help="ledger URL (default: SQLite in a temporary dir)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvgate-ledger-bench-") as tmp:
        result = asyncio.run(run(args.records, args.concurrency, args.max_group, args.ledger,
                                 Path(tmp)))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
