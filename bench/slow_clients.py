"""A slow-client (slowloris) attack on ``kvgate serve`` while normal traffic runs.

``--attackers`` (300) connections each send a partial request head, then one more byte every
``--drip-s`` (0.5 s), never finishing it: what holds a connection open on a server without a
head deadline. Meanwhile ``--concurrency`` (4) clients send normal chat requests (keep-alive,
one simulated engine at ``--time-scale`` 0, so the latency is the gateway's). The run measures
the normal requests' latency for ``--baseline-s`` (10 s) without the attack, then while the
attack lasts (until every attacker is closed), then ``--baseline-s`` again without it (the
ratios compare the attack with both), and for each attacker when and how the server closed
it: a 408 at ``server.head_timeout_s`` (default 10 s) after its first byte.

Writes ``bench/results/slow-clients-<timestamp>.json``. Run it under the machine-wide lock:
``flock /tmp/kvgate-heavy.lock nice -n 10 .venv/bin/python -m bench.slow_clients``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from bench.reliability_client import percentile, raised_fd_limit

RESULTS_DIR = Path("bench/results")
#: What an attacker sends first; it then adds one byte of a header value per drip.
PARTIAL_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\nx-slow: "
CHAT = {"model": "sim-model", "max_tokens": 8,
        "messages": [{"role": "user", "content": "hello there"}]}


async def attacker(port: int, drip_s: float, started: asyncio.Event) -> dict[str, Any]:
    """One slow client: when (seconds after its first byte) and with what status the server
    closed it; ``closed_after_s`` None if it was still open after 120 s."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(PARTIAL_HEAD)
    first = time.monotonic()
    started.set()
    got, closed = b"", None
    while closed is None and time.monotonic() < first + 120:
        try:
            data = await asyncio.wait_for(reader.read(4096), drip_s)
        except TimeoutError:
            writer.write(b"a")  # one more byte: the head is never finished
            continue
        except OSError:
            data = b""
        if data:
            got += data
        else:
            closed = time.monotonic() - first
    writer.close()
    status = int(got.split(b" ", 2)[1]) if got.startswith(b"HTTP/1.1 ") else None
    return {"closed_after_s": closed, "status": status}


async def normal_traffic(port: int, concurrency: int, stop: asyncio.Event) -> dict[str, Any]:
    """``concurrency`` clients sending chat requests back to back until ``stop``: latencies
    (ms) and errors."""
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    latencies: list[float] = []
    errors: list[str] = []

    async def client(session: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            start = time.perf_counter()
            try:
                async with session.post(url, json=CHAT) as resp:
                    await resp.read()
                    if resp.status != 200:
                        errors.append(str(resp.status))
                        continue
            except (aiohttp.ClientError, TimeoutError) as exc:
                errors.append(type(exc).__name__)
                continue
            latencies.append((time.perf_counter() - start) * 1000)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    return {"requests": len(latencies) + len(errors), "errors": len(errors),
            "error_kinds": sorted(set(errors)), "p50_ms": _ms(percentile(latencies, 0.5)),
            "p99_ms": _ms(percentile(latencies, 0.99))}


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


async def attack_while_serving(port: int, attackers: int, normal_s: float | None,
                               concurrency: int = 4, drip_s: float = 0.5) -> dict[str, Any]:
    """Normal traffic while ``attackers`` slow clients hold half-sent heads (``normal_s``
    None: until every attacker is closed); without attackers, for ``normal_s``."""
    stop = asyncio.Event()
    traffic = asyncio.create_task(normal_traffic(port, concurrency, stop))
    started = [asyncio.Event() for _ in range(attackers)]
    slow = [asyncio.create_task(attacker(port, drip_s, ev)) for ev in started]
    for ev in started:
        await ev.wait()
    began = time.monotonic()
    if normal_s is not None:
        await asyncio.sleep(normal_s)
    closed = await asyncio.gather(*slow)
    wall = time.monotonic() - began
    stop.set()
    times = [c["closed_after_s"] for c in closed]
    known = sorted(t for t in times if t is not None)
    return {"normal": await traffic, "wall_s": round(wall, 2), "attackers": {
        "count": attackers, "closed_after_s": times,
        "statuses": {str(s): sum(c["status"] == s for c in closed)
                     for s in {c["status"] for c in closed}},
        "closed_min_s": _ms(known[0]) if known else None,
        "closed_max_s": _ms(known[-1]) if known else None}}


async def _run(opts: argparse.Namespace, logs: Path) -> dict[str, Any]:
    from bench.reliability import gateway, sims

    with sims(1, logs, opts.time_scale) as fleet, \
            gateway(["--engine", fleet[0][1]], logs) as (_, url):
        port = int(url.rsplit(":", 1)[1])
        before = await attack_while_serving(port, 0, opts.baseline_s, opts.concurrency)
        attack = await attack_while_serving(port, opts.attackers, None, opts.concurrency,
                                            opts.drip_s)
        after = await attack_while_serving(port, 0, opts.baseline_s, opts.concurrency)
    attack["attackers"].pop("closed_after_s")
    normal = {"before": before["normal"], "attack": attack["normal"], "after": after["normal"]}
    return {"normal": normal, "attackers": attack["attackers"], "attack_wall_s": attack["wall_s"],
            "latency_ratio": {f"attack/{when} {q}": _ratio(normal["attack"], normal[when], q)
                              for when in ("before", "after") for q in ("p50_ms", "p99_ms")}}


def _ratio(a: dict[str, Any], b: dict[str, Any], q: str) -> float | None:
    return round(a[q] / b[q], 2) if a[q] and b[q] else None


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.slow_clients")
    p.add_argument("--attackers", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--baseline-s", type=float, default=10.0)
    p.add_argument("--drip-s", type=float, default=0.5)
    p.add_argument("--time-scale", type=float, default=0.0)
    opts = p.parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    logs = Path(tempfile.mkdtemp(prefix="kvgate-slow-clients-"))
    with raised_fd_limit():
        result = asyncio.run(_run(opts, logs))
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"slow-clients-{stamp}.json"
    path.write_text(json.dumps({
        "command": "python -m bench.slow_clients " + " ".join(argv or sys.argv[1:]),
        "machine": {"cpus": os.cpu_count()}, "logs": str(logs), **result}, indent=2))
    print(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
