"""Flow control on a simulated H100 fleet (engines/sim at real H100 timing, ``--time-scale 1``,
``--max-num-seqs 16``): fresh processes per cell (``--engines`` sim engines and one
``kvgate serve --config`` with the quick-start preset plus API keys for two tenants).

Scenarios (``--scenario``), each a same-run comparison (systems rotated per trial):

* ``noisy`` -- noisy neighbour: tenant B runs ``--b-sessions`` agent sessions from the start
  (streaming, ``x-session-affinity``, history growing per turn); tenant A floods with
  ``--a-concurrency`` non-streaming requests in flight (10x its share of the fleet's
  ``engines x 16`` slots). Cells: B alone and B + A, with flow control ``off`` (the
  ``flow-control`` plugin removed: today's behaviour) and ``on`` (the default). Reported: B's
  TTFT p50/p99, ratios to B alone, A's status counts (429s carry ``Retry-After``), and
  exactly-once: the engines' finished-request count equals the clients' 200s.
* ``sessions`` -- agent sessions at saturation, one tenant: ``--long-sessions`` long sessions
  (many turns, long context, from the start) and ``--short-sessions`` short ones (starting over
  the measured window, after ``--warmup``), all closed loops, behind
  flow control with ``session_order: las`` vs ``fifo``. Reported: TTFT p99 and max, short
  sessions' completion time (median, p90), the share of prompt tokens the engines found
  cached (from the streams' usage chunks); ``--variant NAME=JSON`` adds las with those
  params. ``--replicas N``: the same through N replicas
  sharing Redis, each turn sent to one at random (a per-request balancer): fifo, las (the
  sessions' service and the engines' limits shared between replicas, the defaults),
  las-own-limits (``share_limits: false``: each replica learns its own share of an engine's
  batch), las-local (``share_sessions: false``: each replica ranks by its own part of a
  session's service; only with ``--with-local``) and las through one gateway; the
  replicas' routing plugins share through the same Redis as ``kvgate serve --redis`` has
  them (``--flow-only``: flow control alone), each ``--variant`` through the replicas and,
  as ``NAME-1r``, through one gateway; JSON ``..._sessions_<N>r[_flow_only].json``.
* ``replicas`` -- the noisy neighbour through 1 gateway vs 2 replicas sharing fairness through
  Redis (the defaults; and with ``share_limits: false``; and 2 without Redis): B's TTFT p99
  ratio to B alone on 1 replica (and, for 2 replicas with Redis, to B alone on those 2).
* ``priorities`` -- interactive streams alone vs with a saturating ``batch`` band (requests
  with ``x-kvgate-priority: batch``); flow control on. Reported: interactive TTFT p99 ratio.

``--engine-kind vllm`` (noisy only): the same on real vLLM CPU engines (the tiny model, one
core each, :data:`VLLM_KV_BYTES` of KV, fresh per cell; B's sessions restart every
:data:`VLLM_B_TURNS` turns to stay within the model's context); JSON ``..._noisy_vllm.json``.

Every figure is per trial; the summary quotes medians over ``--trials``. JSON to
``bench/results/flow_control_<scenario>.json`` (git-ignored)::

    .venv/bin/python -m bench.flow_control --scenario noisy --trials 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import random
import secrets
import shutil
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench import procs
from bench.harness import machine_info
from bench.replicas import redis_running
from kvgate.middleware.framework.composition.quickstart import QuickStart, quick_start_config
from kvgate.plugins.tenancy.keys_model import hash_key, new_key

MODEL = "sim-model"
#: ``--engine-kind vllm``: each real engine's KV cache (32k tokens of the tiny model: A's
#: 160 prompts of ~1.5k tokens do not all fit, B's sessions always do) and B's turns per
#: session (its history stays within the model's 4,096 tokens; a new session follows).
VLLM_KV_BYTES = 1 << 30
VLLM_B_TURNS = 12
#: The quick start's plugins that share through ``redis_url`` what a session's turns on
#: another replica need (``Setup.share_routing``).
ROUTING_SHARED = ("token-load-scorer", "session-affinity-scorer", "prefix-cache-producer",
                  "kv-placement-scorer")
WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa",
         "lambda", "mu", "nu", "xi", "omicron", "pi", "rho", "sigma", "tau", "upsilon")


@dataclass(frozen=True)
class Setup:
    engines: int = 2
    #: ``sim`` (engines/sim at H100 timing) or ``vllm`` (real vLLM CPU engines, the tiny model).
    kind: str = "sim"
    max_num_seqs: int = 16
    #: flow-control params; None: the plugin removed (no flow control).
    flow: dict[str, Any] | None = field(default_factory=dict)
    #: Gateway replicas in front of the same engines; ``redis``: share fairness through one.
    replicas: int = 1
    redis: bool = False
    #: With ``redis``: the routing plugins share through it too (session table, load,
    #: prefix record, placement memory), as ``kvgate serve --redis`` has them.
    share_routing: bool = False


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _config(urls: Sequence[str], port: int, root: Path, setup: Setup,
            redis: str | None = None, replica: int = 0) -> Path:
    data = quick_start_config(QuickStart(engines=tuple(urls))).model_dump(
        mode="json", exclude={"source"})
    data["server"].update({"host": "127.0.0.1", "port": port, "log_level": "warning"})
    data["pool"].update({"health_interval_s": 0.5, "metrics_interval_s": 0.5})
    plugins = [{"type": "api-keys", "params": {"file": str((root / "keys.yaml").resolve())}}]
    for plugin in data["plugins"]:
        if plugin["type"] == "flow-control":
            if setup.flow is None:
                continue
            plugin["params"] = {**setup.flow, **({"redis_url": redis} if redis else {})}
        elif redis and setup.share_routing and plugin["type"] in ROUTING_SHARED:
            plugin["params"] = {**plugin.get("params", {}), "redis_url": redis}
        if plugin["type"] == "async-queue":
            plugin["params"] = {"backend": f"sqlite://{root.resolve()}/jobs-{replica}.sqlite",
                                "management": None}
        plugins.append(plugin)
    data["plugins"] = plugins
    if setup.flow is None:  # and out of the profiles (its filter)
        for profile in data["profiles"]:
            profile["plugins"] = [r for r in profile["plugins"] if r["ref"] != "flow-control"]
    path = root / f"kvgate-{replica}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _keys(root: Path) -> dict[str, str]:
    """Tenants A and B, and an operator's admin key (``ops``: reads /metrics and /health)."""
    keys = {"A": new_key(), "B": new_key(), "ops": new_key()}
    entries = [{"id": f"{t}-1", "tenant": t, "sha256": hash_key(k), "admin": t == "ops",
                "max_priority": "interactive"} for t, k in keys.items()]
    (root / "keys.yaml").write_text(yaml.safe_dump({"keys": entries}))
    return keys


