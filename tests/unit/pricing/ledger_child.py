"""A ledger process for the SIGKILL test: submits records and prints each request id once
``submit`` has returned (i.e. once the record is accepted), until it is killed.

    python -m tests.unit.pricing.ledger_child SPOOL_DIR LEDGER_URL COUNT
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from kvgate.pricing.backends.select import open_backend
from kvgate.pricing.ledger import Ledger
from tests.unit.pricing.helpers import record

WORKERS = 8


async def main(spool: str, url: str, count: int) -> None:
    ledger = Ledger(open_backend(url, busy_timeout_s=0.05), Path(spool), batch_size=200,
                    batch_interval_s=0.2, retry_min_s=0.05, retry_max_s=0.2, seed=1)
    await ledger.start()

    async def worker(first: int) -> None:
        for i in range(first, count, WORKERS):
            await ledger.submit(record(f"kill-{i}", completion=i % 97))
            print(f"kill-{i}", flush=True)

    await asyncio.gather(*(worker(w) for w in range(WORKERS)))
    print("DONE", flush=True)
    await asyncio.sleep(3600)  # wait to be killed


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
