"""The async queue on a simulated fleet (engines/sim at real H100 timing, ``--time-scale 1``).

Two measurements, each on fresh processes (two ``python -m engines.sim`` engines and one
``kvgate serve --config`` with the default ``cache-aware`` preset, the async queue included):

(a) **Synchronous traffic first.** The same seeded open-loop (Poisson) stream of streaming chat
    requests, for ``--duration`` seconds, (1) alone and (2) with ``--batch`` queued jobs
    submitted at its start (``x-kvgate-queue: true``: the same durable queue and runner as the
    Batch API). Reported: the live requests' TTFT p50/p90 in each case (target: p90 within
    10 %), the batch's completion time from submit, and (3) the batch's completion time on an
    idle fleet, for reference.
(b) **Cache-aware order vs FIFO.** A batch of ``--prefix-jobs`` prompts sharing ``--prefixes``
    long prefixes, submitted interleaved (A, B, C, D, A, ...), run on engines with a tight KV
    cache (``--capacity-blocks``) with the runner's window (cache-aware: jobs with one prefix
    back to back) vs a window of 1 (FIFO). Reported: hit ratio = cached / prompt tokens over
    the batch's answers, and its completion time.

Every figure is per trial; the summary quotes medians over ``--trials``. JSON to
``bench/results/async_queue.json`` (git-ignored). Run it alone on the machine::

    .venv/bin/python -m bench.async_queue --trials 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shutil
import sqlite3
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench import procs
from bench.harness import machine_info
from kvgate.middleware.framework.composition.quickstart import QuickStart, quick_start_config

MODEL = "sim-model"
RESULTS = Path("bench/results/async_queue.json")
WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa",
         "lambda", "mu", "nu", "xi", "omicron", "pi", "rho", "sigma", "tau", "upsilon", "phi",
         "chi", "psi", "omega")


@dataclass(frozen=True)
class Fleet:
    engines: int = 2
    capacity_blocks: int = 4096
    block_size: int = 16


@dataclass(frozen=True)
class Queue:
    window: int = 256
    max_concurrency: int = 8
    #: Headroom overrides (None: the plugin's defaults).
    headroom: tuple[tuple[str, float], ...] = ()


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _config(urls: Sequence[str], port: int, root: Path, queue: Queue) -> Path:
    data = quick_start_config(QuickStart(engines=tuple(urls))).model_dump(
        mode="json", exclude={"source"})
    data["server"].update({"host": "127.0.0.1", "port": port, "log_level": "warning"})
    data["pool"].update({"health_interval_s": 0.5, "metrics_interval_s": 0.5})
    for plugin in data["plugins"]:
        if plugin["type"] == "async-queue":
            plugin["params"] = {"backend": f"sqlite://{root.resolve()}/jobs.sqlite",
                                "management": None,
                                "window": queue.window,
                                "max_concurrency": queue.max_concurrency,
                                "headroom": dict(queue.headroom)}
    path = root / "kvgate.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@contextlib.contextmanager
def system(root: Path, fleet: Fleet, queue: Queue) -> Iterator[str]:
    """Fresh engines (empty caches), a fresh job store and a gateway in front; yields the
    gateway URL."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    with contextlib.ExitStack() as stack:
        urls = []
        for i in range(fleet.engines):
            port = procs.free_port()
            argv = [sys.executable, "-m", "kvgate.engines.sim", "--port", str(port), "--engine-id",
                    f"engine-{i}", "--model", MODEL, "--time-scale", "1", "--seed", str(i),
                    "--capacity-blocks", str(fleet.capacity_blocks),
                    "--block-size", str(fleet.block_size)]
            log = root / f"e{i}.log"
            proc = stack.enter_context(procs.running(argv, "0-1", log))
            url = f"http://127.0.0.1:{port}"
            procs.wait_healthy(url + "/health", proc, 30, log)
            urls.append(url)
        port = procs.free_port()
        kvgate = str(Path(sys.executable).with_name("kvgate"))
        argv = [kvgate, "serve", "--config", str(_config(urls, port, root, queue))]
        log = root / "kvgate.log"
        proc = stack.enter_context(procs.running(argv, "0-1", log))
        url = f"http://127.0.0.1:{port}"
        procs.wait_healthy(url + "/health", proc, 60, log)
        yield url


