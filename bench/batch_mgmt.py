"""The Batch API's own cost at OpenAI's limit: upload, create (validate + submit) and finalise
a 50,000-request batch over the real SQLite job store, in process (no engines: the jobs are
finished straight in the store with a fixed answer). Writes bench/results/batch_mgmt.json.

    python -m bench.batch_mgmt [--requests 50000] [--trials 3]

What it shows: the time a client waits for ``POST /v1/files`` and ``POST /v1/batches`` on a
full-size batch, and how long finalisation (reading every job, writing the output file) takes --
which is what ``management.lease_s`` (120 s) must exceed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

from kvgate.asyncq.api import JobResult, JobState
from kvgate.asyncq.batch.mgmt import ManagementSettings, build_management_app, plane_of
from kvgate.asyncq.metrics import QueueMetrics
from kvgate.asyncq.plugin import Queue
from kvgate.asyncq.store.sqlite_store import SqliteJobStore

ANSWER = orjson.dumps({"id": "chatcmpl-x", "object": "chat.completion", "choices": [
    {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}],
    "usage": {"prompt_tokens": 40, "completion_tokens": 2, "total_tokens": 42}})


def batch_file(n: int) -> bytes:
    return b"".join(orjson.dumps({
        "custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "m", "max_tokens": 8, "messages": [
            {"role": "system", "content": f"Shared system prompt {i % 8}. " * 8},
            {"role": "user", "content": f"request {i}"}]}}) + b"\n" for i in range(n))


async def trial(n: int, data: bytes) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        store = SqliteJobStore(Path(tmp) / "jobs.sqlite")
        await store.open()
        service = Queue(store, QueueMetrics())
        app = build_management_app(service, ManagementSettings(
            data_dir=str(Path(tmp) / "mgmt"), finalize_interval_s=3600.0))
        plane = plane_of(app)
        out: dict[str, float] = {}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://mgmt", timeout=600) as client:
            t0 = time.perf_counter()
            up = await client.post("/v1/files", files={"file": ("b.jsonl", data)},
                                   data={"purpose": "batch"})
            out["upload_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            created = await client.post("/v1/batches", json={
                "input_file_id": up.json()["id"], "endpoint": "/v1/chat/completions",
                "completion_window": "24h"})
            out["create_s"] = time.perf_counter() - t0
            batch = created.json()
            assert batch["status"] == "in_progress", batch
            result = JobResult(200, ANSWER, "application/json", "e", time.time())
            while jobs := await store.claim("bench", 1000, 600.0, time.time()):
                for job in jobs:
                    await store.finish(job.spec.id, JobState.SUCCEEDED, result)
            t0 = time.perf_counter()
            final = await plane.batches.try_finalize(batch["id"])
            out["finalize_s"] = time.perf_counter() - t0
            assert final is not None and final.request_counts.completed == n, final
        await plane.stop()
        await store.close()
        return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=50_000)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("bench/results/batch_mgmt.json"))
    args = ap.parse_args(argv)
    data = batch_file(args.requests)
    runs = [asyncio.run(trial(args.requests, data)) for _ in range(args.trials)]
    summary: dict[str, Any] = {
        "requests": args.requests, "file_bytes": len(data), "trials": runs,
        "median": {k: statistics.median(r[k] for r in runs) for k in runs[0]}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary["median"], indent=2))


if __name__ == "__main__":
    main()
