"""Reliability under load and faults: real ``kvgate serve`` and simulated-engine processes.

Scenarios (``--scenarios``, default all; docs/reliability.md has the figures):

* ``load``: ``--streams`` (1,000) concurrent streaming clients through one ``kvgate serve``
  (the quick start, ``--engine`` per simulated engine), ``--rounds`` (3) times. Reports errors,
  incomplete streams, TTFT p50/p99, the gateway's RSS before, at its peak and after each round
  (the gateway's structures are bounded: RSS after round 2 should be that after round 1), and
  its in-flight gauges after (0: every lease released).
* ``kill``: ``--kill-streams`` (200) streams over two engines; one engine process is SIGKILLed
  once every stream has its first bytes. Its streams must end with the API's SSE error event,
  the other engine's complete; then as many new requests must all succeed on the survivor.
* ``hang``: one engine answers ``/health`` but holds every inference request (the simulator's
  ``delay_first_byte_s``); the gateway's ``request_timeout_s`` is 2 s. ``--hang-requests``
  (100) requests, 10 at a time: all must succeed through retries, and the circuit breaker must
  stop sending to the hung engine after ``pool.breaker_failures`` timeouts (plus those already
  in flight when it opened).
* ``fuzz``: the suite's hypothesis fuzz tests (tests/integration/test_fuzz_gateway.py) with
  ``--fuzz-examples`` examples each instead of the suite's few.

Writes ``bench/results/reliability-<timestamp>.json``. Run it under the machine-wide lock:
``flock /tmp/kvgate-heavy.lock nice -n 10 .venv/bin/python -m bench.reliability``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench import procs
from bench.reliability_client import (
    RssSampler,
    chat_body,
    raised_fd_limit,
    rss_kib,
    stream_once,
    summarize,
)

RESULTS_DIR = Path("bench/results")
KVGATE = str(Path(sys.executable).with_name("kvgate"))
SCENARIOS = ("load", "kill", "hang", "fuzz")
#: Gauges that must read 0 once the load has drained (every engine lease released).
IN_FLIGHT = "kvgate_engine_in_flight_requests"


@contextlib.contextmanager
def sims(count: int, logs: Path, time_scale: float) -> Iterator[list[tuple[Any, str]]]:
    """``count`` simulated engines (processes) with room for 1,000 running sequences."""
    with contextlib.ExitStack() as stack:
        out = []
        for i in range(count):
            port = procs.free_port()
            argv = [sys.executable, "-m", "kvgate.engines.sim", "--port", str(port), "--engine-id",
                    f"sim-{i}", "--time-scale", str(time_scale), "--max-num-seqs", "1024",
                    "--log-level", "warning"]
            proc = stack.enter_context(procs.running(argv, "0-1", logs / f"sim-{i}.log"))
            url = f"http://127.0.0.1:{port}"
            procs.wait_healthy(url + "/health", proc, 60, logs / f"sim-{i}.log")
            out.append((proc, url))
        yield out


@contextlib.contextmanager
def gateway(args: Sequence[str], logs: Path) -> Iterator[tuple[Any, str]]:
    """``kvgate serve ARGS`` on a free port, ready once ``/health`` answers 200."""
    port = procs.free_port()
    argv = [KVGATE, "serve", *args, "--port", str(port)]
    with procs.running(argv, "0-1", logs / "kvgate.log") as proc:
        url = f"http://127.0.0.1:{port}"
        procs.wait_healthy(url + "/health", proc, 60, logs / "kvgate.log")
        yield proc, url


def _metric(text: str, name: str) -> dict[str, float]:
    """``labels -> value`` of one metric family in a Prometheus text page."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            key, value = line.rsplit(" ", 1)
            out[key[len(name):] or "{}"] = float(value)
    return out


async def _metrics(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url + "/metrics") as resp:
        return await resp.text()


async def _burst(session: aiohttp.ClientSession, url: str, n: int, max_tokens: int,
                 offset: int = 0) -> list[Any]:
    return list(await asyncio.gather(
        *(stream_once(session, url, chat_body(max_tokens, offset + i)) for i in range(n))))


def _session(limit: int) -> aiohttp.ClientSession:
    timeout = aiohttp.ClientTimeout(total=600)
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit), timeout=timeout)


async def scenario_load(opts: argparse.Namespace, logs: Path) -> dict[str, Any]:
    with sims(opts.engines, logs, opts.time_scale) as fleet, \
            gateway([a for _, u in fleet for a in ("--engine", u)], logs) as (gw, url):
        rounds: list[dict[str, Any]] = []
        async with _session(opts.streams + 10) as session:
            await _burst(session, url, 20, opts.max_tokens)  # warm connections and imports
            await asyncio.sleep(1)
            for r in range(opts.rounds):
                before = rss_kib(gw.pid)
                sampler = RssSampler(gw.pid)
                started = time.perf_counter()
                async with sampler.running():
                    results = await _burst(session, url, opts.streams, opts.max_tokens,
                                           r * opts.streams)
                wall = time.perf_counter() - started
                await asyncio.sleep(2)  # let closed connections and buffers go
                text = await _metrics(session, url)
                rounds.append({**summarize(results), "wall_s": round(wall, 2),
                               "rss_kib": {"before": before, "peak": sampler.peak_kib,
                                           "after": rss_kib(gw.pid)},
                               "in_flight_after": _metric(text, IN_FLIGHT)})
                print(f"load round {r}: {json.dumps(rounds[-1])}", flush=True)
            alive = gw.poll() is None
    return {"engines": opts.engines, "streams": opts.streams, "max_tokens": opts.max_tokens,
            "time_scale": opts.time_scale, "rounds": rounds, "gateway_alive": alive}