async def _ttft(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> float | None:
    start = time.monotonic()
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            return None
        async for line in resp.content:
            if line.startswith(b"data: ") and b'"content"' in line:
                first = time.monotonic() - start
                async for _ in resp.content:
                    pass
                return first
    return None


async def live_traffic(url: str, rate: float, duration_s: float, seed: int) -> list[float]:
    """Poisson arrivals of streaming chats for ``duration_s``; their TTFTs (s)."""
    rng = random.Random(seed)
    out: list[float] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        tasks = []
        t = 0.0
        start = time.monotonic()
        while True:
            t += rng.expovariate(rate)
            if t >= duration_s:
                break
            body = {"model": MODEL, "max_tokens": 64, "stream": True, "messages": [
                {"role": "user", "content": f"live {t:.3f}: " + _text(rng, 200)}]}
            await asyncio.sleep(max(0.0, start + t - time.monotonic()))
            tasks.append(asyncio.create_task(_ttft(session, url, body)))
        for got in await asyncio.gather(*tasks):
            if got is not None:
                out.append(got)
    return out


async def submit(url: str, bodies: Sequence[dict[str, Any]]) -> list[str]:
    async with aiohttp.ClientSession() as session:
        sem = asyncio.Semaphore(32)

        async def one(body: dict[str, Any]) -> str:
            async with sem, session.post(url + "/v1/chat/completions", json=body,
                                         headers={"x-kvgate-queue": "true"}) as resp:
                assert resp.status == 202, await resp.text()
                return str((await resp.json())["id"])
        ids = []
        for body in bodies:  # in order: the queue's FIFO is the submit order
            ids.append(await one(body))
        return ids


def _jobs(db: Path) -> list[tuple[str, str, bytes | None, float | None]]:
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        return list(conn.execute("SELECT id, state, res_body, finished_at FROM jobs"))


async def wait_jobs(db: Path, count: int, limit_s: float = 900) -> list[tuple[Any, ...]]:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        rows = await asyncio.to_thread(_jobs, db)
        if len(rows) >= count and all(r[1] not in ("queued", "running") for r in rows):
            return rows
        await asyncio.sleep(0.25)
    raise TimeoutError(f"{count} jobs not finished within {limit_s} s")


def batch_bodies(n: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{"model": MODEL, "max_tokens": 128, "messages": [
        {"role": "user", "content": f"job {i}: " + _text(rng, 500)}]} for i in range(n)]


def _p(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _with_batch(url: str, root: Path, args: argparse.Namespace, seed: int,
                      live: bool) -> dict[str, Any]:
    start = time.time()
    ids = await submit(url, batch_bodies(args.batch, seed + 1))
    submitted = time.time() - start
    ttfts = await live_traffic(url, args.rate, args.duration, seed) if live else []
    rows = await wait_jobs(root / "jobs.sqlite", len(ids))
    done = max(r[3] or 0.0 for r in rows) - start
    ok = sum(r[1] == "succeeded" for r in rows)
    return {"ttft": ttfts, "batch_s": done, "submit_s": submitted, "succeeded": ok}


def _gate(args: argparse.Namespace) -> Queue:
    given = (("max_jobs_per_engine", args.max_jobs_per_engine),
             ("max_live_per_engine", args.max_live_per_engine))
    return Queue(headroom=tuple((k, v) for k, v in given if v is not None))


def part_a(args: argparse.Namespace, trial: int, tmp: Path) -> dict[str, Any]:
    seed = 1000 + trial
    with system(tmp / f"a{trial}-alone", Fleet(), _gate(args)) as url:
        alone = asyncio.run(live_traffic(url, args.rate, args.duration, seed))
    with system(tmp / f"a{trial}-mixed", Fleet(), _gate(args)) as url:
        mixed = asyncio.run(_with_batch(url, tmp / f"a{trial}-mixed", args, seed, True))
    with system(tmp / f"a{trial}-idle", Fleet(), _gate(args)) as url:
        idle = asyncio.run(_with_batch(url, tmp / f"a{trial}-idle", args, seed, False))
    out = {
        "live_alone": {"n": len(alone), "ttft_p50_s": _p(alone, 0.5),
                       "ttft_p90_s": _p(alone, 0.9)},
        "live_with_batch": {"n": len(mixed["ttft"]), "ttft_p50_s": _p(mixed["ttft"], 0.5),
                            "ttft_p90_s": _p(mixed["ttft"], 0.9)},
        "batch_with_live_s": mixed["batch_s"], "batch_idle_s": idle["batch_s"],
        "batch_succeeded": [mixed["succeeded"], idle["succeeded"]],
    }
    out["ttft_p90_ratio"] = out["live_with_batch"]["ttft_p90_s"] / out["live_alone"]["ttft_p90_s"]
    print(f"trial {trial} (a): TTFT p90 alone {out['live_alone']['ttft_p90_s'] * 1000:.1f} ms, "
          f"with batch {out['live_with_batch']['ttft_p90_s'] * 1000:.1f} ms "
          f"(x{out['ttft_p90_ratio']:.3f}); batch {mixed['batch_s']:.1f} s with live traffic, "
          f"{idle['batch_s']:.1f} s idle", flush=True)
    return out


def prefix_bodies(args: argparse.Namespace, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    prefixes = [f"system {p}: " + _text(rng, args.prefix_words) for p in range(args.prefixes)]
    return [{"model": MODEL, "max_tokens": 16, "messages": [
        {"role": "system", "content": prefixes[i % args.prefixes]},
        {"role": "user", "content": f"question {i}: " + _text(rng, 30)}]}
        for i in range(args.prefix_jobs)]


def _hit_ratio(rows: Sequence[tuple[Any, ...]]) -> tuple[float, int, int]:
    prompt = cached = 0
    for _, state, body, _ in rows:
        if state != "succeeded" or body is None:
            continue
        usage = json.loads(body)["usage"]
        prompt += usage["prompt_tokens"]
        cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return (cached / prompt if prompt else 0.0), cached, prompt


async def _run_batch(url: str, root: Path,
                     bodies: Sequence[dict[str, Any]]) -> tuple[list[tuple[Any, ...]], float]:
    start = time.time()
    ids = await submit(url, bodies)
    rows = await wait_jobs(root / "jobs.sqlite", len(ids))
    return rows, max(r[3] or 0.0 for r in rows) - start


def part_b(args: argparse.Namespace, trial: int, tmp: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    fleet = Fleet(capacity_blocks=args.capacity_blocks)
    for name, window in (("cache_aware", 256), ("fifo", 1)):
        root = tmp / f"b{trial}-{name}"
        with system(root, fleet, Queue(window=window)) as url:
            rows, took = asyncio.run(_run_batch(url, root, prefix_bodies(args, 2000 + trial)))
        ratio, cached, prompt = _hit_ratio(rows)
        out[name] = {"hit_ratio": ratio, "cached_tokens": cached, "prompt_tokens": prompt,
                     "batch_s": took}
    print(f"trial {trial} (b): hit ratio cache-aware {out['cache_aware']['hit_ratio']:.3f} "
          f"({out['cache_aware']['batch_s']:.1f} s), FIFO {out['fifo']['hit_ratio']:.3f} "
          f"({out['fifo']['batch_s']:.1f} s)", flush=True)
    return out


def _median(trials: Sequence[dict[str, Any]], *path: str) -> float:
    values = []
    for t in trials:
        node: Any = t
        for key in path:
            node = node[key]
        values.append(float(node))
    return statistics.median(values)


def summary(a: Sequence[dict[str, Any]], b: Sequence[dict[str, Any]]) -> dict[str, float]:
    out: dict[str, float] = {}
    if a:
        out.update({
            "ttft_p90_alone_s": _median(a, "live_alone", "ttft_p90_s"),
            "ttft_p90_with_batch_s": _median(a, "live_with_batch", "ttft_p90_s"),
            "ttft_p90_ratio": _median(a, "ttft_p90_ratio"),
            "batch_with_live_s": _median(a, "batch_with_live_s"),
            "batch_idle_s": _median(a, "batch_idle_s")})
    if b:
        out.update({
            "hit_ratio_cache_aware": _median(b, "cache_aware", "hit_ratio"),
            "hit_ratio_fifo": _median(b, "fifo", "hit_ratio"),
            "batch_cache_aware_s": _median(b, "cache_aware", "batch_s"),
            "batch_fifo_s": _median(b, "fifo", "batch_s")})
    return out


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--parts", default="ab", help="a, b or ab")
    p.add_argument("--rate", type=float, default=4.0, help="live requests per second")
    p.add_argument("--duration", type=float, default=30.0, help="live traffic, seconds")
    p.add_argument("--batch", type=int, default=300, help="queued jobs in part (a)")
    p.add_argument("--max-jobs-per-engine", type=int, default=None,
                   help="headroom.max_jobs_per_engine (default: the plugin's)")
    p.add_argument("--max-live-per-engine", type=float, default=None,
                   help="headroom.max_live_per_engine (default: the plugin's)")
    p.add_argument("--prefixes", type=int, default=4)
    p.add_argument("--prefix-words", type=int, default=1500)
    p.add_argument("--prefix-jobs", type=int, default=160)
    p.add_argument("--capacity-blocks", type=int, default=150,
                   help="KV blocks per engine in part (b) (16 tokens each)")
    p.add_argument("--tmp", type=Path, default=Path("bench/results/async_queue_runs"))
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    a = [part_a(args, t, args.tmp) for t in range(args.trials)] if "a" in args.parts else []
    b = [part_b(args, t, args.tmp) for t in range(args.trials)] if "b" in args.parts else []
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "machine": machine_info(),
              "part_a": a, "part_b": b, "medians": summary(a, b)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result["medians"], indent=2))


if __name__ == "__main__":
    main()
