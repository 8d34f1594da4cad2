"""SIGKILL of a real ``kvgate serve --prices --ledger --keys`` process mid-load, in front of two
simulated engines run as their own processes: after a restart, every request that completed
with 200 at the client has exactly one ledger record (the spool replayed what the database had
not committed yet; nothing is duplicated)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from kvgate.pricing.backends.select import open_backend
from tests.integration.billing_helpers import (
    ALL,
    PRICES_YAML,
    Keys,
    expected_cost,
    long_chat,
    write_keys,
)
from tests.servers import free_port, running_process

KVGATE = str(Path(sys.executable).with_name("kvgate"))
WORKERS = 16  # concurrent clients
LOAD_S = 1.5  # load before the kill


@contextlib.contextmanager
def _process(args: list[str], port: int, log: Path, cwd: Path) -> Iterator[
        subprocess.Popen[bytes]]:
    with running_process(args, f"http://127.0.0.1:{port}/health", log=log, cwd=cwd,
                         limit_s=30, stop_s=15) as proc:
        yield proc


async def _client(url: str, keys: Keys, worker: int, done: set[str],
                  stop: asyncio.Event) -> int:
    """Requests until ``stop``; ids of the ones that completed with 200 go into ``done``."""
    sent = 0
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            rid = f"w{worker}-{sent}"
            stream = sent % 2 == 1
            body = long_chat(worker % 4, stream=stream, max_tokens=16,
                             include_usage=(sent % 4 == 1) if stream else None)
            sent += 1
            try:
                async with session.post(url + "/v1/chat/completions", json=body, headers={
                        **keys.auth("admin" if worker % 2 else "user"), "x-request-id": rid}
                        ) as resp:
                    text = await resp.text()
            except (TimeoutError, aiohttp.ClientError):
                continue
            complete = text.endswith("data: [DONE]\n\n") if stream else '"usage"' in text
            if resp.status == 200 and complete:
                done.add(rid)
    return sent


async def _load(url: str, keys: Keys, proc: subprocess.Popen[bytes]) -> tuple[set[str], int]:
    done: set[str] = set()
    stop = asyncio.Event()
    tasks = [asyncio.create_task(_client(url, keys, w, done, stop)) for w in range(WORKERS)]
    await asyncio.sleep(LOAD_S)
    os.kill(proc.pid, signal.SIGKILL)  # mid-load: requests are in flight
    await asyncio.to_thread(proc.wait)
    stop.set()
    sent = sum(await asyncio.gather(*tasks))
    return done, sent


@contextlib.contextmanager
def _locked(db: Path, lock: bool) -> Iterator[None]:
    """Hold SQLite's write lock (the database is unavailable to the gateway) while inside."""
    if not lock:
        yield
        return
    with contextlib.closing(sqlite3.connect(db, isolation_level=None)) as conn:
        conn.execute("BEGIN EXCLUSIVE")
        try:
            yield
        finally:
            conn.execute("ROLLBACK")


def _rows(db: Path) -> dict[str, int]:
    """Records per client request id (the load's ids are unique per request)."""
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return dict(conn.execute("SELECT client_request_id, COUNT(*) FROM kvgate_usage "
                                 "GROUP BY client_request_id").fetchall())


@pytest.mark.parametrize("db_locked", [False, True], ids=["database up", "database locked"])
def test_sigkill_mid_load_loses_no_completed_request(tmp_path: Path, db_locked: bool) -> None:
    keys = write_keys(tmp_path)
    prices = tmp_path / "prices.yaml"
    prices.write_text(PRICES_YAML)
    db = tmp_path / "ledger.sqlite"
    ports = [free_port() for _ in range(3)]
    sims = [[sys.executable, "-m", "kvgate.engines.sim", "--port", str(p), "--time-scale", "1"]
            for p in ports[:2]]
    serve = [KVGATE, "serve", *(a for p in ports[:2] for a in ("--engine",
                                                               f"http://127.0.0.1:{p}")),
             "--port", str(ports[2]), "--prices", str(prices), "--ledger", f"sqlite://{db}",
             "--keys", str(keys.path)]
    url = f"http://127.0.0.1:{ports[2]}"
    log = tmp_path / "kvgate.log"
    with contextlib.ExitStack() as stack:
        for i, (args, port) in enumerate(zip(sims, ports, strict=False)):
            stack.enter_context(_process(args, port, tmp_path / f"sim{i}.log", tmp_path))
        with _process(serve, ports[2], log, tmp_path) as gw, _locked(db, db_locked):
            done, sent = asyncio.run(_load(url, keys, gw))
        before = _rows(db)
        with _process(serve, ports[2], log, tmp_path):  # replays the spool on start
            pass  # SIGTERM: a clean stop writes everything
    after = _rows(db)
    print(f"sent {sent}, completed {len(done)}, in the database at the kill "
          f"{len(set(before) & done)}, after restart {len(set(after) & done)}")
    assert len(done) >= 20 and sent > len(done)  # a real load, cut mid-way
    if db_locked:  # nothing reached the database before the kill: all came from the spool
        assert not set(before) & done
    assert done <= set(after)  # every completed request has its record ...
    assert set(after.values()) == {1}  # ... exactly once
    assert set(after) <= {f"w{w}-{i}" for w in range(WORKERS) for i in range(sent)}
    backend = open_backend(f"sqlite://{db}")
    try:
        for r in backend.query(*ALL):
            if r.client_request_id in done:
                assert (r.outcome, r.status, r.priced) == ("done", 200, True)
                assert r.cost_total == expected_cost(r.prompt_tokens, r.cached_tokens,
                                                     r.completion_tokens, r.tenant)
    finally:
        backend.close()
    assert "authentication is DISABLED" not in log.read_text()