@contextlib.contextmanager
def system(root: Path, setup: Setup) -> Iterator[tuple[str, list[str], dict[str, str]]]:
    """Fresh engines and a gateway; yields (gateway URL, engine URLs, tenant keys)."""
    with systems(root, setup) as (gateways, urls, keys):
        yield gateways[0], urls, keys


@contextlib.contextmanager
def systems(root: Path, setup: Setup) -> Iterator[tuple[list[str], list[str], dict[str, str]]]:
    """Fresh engines and ``setup.replicas`` gateways (and a Redis when ``setup.redis``);
    yields (gateway URLs, engine URLs, tenant keys)."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    keys = _keys(root)
    with contextlib.ExitStack() as stack:
        urls = stack.enter_context(_vllm(setup.engines)) if setup.kind == "vllm" else []
        for i in range(setup.engines if setup.kind == "sim" else 0):
            port = procs.free_port()
            argv = [sys.executable, "-m", "kvgate.engines.sim", "--port", str(port), "--engine-id",
                    f"engine-{i}", "--model", MODEL, "--time-scale", "1", "--seed", str(i),
                    "--max-num-seqs", str(setup.max_num_seqs), "--capacity-blocks", "27000"]
            log = root / f"e{i}.log"
            proc = stack.enter_context(procs.running(argv, "0-1", log))
            url = f"http://127.0.0.1:{port}"
            procs.wait_healthy(url + "/health", proc, 30, log)
            urls.append(url)
        redis = stack.enter_context(redis_running(root)) if setup.redis else None
        kvgate = str(Path(sys.executable).with_name("kvgate"))
        # one gateway secret for every replica, as a deployment gives them (else each derives
        # its own tenant cache salts and splits a tenant's prefix cache per replica)
        secret = secrets.token_hex(32)
        gateways = []
        for r in range(setup.replicas):
            port = procs.free_port()
            cwd = root / f"r{r}"
            cwd.mkdir()
            config = _config(urls, port, root, setup, redis, r)
            log = root / f"kvgate-{r}.log"
            proc = stack.enter_context(procs.running(
                [kvgate, "serve", "--config", str(config.resolve())], "0-1", log,
                env={"KVGATE_SECRET": secret}, cwd=cwd))
            url = f"http://127.0.0.1:{port}"
            procs.wait_healthy(url + "/health", proc, 60, log)
            gateways.append(url)
        yield gateways, urls, keys


@contextlib.contextmanager
def _vllm(count: int) -> Iterator[list[str]]:
    """``count`` real vLLM CPU engines (one core each) for one cell; stopped after it."""
    from kvgate.engines.local.fleet import start_fleet
    from kvgate.engines.local.launcher import stop
    engines = start_fleet(count, kv_cache_bytes=VLLM_KV_BYTES, progress=lambda _: None)
    try:
        yield [e.url for e in engines]
    finally:
        for engine in engines:
            stop(engine)


def model_of(kind: str) -> str:
    """The model name the engines of ``kind`` serve."""
    if kind == "sim":
        return MODEL
    from kvgate.engines.local.model import SERVED_NAME
    return SERVED_NAME


@dataclass
class Tally:
    ttfts: list[float] = field(default_factory=list)
    statuses: Counter[int] = field(default_factory=Counter)
    retry_after_missing: int = 0
    sessions_done: list[float] = field(default_factory=list)
    #: Prompt and cached prompt tokens of the measured streams whose usage chunk reported
    #: cached tokens.
    prompt_tokens: int = 0
    cached_tokens: int = 0
    #: TTFTs of requests sent before this (time.monotonic()) are not recorded (warm-up).
    measure_from: float = 0.0


async def _call(session: aiohttp.ClientSession, url: str, key: str, body: dict[str, Any],
                headers: dict[str, str], tally: Tally) -> bool:
    """One request; a stream's TTFT (first content event) goes to ``tally``."""
    start = time.monotonic()
    hdrs = {"authorization": f"Bearer {key}", **headers}
    async with session.post(url + "/v1/chat/completions", json=body, headers=hdrs) as resp:
        tally.statuses[resp.status] += 1
        if resp.status != 200:
            if resp.status == 429 and "Retry-After" not in resp.headers:
                tally.retry_after_missing += 1
            await resp.read()
            return False
        if not body.get("stream"):
            await resp.read()
            return True
        seen = False
        async for line in resp.content:
            if not seen and line.startswith(b"data: ") and b'"content"' in line:
                if start >= tally.measure_from:
                    tally.ttfts.append(time.monotonic() - start)
                seen = True
            elif line.startswith(b'data: {') and b'"usage"' in line and start >= tally.measure_from:
                _count_usage(json.loads(line[6:]).get("usage"), tally)
        return True


