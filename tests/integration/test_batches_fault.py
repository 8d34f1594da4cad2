"""Fault tests of the Batch API with real processes: ``kvgate serve`` (async-queue + billing)
in front of two simulated engines run as their own processes, SIGKILLed in the middle of a
500-request batch.

* SQLite (the embedded default): the one gateway is killed and restarted on the same files.
* Redis (two replicas on one queue, sharing the management directory and the ledger): one
  replica is killed; the other reclaims its leases and finishes the batch; the killed one is
  then restarted so its billing spool is replayed.

Either way, in the end every request has exactly one output line and exactly one ledger record
(tier ``batch``), under the same id."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from tests.asyncq_helpers import PersistentRedis
from tests.integration.billing_helpers import PRICES_YAML, write_keys
from tests.integration.conftest import DEFAULT_PROFILE, FAST_POOL
from tests.servers import REDIS_SERVER, free_port, running_process

KVGATE = str(Path(sys.executable).with_name("kvgate"))
REQUESTS = 500
KILL_AFTER = 120  # requests finished before the SIGKILL
#: A dead replica's running jobs run again after this long. The runner claims a window of jobs
#: (RUNNING, leased) before it starts them: the window is kept small so that it starts well
#: within the lease.
LEASE_S = 4.0
WINDOW = 16


def batch_rows() -> list[dict[str, Any]]:
    """Requests sharing one of four long system prompts (cache-ordered by the queue)."""
    return [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "sim-model", "max_tokens": 4, "messages": [
                 {"role": "system", "content": f"Shared prompt {i % 4}. " * 30},
                 {"role": "user", "content": f"request {i}"}]}}
            for i in range(REQUESTS)]


def write_config(tmp: Path, name: str, engines: list[int], backend: str, port: int,
                 keys_file: Path) -> Path:
    prices = tmp / "prices.yaml"
    prices.write_text(PRICES_YAML)
    config = {
        "server": {"port": port},
        "engines": [{"name": f"sim-{i}", "url": f"http://127.0.0.1:{p}"}
                    for i, p in enumerate(engines)],
        "pool": FAST_POOL, "profiles": DEFAULT_PROFILE["profiles"],
        "plugins": [
            {"type": "api-keys", "params": {"file": str(keys_file)}},
            {"type": "billing", "params": {
                "prices": str(prices), "ledger": f"sqlite://{tmp}/ledger.sqlite",
                "spool": str(tmp / f"spool-{name}"), "tier_discounts": {"batch": "0.5"}}},
            {"type": "async-queue", "params": {
                "backend": backend, "consumer": name, "lease_s": LEASE_S,
                "max_concurrency": 8, "window": WINDOW, "reap_interval_s": 0.5,
                "management": {"data_dir": str(tmp / "mgmt"), "finalize_interval_s": 0.5,
                               "lease_s": 5.0}}},
            *DEFAULT_PROFILE["plugins"]],
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@contextlib.contextmanager
def process(args: list[str], port: int, log: Path, cwd: Path) -> Iterator[
        subprocess.Popen[bytes]]:
    with running_process(args, f"http://127.0.0.1:{port}/health", log=log, cwd=cwd,
                         limit_s=60, stop_s=20) as proc:
        yield proc


def gateway(config: Path, port: int, tmp: Path) -> contextlib.AbstractContextManager[
        subprocess.Popen[bytes]]:
    return process([KVGATE, "serve", "--config", str(config)], port,
                   tmp / f"{config.stem}.log", tmp)


def poll(client: openai.OpenAI, batch_id: str, done: Callable[[Any], bool],
         limit_s: float) -> Any:
    deadline = time.monotonic() + limit_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if done(batch):
            return batch
        assert time.monotonic() < deadline, f"batch stuck: {batch}"
        time.sleep(0.1)


def finished(batch: Any) -> bool:
    return batch.status in ("completed", "failed", "expired", "cancelled")


def progressed(batch: Any) -> bool:
    counts = batch.request_counts
    return bool(counts and counts.completed >= KILL_AFTER) or finished(batch)


def kill(proc: subprocess.Popen[bytes]) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def output_ids(client: openai.OpenAI, batch: Any) -> set[str]:
    """The output file's ids, checked: one line per request, all answered 200."""
    assert batch.status == "completed", batch
    assert batch.error_file_id is None
    out = [json.loads(x) for x in client.files.content(batch.output_file_id).content.splitlines()]
    assert sorted(o["custom_id"] for o in out) == sorted(f"r{i}" for i in range(REQUESTS))
    assert all(o["response"]["status_code"] == 200 for o in out)
    return {o["id"] for o in out}