async def scenario_kill(opts: argparse.Namespace, logs: Path) -> dict[str, Any]:
    n = opts.kill_streams
    with sims(2, logs, 1.0) as fleet, \
            gateway([a for _, u in fleet for a in ("--engine", u)], logs) as (gw, url):
        victim = fleet[0][0]
        async with _session(n + 10) as session:
            # 300 tokens at time scale 1: ~2 s per stream, long enough to kill it mid-way
            tasks = [asyncio.create_task(stream_once(session, url, chat_body(300, i)))
                     for i in range(n)]
            await asyncio.sleep(opts.kill_after_s)
            os.killpg(victim.pid, signal.SIGKILL)  # the engine dies, no goodbye
            killed_at = time.perf_counter()
            results = await asyncio.gather(*tasks)
            after_kill = await _burst(session, url, n, 16, n)
            text = await _metrics(session, url)
            alive = gw.poll() is None
    return {
        "streams": n, "killed_after_s": opts.kill_after_s, "during": summarize(results),
        "after": summarize(after_kill), "gateway_alive": alive,
        "breaker_state": _metric(text, "kvgate_engine_breaker_state"),
        "mid_stream_errors": _metric(text, "kvgate_upstream_errors_total"),
        "killed": "engine-0", "kill_to_end_s": round(time.perf_counter() - killed_at, 2),
    }


def _hang_config(urls: list[str], path: Path) -> None:
    plugins = ["health-filter", "model-filter", "least-in-flight-scorer", "max-score-picker"]
    path.write_text(yaml.safe_dump({
        "server": {"request_timeout_s": 2.0},
        "engines": [{"name": f"sim-{i}", "url": u} for i, u in enumerate(urls)],
        "plugins": [{"type": p} for p in plugins],
        "profiles": [{"name": "default", "plugins": [{"ref": p} for p in plugins]}],
    }))


async def scenario_hang(opts: argparse.Namespace, logs: Path) -> dict[str, Any]:
    n = opts.hang_requests
    with sims(2, logs, 0.0) as fleet:
        config = logs / "hang.yaml"
        _hang_config([u for _, u in fleet], config)
        with gateway(["--config", str(config)], logs) as (gw, url):
            async with _session(20) as session:
                async with session.post(fleet[0][1] + "/sim/faults",
                                        json={"delay_first_byte_s": 3600}) as resp:
                    assert resp.status == 200
                slots = asyncio.Semaphore(10)

                async def one(i: int) -> Any:
                    async with slots:
                        return await stream_once(session, url, chat_body(16, i))

                results = await asyncio.gather(*(one(i) for i in range(n)))
                text = await _metrics(session, url)
                async with session.get(url + "/health") as resp:
                    health = await resp.json()
            alive = gw.poll() is None
    return {
        "requests": n, "concurrency": 10, "request_timeout_s": 2.0, **summarize(results),
        "retries": _metric(text, "kvgate_upstream_retries_total"),
        "breaker_state": _metric(text, "kvgate_engine_breaker_state"),
        "breaker_transitions": _metric(text, "kvgate_engine_breaker_transitions_total"),
        "health_breakers": {e["name"]: e["breaker"] for e in health["engines"]},
        "gateway_alive": alive,
    }


def scenario_fuzz(opts: argparse.Namespace, logs: Path) -> dict[str, Any]:
    env = {**os.environ, "KVGATE_FUZZ_EXAMPLES": str(opts.fuzz_examples)}
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/integration/test_fuzz_gateway.py"],
        env=env, capture_output=True, text=True, check=False)
    (logs / "fuzz.log").write_text(proc.stdout + proc.stderr)
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    return {"examples_per_test": opts.fuzz_examples, "exit_code": proc.returncode,
            "summary": tail, "wall_s": round(time.perf_counter() - started, 1)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--streams", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="simulated engines' step-time scale (1: H100 timing)")
    p.add_argument("--kill-streams", type=int, default=200)
    p.add_argument("--kill-after-s", type=float, default=0.8)
    p.add_argument("--hang-requests", type=int, default=100)
    p.add_argument("--fuzz-examples", type=int, default=300)
    return p


async def _run(opts: argparse.Namespace, logs: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in opts.scenarios.split(","):
        if name not in SCENARIOS:
            raise SystemExit(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}")
        started = time.perf_counter()
        if name == "fuzz":
            out[name] = scenario_fuzz(opts, logs)
        else:
            runner = {"load": scenario_load, "kill": scenario_kill, "hang": scenario_hang}[name]
            out[name] = await runner(opts, logs / name)
        out[name]["scenario_wall_s"] = round(time.perf_counter() - started, 1)
        print(f"{name}: {json.dumps(out[name])}", flush=True)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    opts = build_parser().parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    logs = Path(tempfile.mkdtemp(prefix="kvgate-reliability-"))
    with raised_fd_limit():
        results = asyncio.run(_run(opts, logs))
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"reliability-{stamp}.json"
    path.write_text(json.dumps({
        "command": "python -m bench.reliability " + " ".join(argv or sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "logs": str(logs), "scenarios": results}, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