def _count_usage(usage: dict[str, Any] | None, tally: Tally) -> None:
    """A stream's usage chunk: its prompt and cached prompt tokens into ``tally``, only when
    the engine reported its cached tokens (unknown is not 0: the share is over the streams
    that said)."""
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    prompt = (usage or {}).get("prompt_tokens")
    if isinstance(cached, int) and isinstance(prompt, int):
        tally.prompt_tokens += prompt
        tally.cached_tokens += cached


async def agent(url: str | Sequence[str], key: str, sid: str, turns: int, ctx_words: int,
                out_tokens: int, think_s: float, stop: float, tally: Tally, seed: int,
                headers: dict[str, str] | None = None, model: str = MODEL) -> None:
    """A closed-loop agent session: each turn resends the history plus a new message. With
    several gateway URLs each turn goes to one drawn at random (seeded): a per-request
    balancer in front of replicas."""
    rng = random.Random(seed)
    urls = [url] if isinstance(url, str) else list(url)
    balancer = random.Random(seed ^ 0x5EED)
    history: list[dict[str, str]] = [{"role": "system", "content": _text(rng, ctx_words)}]
    start = time.monotonic()
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for turn in range(turns):
            if time.monotonic() >= stop:
                return
            history.append({"role": "user", "content": f"{sid} turn {turn}: " + _text(rng, 40)})
            body = {"model": model, "messages": history, "max_tokens": out_tokens,
                    "stream": True, "ignore_eos": True,
                    "stream_options": {"include_usage": True}}
            await _call(session, urls[balancer.randrange(len(urls))], key, body,
                        {"x-session-affinity": sid, **(headers or {})}, tally)
            history.append({"role": "assistant", "content": _text(rng, out_tokens // 2)})
            await asyncio.sleep(think_s)
        tally.sessions_done.append(time.monotonic() - start)


async def sessions_until(url: str, key: str, sid: str, turns: int, stop: float, tally: Tally,
                         seed: int, model: str) -> None:
    """B's agent sessions of ``turns`` turns each, one after another, until ``stop``."""
    n = 0
    while time.monotonic() < stop:
        await agent(url, key, f"{sid}-{n}", turns, 300, 32, 0.3, stop, tally, seed + 7919 * n,
                    model=model)
        n += 1


async def flood(url: str, key: str, concurrency: int, stop: float, tally: Tally, seed: int,
                headers: dict[str, str] | None = None, stream: bool = False,
                model: str = MODEL) -> None:
    """``concurrency`` closed loops of long one-shot requests until ``stop``."""
    timeout = aiohttp.ClientTimeout(total=600)

    async def loop(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while time.monotonic() < stop:
                body = {"model": model, "max_tokens": 256, "ignore_eos": True, "stream": stream,
                        "messages": [{"role": "user", "content": f"flood {i}: "
                                      + _text(rng, 600)}]}
                if not await _call(session, url, key, body, headers or {}, tally):
                    await asyncio.sleep(1.0)  # Retry-After
    await asyncio.gather(*(loop(i) for i in range(concurrency)))


def _flood_proc(url: str, key: str, concurrency: int, stop: float, seed: int,
                headers: dict[str, str] | None, out: Any, model: str = MODEL) -> None:
    """:func:`flood` in its own process (its 100+ connections off the measuring client's event
    loop); puts its status counts on ``out``."""
    tally = Tally()
    asyncio.run(flood(url, key, concurrency, stop, tally, seed, headers, model=model))
    out.put(dict(tally.statuses))


@contextlib.asynccontextmanager
async def flood_process(url: str, key: str, concurrency: int, stop: float, seed: int,
                        tally: Tally, headers: dict[str, str] | None = None,
                        delay_s: float = 0.0, model: str = MODEL) -> Any:
    """Run a flood in a child process (time.monotonic is system-wide) while the block runs;
    its statuses land in ``tally`` when it ends."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_delayed_flood, args=(
        url, key, concurrency, stop, seed, headers, out, delay_s, model))
    proc.start()
    try:
        yield
    finally:
        statuses = await asyncio.to_thread(out.get, True, 900)
        await asyncio.to_thread(proc.join, 30)
        tally.statuses.update({int(k): v for k, v in statuses.items()})


def _delayed_flood(url: str, key: str, concurrency: int, stop: float, seed: int,
                   headers: dict[str, str] | None, out: Any, delay_s: float,
                   model: str = MODEL) -> None:
    time.sleep(delay_s)
    _flood_proc(url, key, concurrency, stop, seed, headers, out, model)


async def engine_finished(urls: Sequence[str]) -> float:
    """The engines' finished requests (``vllm:request_success_total``), all reasons."""
    total = 0.0
    async with aiohttp.ClientSession() as session:
        for url in urls:
            async with session.get(url + "/metrics") as resp:
                for line in (await resp.text()).splitlines():
                    if line.startswith("vllm:request_success_total"):
                        total += float(line.rsplit(" ", 1)[1])
    return total


def _p(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(t: Tally) -> dict[str, Any]:
    return {"n": len(t.ttfts), "ttft_p50_s": _p(t.ttfts, 0.5), "ttft_p99_s": _p(t.ttfts, 0.99),
            "ttft_max_s": max(t.ttfts, default=None),
            "statuses": {str(k): v for k, v in sorted(t.statuses.items())},
            "retry_after_missing": t.retry_after_missing,
            "sessions_done": len(t.sessions_done),
            "session_time_p50_s": _p(t.sessions_done, 0.5),
            "session_time_p90_s": _p(t.sessions_done, 0.9),
            "prompt_tokens": t.prompt_tokens, "cached_tokens": t.cached_tokens,
            "cached_share": t.cached_tokens / t.prompt_tokens if t.prompt_tokens else None}


def gateway_view(root: Path, tenant: str, since: float) -> dict[str, Any]:
    """What the gateways' access logs (``kvgate-*.log`` under ``root``) say about ``tenant``'s
    requests that started at or after ``since`` (wall clock): time to first byte and the wait
    in the flow-control queue (p50, p99, max, ms), and how many were placed away from their
    session's engine (``placement`` ``moved``): the gateway's part of a TTFT."""
    ttfb: list[float] = []
    wait: list[float] = []
    moved = 0
    for log in root.glob("kvgate-*.log"):
        for line in log.read_text(errors="replace").splitlines():
            if not line.startswith("{"):
                continue
            entry = json.loads(line)
            started = entry.get("ts", 0) - entry.get("total_s", 0)
            if entry.get("tenant") != tenant or started < since:
                continue
            if entry.get("ttfb_s") is not None:
                ttfb.append(entry["ttfb_s"] * 1000)
            wait.append(float(entry.get("flow_wait_ms") or 0.0))
            moved += entry.get("placement") == "moved"
    def stats(values: list[float]) -> dict[str, float | None]:
        return {"p50": _p(values, 0.5), "p99": _p(values, 0.99), "max": max(values, default=None)}
    return {"n": len(wait), "ttfb_ms": stats(ttfb), "flow_wait_ms": stats(wait),
            "moved": moved}


async def _noisy_cell(url: str, urls: Sequence[str], keys: dict[str, str], flood_on: bool,
                      args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """B's sessions run from the start; A's flood (if any) starts 2 s later; B's TTFTs count
    from ``warmup`` on (A's backlog built up, the gateway's limits learned)."""
    now = time.monotonic()
    a, b = Tally(), Tally(measure_from=now + args.warmup)
    stop = now + args.warmup + args.duration
    model = model_of(args.engine_kind)
    turns = 10_000 if args.engine_kind == "sim" else VLLM_B_TURNS
    tasks = [sessions_until(url, keys["B"], f"b-{seed}-{i}", turns, stop, b, seed + i, model)
             for i in range(args.b_sessions)]
    async with contextlib.AsyncExitStack() as stack:
        if flood_on:
            await stack.enter_async_context(flood_process(
                url, keys["A"], args.a_concurrency, stop, seed, a, delay_s=2.0, model=model))
        await asyncio.gather(*tasks)
    finished = await engine_finished(urls)
    ok = a.statuses[200] + b.statuses[200]
    return {"B": summary(b), "A": summary(a), "engine_finished": finished, "client_200": ok,
            "exactly_once": finished == ok,
            "B_gateway": gateway_view(args.root_path, "B", time.time() - args.duration)}


def _ratio(x: float | None, y: float | None) -> float | None:
    return None if x is None or y is None or y == 0 else round(x / y, 3)


def _variant_params(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """``--variant NAME=JSON``, parsed: each name's flow-control params."""
    return {name: json.loads(params) for name, _, params
            in (spec.partition("=") for spec in args.variant)}


def _variants(args: argparse.Namespace) -> dict[str, Setup]:
    """``--variant NAME=JSON``: more systems, flow control with these params (same run)."""
    return {name: Setup(args.engines, args.engine_kind, flow=flow)
            for name, flow in _variant_params(args).items()}


def run_noisy(args: argparse.Namespace, root: Path) -> list[dict[str, Any]]:
    kind = args.engine_kind
    systems = {"off": Setup(args.engines, kind, flow=None), "on": Setup(args.engines, kind),
               **_variants(args)}
    if args.skip_off:  # today's behaviour measured already: the variants against "on" only
        del systems["off"]
    trials = []
    for trial in range(args.trials):
        names = list(systems) if trial % 2 == 0 else list(reversed(systems))
        cells: dict[str, Any] = {}
        for name in names:
            for flood_on in (False, True):
                label = f"{name}/{'flood' if flood_on else 'alone'}"
                with system(root, systems[name]) as (url, urls, keys):
                    cells[label] = asyncio.run(
                        _noisy_cell(url, urls, keys, flood_on, args, 100 * trial + 7))
                print(label, json.dumps(cells[label]["B"]), cells[label]["A"]["statuses"],
                      "exactly_once", cells[label]["exactly_once"],
                      "gateway", json.dumps(cells[label]["B_gateway"]), flush=True)
        for name in systems:
            cells[f"{name}/ratio_p99"] = _ratio(cells[f"{name}/flood"]["B"]["ttft_p99_s"],
                                                cells[f"{name}/alone"]["B"]["ttft_p99_s"])
        trials.append(cells)
    return trials


async def _sessions_cell(url: Sequence[str], keys: dict[str, str], args: argparse.Namespace,
                         seed: int) -> dict[str, Any]:
    """The long sessions start together and run ``warmup + duration``; the short ones start
    evenly over the measured ``duration`` after ``warmup`` (the fleet saturated by then, the
    long sessions already served: not the cold start where every session is new and least
    attained service has nothing to tell apart); TTFTs count from ``warmup`` on."""
    start = time.monotonic()
    longs, shorts = Tally(measure_from=start + args.warmup), Tally()
    stop = start + args.warmup + args.duration
    tasks = [agent(url, keys["A"], f"long-{seed}-{i}", 10_000, 1500, 32, 0.0, stop, longs,
                   seed + i) for i in range(args.long_sessions)]
    tasks += [_later(args.warmup + i * args.duration / (args.short_sessions + 1),
                     agent(url, keys["A"], f"short-{seed}-{i}", 3, 100, 32, 0.0, stop + 120,
                           shorts, seed + 1000 + i)) for i in range(args.short_sessions)]
    await asyncio.gather(*tasks)
    every = Tally(ttfts=longs.ttfts + shorts.ttfts,
                  prompt_tokens=longs.prompt_tokens + shorts.prompt_tokens,
                  cached_tokens=longs.cached_tokens + shorts.cached_tokens)
    return {"all": summary(every), "long": summary(longs), "short": summary(shorts)}


async def _later(delay: float, work: Any) -> None:
    await asyncio.sleep(delay)
    await work


def _sessions_systems(args: argparse.Namespace) -> dict[str, Setup]:
    """fifo and las through one gateway; with ``--replicas N``, through N replicas sharing
    Redis (las: the sessions' service and the limits shared; las-own-limits: each replica's
    own limits; las-local, with ``--with-local``: each replica's own session counters) and las
    through one gateway as the reference."""
    las: dict[str, Any] = {"session_order": "las",
                           **({"aging_tokens_per_s": args.aging} if args.aging else {})}
    variants = {name: {**las, **flow} for name, flow in _variant_params(args).items()}
    if args.replicas <= 1:  # variants: las with these params too
        return {"fifo": Setup(args.engines, flow={"session_order": "fifo"}),
                "las": Setup(args.engines, flow=las),
                **{name: Setup(args.engines, flow=flow) for name, flow in variants.items()}}
    shared: dict[str, Any] = {"replicas": args.replicas, "redis": True,
                              "share_routing": not args.flow_only}
    out = {"fifo": Setup(args.engines, flow={"session_order": "fifo"}, **shared),
           "las": Setup(args.engines, flow=las, **shared),
           "las-own-limits": Setup(args.engines, flow={**las, "share_limits": False},
                                   **shared)}
    if args.with_local:
        out["las-local"] = Setup(args.engines, flow={**las, "share_sessions": False}, **shared)
    for name, flow in variants.items():  # las through the replicas with these params too
        out[name] = Setup(args.engines, flow=flow, **shared)
    out["las-1r"] = Setup(args.engines, flow=las)
    for name, flow in variants.items():  # and through one gateway
        out[f"{name}-1r"] = Setup(args.engines, flow=flow)
    return out


def run_sessions(args: argparse.Namespace, root: Path) -> list[dict[str, Any]]:
    systems_ = _sessions_systems(args)
    trials = []
    for trial in range(args.trials):
        names = list(systems_) if trial % 2 == 0 else list(reversed(systems_))
        cells: dict[str, Any] = {}
        for name in names:
            with systems(root, systems_[name]) as (gateways, _, keys):
                cells[name] = asyncio.run(_sessions_cell(gateways, keys, args,
                                                         100 * trial + 3))
            print(name, json.dumps(cells[name]), flush=True)
        for las in [n for n in cells if n.startswith("las")]:
            suffix = las[3:]
            cells[f"ratio_ttft_p99{suffix}"] = _ratio(cells["fifo"]["all"]["ttft_p99_s"],
                                                      cells[las]["all"]["ttft_p99_s"])
            cells[f"ratio_short_ttft_p99{suffix}"] = _ratio(
                cells["fifo"]["short"]["ttft_p99_s"], cells[las]["short"]["ttft_p99_s"])
            cells[f"ratio_short_session_p50{suffix}"] = _ratio(
                cells["fifo"]["short"]["session_time_p50_s"],
                cells[las]["short"]["session_time_p50_s"])
            cells[f"{las}_max_ttft_s"] = cells[las]["all"]["ttft_max_s"]
        cells["fifo_max_ttft_s"] = cells["fifo"]["all"]["ttft_max_s"]
        trials.append(cells)
    return trials


async def _priorities_cell(url: str, keys: dict[str, str], batch_on: bool,
                           args: argparse.Namespace, seed: int) -> dict[str, Any]:
    inter, batch = Tally(), Tally()
    now = time.monotonic()
    stop = now + args.duration + args.warmup
    inter.measure_from = now + args.warmup
    tasks = [agent(url, keys["B"], f"i-{seed}-{i}", 10_000, 300, 32, 0.3, stop, inter,
                   seed + i, {"x-kvgate-priority": "interactive"})
             for i in range(args.b_sessions)]
    async with contextlib.AsyncExitStack() as stack:
        if batch_on:
            await stack.enter_async_context(flood_process(
                url, keys["A"], args.a_concurrency, stop, seed, batch,
                {"x-kvgate-priority": "batch"}, delay_s=2.0))
        await asyncio.gather(*tasks)
    return {"interactive": summary(inter), "batch": summary(batch)}


def run_priorities(args: argparse.Namespace, root: Path) -> list[dict[str, Any]]:
    """The default (cells ``alone``, ``with_batch``, ``ratio_p99``) and each ``--variant``
    (the same, prefixed ``NAME/``)."""
    setups = {"": Setup(args.engines), **{f"{k}/": v for k, v in _variants(args).items()}}
    trials = []
    for trial in range(args.trials):
        cells: dict[str, Any] = {}
        for prefix, setup in setups.items():
            for batch_on in ((False, True) if trial % 2 == 0 else (True, False)):
                label = prefix + ("with_batch" if batch_on else "alone")
                with system(root, setup) as (url, _, keys):
                    cells[label] = asyncio.run(_priorities_cell(url, keys, batch_on, args,
                                                                100 * trial + 5))
                print(label, json.dumps(cells[label]), flush=True)
            cells[f"{prefix}ratio_p99"] = _ratio(
                cells[f"{prefix}with_batch"]["interactive"]["ttft_p99_s"],
                cells[f"{prefix}alone"]["interactive"]["ttft_p99_s"])
        trials.append(cells)
    return trials


async def _replicas_cell(gateways: Sequence[str], urls: Sequence[str], keys: dict[str, str],
                         flood_on: bool, args: argparse.Namespace,
                         seed: int) -> dict[str, Any]:
    """As the noisy cell, with B's sessions and A's flood loops spread over the replicas."""
    now = time.monotonic()
    a, b = Tally(), Tally(measure_from=now + args.warmup)
    stop = now + args.warmup + args.duration
    n = len(gateways)
    tasks = [agent(gateways[i % n], keys["B"], f"b-{seed}-{i}", 10_000, 300, 32, 0.3, stop, b,
                   seed + i) for i in range(args.b_sessions)]
    async with contextlib.AsyncExitStack() as stack:
        if flood_on:
            for k, g in enumerate(gateways):
                await stack.enter_async_context(flood_process(
                    g, keys["A"], args.a_concurrency // n, stop, seed + k, a, delay_s=2.0))
        await asyncio.gather(*tasks)
    finished = await engine_finished(urls)
    ok = a.statuses[200] + b.statuses[200]
    return {"B": summary(b), "A": summary(a), "engine_finished": finished, "client_200": ok,
            "exactly_once": finished == ok}


def run_replicas(args: argparse.Namespace, root: Path) -> list[dict[str, Any]]:
    """B's TTFT ratio (flood / alone) through 1 replica vs 2 replicas sharing Redis (and 2
    without): N replicas behaving like one means the same ratio."""
    cells_of = [("1r/alone", Setup(args.engines), False),
                ("2r-redis/alone", Setup(args.engines, replicas=2, redis=True), False),
                ("1r/flood", Setup(args.engines), True),
                ("2r-redis/flood", Setup(args.engines, replicas=2, redis=True), True),
                ("2r-redis-own-limits/flood", Setup(args.engines, replicas=2, redis=True,
                                                    flow={"share_limits": False}), True),
                ("2r-local/flood", Setup(args.engines, replicas=2), True)]
    trials = []
    for trial in range(args.trials):
        order = cells_of if trial % 2 == 0 else [*cells_of[:2], *reversed(cells_of[2:])]
        cells: dict[str, Any] = {}
        for label, setup, flood_on in order:
            with systems(root, setup) as (gateways, urls, keys):
                cells[label] = asyncio.run(_replicas_cell(gateways, urls, keys, flood_on, args,
                                                          100 * trial + 11))
            print(label, json.dumps(cells[label]["B"]), cells[label]["A"]["statuses"],
                  "exactly_once", cells[label]["exactly_once"], flush=True)
        base = cells["1r/alone"]["B"]["ttft_p99_s"]
        for label in ("1r/flood", "2r-redis/flood", "2r-redis-own-limits/flood",
                      "2r-local/flood"):
            cells[f"{label}/ratio_p99"] = _ratio(cells[label]["B"]["ttft_p99_s"], base)
        # the two replicas' own light-load tail as the base (what a second hop adds alone)
        cells["2r-redis/flood/ratio_p99_own_alone"] = _ratio(
            cells["2r-redis/flood"]["B"]["ttft_p99_s"], cells["2r-redis/alone"]["B"]["ttft_p99_s"])
        trials.append(cells)
    return trials


def _median(trials: list[dict[str, Any]], key: str) -> float | None:
    values = [t[key] for t in trials if t.get(key) is not None]
    return statistics.median(values) if values else None


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--scenario", choices=["noisy", "sessions", "priorities", "replicas"],
                   default="noisy")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--engine-kind", choices=["sim", "vllm"], default="sim",
                   help="noisy: simulated H100 engines, or real vLLM CPU engines (the tiny "
                        "model, one core each; fresh engines per cell)")
    p.add_argument("--duration", type=float, default=30.0, help="measured seconds per cell")
    p.add_argument("--warmup", type=float, default=5.0,
                   help="uncounted seconds first: the flood's head start (noisy, "
                        "priorities, replicas), the long sessions' (sessions)")
    p.add_argument("--a-concurrency", type=int, default=160,
                   help="A's requests in flight: 10x its share of engines x 16 slots / 2")
    p.add_argument("--b-sessions", type=int, default=3)
    p.add_argument("--long-sessions", type=int, default=64,
                   help="closed loops, more than the fleet's slots: the fleet stays saturated")
    p.add_argument("--short-sessions", type=int, default=40)
    p.add_argument("--replicas", type=int, default=1,
                   help="sessions: through this many replicas sharing Redis (each turn to one "
                        "at random), with and without the sessions' service shared")
    p.add_argument("--flow-only", action="store_true",
                   help="sessions with --replicas: only flow control shares through Redis "
                        "(not the routing plugins, as kvgate serve --redis would)")
    p.add_argument("--with-local", action="store_true",
                   help="sessions with --replicas: also las-local (share_sessions: false)")
    p.add_argument("--aging", type=float, default=None,
                   help="sessions: the las system's aging_tokens_per_s (default: the plugin's)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                   help="noisy, priorities: one more system, flow control with these params "
                        "(e.g. 'paced={\"over_share_pace_s\": 0.05}'); sessions: las with these "
                        "params (with --replicas: through the replicas and, as NAME-1r, one "
                        "gateway); repeatable")
    p.add_argument("--skip-off", action="store_true",
                   help="noisy: leave out the system without flow control")
    p.add_argument("--root", default="/tmp/kvgate-bench-flow")
    args = p.parse_args(argv)
    args.root_path = Path(args.root)
    if args.engine_kind != "sim" and args.scenario != "noisy":
        p.error("--engine-kind vllm: the noisy scenario only")
    run = {"noisy": run_noisy, "sessions": run_sessions, "priorities": run_priorities,
           "replicas": run_replicas}
    trials = run[args.scenario](args, Path(args.root))
    names = [spec.partition("=")[0] for spec in args.variant]
    keys = {"noisy": [*([] if args.skip_off else ["off/ratio_p99"]), "on/ratio_p99",
                      *(f"{n}/ratio_p99" for n in names)],
            "sessions": [f"{r}{n[3:]}" for n in _sessions_systems(args) if n.startswith("las")
                         for r in ("ratio_ttft_p99", "ratio_short_ttft_p99",
                                   "ratio_short_session_p50")]
            + [f"{n}_max_ttft_s" for n in _sessions_systems(args)],
            "priorities": ["ratio_p99", *(f"{n}/ratio_p99" for n in names)],
            "replicas": ["1r/flood/ratio_p99", "2r-redis/flood/ratio_p99",
                         "2r-redis-own-limits/flood/ratio_p99", "2r-local/flood/ratio_p99",
                         "2r-redis/flood/ratio_p99_own_alone"]
            }[args.scenario]
    medians = {k: _median(trials, k) for k in keys}
    out = {"scenario": args.scenario, "args": {**vars(args), "root_path": args.root},
           "machine": machine_info(),
           "calibration": "engines/sim --time-scale 1 (H100_TIMING.md), --max-num-seqs 16"
           if args.engine_kind == "sim" else "vLLM CPU engines, the tiny model, one core each",
           "medians": medians, "trials": trials}
    kind = "" if args.engine_kind == "sim" else f"_{args.engine_kind}"
    if args.scenario == "sessions" and args.replicas > 1:
        kind += f"_{args.replicas}r" + ("_flow_only" if args.flow_only else "")
    path = Path(f"bench/results/flow_control_{args.scenario}{kind}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(json.dumps(medians), "->", path)


if __name__ == "__main__":
    main()