def check_ledger(ledger: Path, ids: set[str]) -> None:
    """Exactly one batch-tier record per output line (after every gateway stopped cleanly)."""
    with contextlib.closing(sqlite3.connect(ledger)) as conn:
        rows = dict(conn.execute(
            "SELECT request_id, COUNT(*) FROM kvgate_usage WHERE service_tier = 'batch' "
            "GROUP BY request_id").fetchall())
    assert set(rows) == ids
    assert set(rows.values()) == {1}


@pytest.fixture
def sims(tmp_path: Path) -> Iterator[list[int]]:
    ports = [free_port(), free_port()]
    with contextlib.ExitStack() as stack:
        for i, port in enumerate(ports):
            stack.enter_context(process(
                [sys.executable, "-m", "kvgate.engines.sim", "--port", str(port), "--time-scale",
                 "1", "--seed", str(i)], port, tmp_path / f"sim{i}.log", tmp_path))
        yield ports


def sdk(port: int, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=3)


def submit(client: openai.OpenAI, tmp: Path) -> Any:
    infile = tmp / "batch.jsonl"
    infile.write_text("".join(json.dumps(r) + "\n" for r in batch_rows()))
    with infile.open("rb") as f:
        uploaded = client.files.create(file=("batch.jsonl", f), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                 completion_window="24h")


@pytest.mark.slow
def test_sigkill_mid_batch_on_sqlite(tmp_path: Path, sims: list[int]) -> None:
    keys = write_keys(tmp_path)
    port = free_port()
    config = write_config(tmp_path, "solo", sims, f"sqlite://{tmp_path}/jobs.sqlite", port,
                          keys.path)
    client = sdk(port, keys.admin)
    with gateway(config, port, tmp_path) as gw:
        batch = submit(client, tmp_path)
        before = poll(client, batch.id, progressed, 120)
        kill(gw)
    assert before.status == "in_progress", "the kill should land mid-batch"
    with gateway(config, port, tmp_path):
        ids = output_ids(client, poll(client, batch.id, finished, 180))
    check_ledger(tmp_path / "ledger.sqlite", ids)


@pytest.mark.slow
@pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed")
def test_sigkill_one_of_two_replicas_on_redis(tmp_path: Path, sims: list[int]) -> None:
    keys = write_keys(tmp_path)
    redis = PersistentRedis(tmp_path)
    redis.start()
    try:
        ports = [free_port(), free_port()]
        configs = [write_config(tmp_path, name, sims, redis.url, p, keys.path)
                   for name, p in zip(("replica-a", "replica-b"), ports, strict=True)]
        a, b = sdk(ports[0], keys.admin), sdk(ports[1], keys.admin)
        with gateway(configs[1], ports[1], tmp_path):
            with gateway(configs[0], ports[0], tmp_path) as gw_a:
                batch = submit(a, tmp_path)
                before = poll(a, batch.id, progressed, 120)
                kill(gw_a)
            assert before.status == "in_progress", "the kill should land mid-batch"
            ids = output_ids(b, poll(b, batch.id, finished, 180))
            with gateway(configs[0], ports[0], tmp_path):  # replays replica a's spool
                pass
        check_ledger(tmp_path / "ledger.sqlite", ids)
    finally:
        redis.stop()
