"""Prefill/decode disaggregation benchmark on a simulated fleet (H100-calibrated simulator).

Agentic, input-heavy load: each request is one agent step — a shared system prompt per agent
kind (``--system-tokens``) plus a fresh tool output (``--tool-tokens`` ± 50 %), answered with
``--output-tokens`` tokens (``ignore_eos``), streamed. Arrivals are open-loop Poisson at
``--rate`` requests/s for ``--duration`` s (seeded), so queueing shows up as latency.

Systems, all with the same number of engines (``--engines``):

* ``agg-rr`` / ``agg-load``: every engine does both; kvgate round-robin / token-load balancing;
* ``pd-rr`` / ``pd-token``: ``--prefill`` prefill engines, the rest decode, NIXL protocol,
  kvgate's pd-profile-handler with round-robin / token-load (in-flight prefill and decode
  tokens) balancing in both profiles;
* ``vllm-router-pd`` (``--with-vllm-router``): vllm-router 0.1.17 in its P/D mode
  (``--vllm-pd-disaggregation --kv-connector nixl``) in front of the same P/D fleet.

Per request: TTFT (send -> first content token) and time per output token (TPOT: first ->
last token over tokens - 1). Reported: p50/p90 of each over completed requests, the p90/p99
inter-token latency (ITL: every gap between two tokens of a stream, pooled), and errors.

Engines run with ``--batched-tokens`` (default 2048) as their chunked-prefill budget: an 8k-token
prompt is prefilled in four chunks of ≈ 75 ms each (simulated H100), each stalling every decode
co-running on that engine for one step; that is the interference disaggregation removes. The
defaults (8 req/s of ~10k-token prompts, 3 prefill + 1 decode engines) put the aggregated
engines at ≈ 55 % prefill utilisation and the prefill pool at ≈ 75 %.

Every process is pinned to the machine's cores by ``taskset`` (engines and gateway share them).
Run under the heavy lock: ``flock /tmp/kvgate-heavy.lock .venv/bin/python -m bench.pd``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench import procs, venvs

WORDS = ("alpha", "beta", "gamma", "delta", "file", "line", "error", "trace", "value", "config",
         "module", "result", "request", "token", "cache", "engine", "build", "test", "output",
         "input", "schema", "field", "index", "table")


@dataclass(frozen=True)
class Args:
    engines: int
    prefill: int
    rate: float
    duration: float
    system_tokens: int
    tool_tokens: int
    tool_sigma: float
    output_tokens: int
    agents: int
    time_scale: float
    batched_tokens: int
    seed: int
    systems: tuple[str, ...]
    cpus: str
    out: str | None


@dataclass
class Sample:
    ttft: float | None = None
    tpot: float | None = None
    tokens: int = 0
    error: str | None = None
    #: Gaps between consecutive tokens (inter-token latency), seconds.
    gaps: list[float] = field(default_factory=list)


def _text(rng: random.Random, tokens: int) -> str:
    # the simulator's tokenizer makes about one token per short word plus its space
    return " ".join(rng.choice(WORDS) for _ in range(tokens))


#: Longest tool output drawn [tokens]: the prompt must fit the engines' 32k context.
MAX_TOOL_TOKENS = 24_000


def tool_length(rng: random.Random, a: Args) -> int:
    """Tool output size [tokens]: uniform ±50 % around ``tool_tokens``, or with
    ``tool_sigma`` > 0 lognormal with that mean (heavy-tailed), capped at MAX_TOOL_TOKENS."""
    if a.tool_sigma <= 0:
        return int(a.tool_tokens * rng.uniform(0.5, 1.5))
    mu = math.log(a.tool_tokens) - a.tool_sigma ** 2 / 2
    return min(MAX_TOOL_TOKENS, max(16, int(rng.lognormvariate(mu, a.tool_sigma))))


def workload(a: Args) -> list[tuple[float, dict[str, Any]]]:
    """(arrival offset [s], body) for the whole run, seeded."""
    rng = random.Random(a.seed)
    systems = [f"You are agent {i}. " + _text(random.Random(i), a.system_tokens)
               for i in range(a.agents)]
    out: list[tuple[float, dict[str, Any]]] = []
    t = 0.0
    while True:
        t += rng.expovariate(a.rate)
        if t >= a.duration:
            return out
        tool = _text(rng, tool_length(rng, a))
        body = {"model": "sim-model", "stream": True, "ignore_eos": True,
                "max_tokens": a.output_tokens, "stream_options": {"include_usage": True},
                "messages": [{"role": "system", "content": rng.choice(systems)},
                             {"role": "user", "content": f"Tool output:\n{tool}\nNext step?"}]}
        out.append((t, body))


async def one(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Sample:
    s = Sample()
    start = time.perf_counter()
    first = last = 0.0
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                s.error = f"HTTP {resp.status}"
                await resp.read()
                return s
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    s.error = "stream error"
                    return s
                if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                    now = time.perf_counter()
                    if last:
                        s.gaps.append(now - last)
                    first = first or now
                    last = now
                    s.tokens += 1
    except (aiohttp.ClientError, TimeoutError) as exc:
        s.error = type(exc).__name__
        return s
    if s.tokens:
        s.ttft = first - start
        s.tpot = (last - first) / (s.tokens - 1) if s.tokens > 1 else None
    return s


async def drive(url: str, reqs: Sequence[tuple[float, dict[str, Any]]]) -> list[Sample]:
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        t0 = time.perf_counter()

        async def at(offset: float, body: dict[str, Any]) -> Sample:
            await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
            return await one(session, url, body)

        return list(await asyncio.gather(*(at(o, b) for o, b in reqs)))


def pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def summary(samples: Sequence[Sample]) -> dict[str, Any]:
    ttft = [s.ttft for s in samples if s.ttft is not None]
    tpot = [s.tpot for s in samples if s.tpot is not None]
    gaps = [g for s in samples for g in s.gaps]
    return {"requests": len(samples), "errors": sum(s.error is not None for s in samples),
            "ttft_p50_s": pct(ttft, 0.5), "ttft_p90_s": pct(ttft, 0.9),
            "tpot_p50_s": pct(tpot, 0.5), "tpot_p90_s": pct(tpot, 0.9),
            "itl_p90_s": pct(gaps, 0.9), "itl_p99_s": pct(gaps, 0.99)}


# -- fleet and systems -------------------------------------------------------------------------

def _profile(picker: str, scorer: str | None, role: str | None) -> list[dict[str, Any]]:
    refs: list[dict[str, Any]] = [{"ref": "health-filter"}]
    if role:
        refs.append({"ref": f"{role}-role"})
    if scorer:
        refs.append({"ref": scorer, "weight": 1.0})
    return [*refs, {"ref": picker}]


def gateway_config(system: str, urls: Sequence[str], roles: Sequence[str],
                   port: int) -> dict[str, Any]:
    """kvgate's config for one system (configuration data, as a user would write it)."""
    balance = system.endswith("-rr")
    picker = "round-robin-picker" if balance else "max-score-picker"
    scorer = None if balance else "token-load-scorer"
    plugins: list[dict[str, Any]] = [{"type": "health-filter"}, {"type": picker}]
    if scorer:
        plugins.append({"type": scorer})
    engines = [{"name": f"e{i}", "url": u, "role": r}
               for i, (u, r) in enumerate(zip(urls, roles, strict=True))]
    data: dict[str, Any] = {"server": {"port": port, "log_level": "warning"},
                            "engines": engines, "plugins": plugins}
    if system.startswith("agg"):
        data["profiles"] = [{"name": "default", "plugins": _profile(picker, scorer, None)}]
        return data
    # one picker instance per profile: a round-robin picker's position is per instance
    plugins += [{"type": "role-filter", "name": "decode-role", "params": {"role": "decode"}},
                {"type": "role-filter", "name": "prefill-role", "params": {"role": "prefill"}},
                {"type": picker, "name": "prefill-picker"}, {"type": "pd-profile-handler"}]
    data["profiles"] = [
        {"name": "decode", "plugins": _profile(picker, scorer, "decode")},
        {"name": "prefill", "plugins": _profile("prefill-picker", scorer, "prefill")}]
    data["profile_handler"] = "pd-profile-handler"
    data["disaggregation"] = {"connector": "vllm-nixl"}
    return data


@contextlib.contextmanager
def fleet(a: Args, roles: Sequence[str], logs: Path) -> Iterator[list[str]]:
    with contextlib.ExitStack() as stack:
        urls = []
        for i, role in enumerate(roles):
            port = procs.free_port()
            argv = [sys.executable, "-m", "kvgate.engines.sim", "--port", str(port), "--role", role,
                    "--time-scale", str(a.time_scale), "--engine-id", f"{role}-{i}",
                    "--capacity-blocks", "16384",
                    "--max-num-batched-tokens", str(a.batched_tokens)]
            log = logs / f"engine-{i}.log"
            proc = stack.enter_context(procs.running(argv, a.cpus, log))
            url = f"http://127.0.0.1:{port}"
            procs.wait_healthy(url + "/health", proc, 30, log)
            urls.append(url)
        yield urls


@contextlib.contextmanager
def system_running(a: Args, system: str, urls: Sequence[str], roles: Sequence[str],
                   logs: Path) -> Iterator[str]:
    port = procs.free_port()
    if system == "vllm-router-pd":
        prog = venvs.bin_path(venvs.VLLM_ROUTER, "vllm-router")
        argv = [str(prog), "--vllm-pd-disaggregation", "--kv-connector", "nixl",
                "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(procs.free_port()),
                "--log-level", "warning"]
        for u, r in zip(urls, roles, strict=True):
            argv += ["--prefill" if r == "prefill" else "--decode", u]
    else:
        cfg = logs / f"{system}.yaml"
        cfg.write_text(yaml.safe_dump(gateway_config(system, urls, roles, port)))
        argv = [str(Path(sys.executable).parent / "kvgate"), "serve", "--config", str(cfg)]
    log = logs / f"{system}.log"
    with procs.running(argv, a.cpus, log) as proc:
        url = f"http://127.0.0.1:{port}"
        procs.wait_healthy(url + "/health", proc, 60, log)
        yield url


def run_system(a: Args, system: str, logs: Path) -> dict[str, Any]:
    pd = system.startswith("pd") or system == "vllm-router-pd"
    roles = (["prefill"] * a.prefill + ["decode"] * (a.engines - a.prefill)) if pd \
        else ["both"] * a.engines
    with fleet(a, roles, logs / system) as urls, \
            system_running(a, system, urls, roles, logs) as url:
        samples = asyncio.run(drive(url, workload(a)))
    return {"system": system, "roles": roles, **summary(samples)}


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def table(rows: Sequence[dict[str, Any]]) -> str:
    head = ("| system | engines | TTFT p50 (ms) | TTFT p90 (ms) | TPOT p50 (ms) | TPOT p90 (ms) "
            "| ITL p90 (ms) | ITL p99 (ms) | errors |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p = r["roles"].count("prefill")
        shape = f"{p}P+{len(r['roles']) - p}D" if p else f"{len(r['roles'])} agg"
        lines.append(f"| {r['system']} | {shape} | {_ms(r['ttft_p50_s'])} | "
                     f"{_ms(r['ttft_p90_s'])} | {_ms(r['tpot_p50_s'])} | {_ms(r['tpot_p90_s'])} "
                     f"| {_ms(r['itl_p90_s'])} | {_ms(r['itl_p99_s'])} "
                     f"| {r['errors']}/{r['requests']} |")
    return "\n".join(lines)


def parse(argv: Sequence[str] | None) -> Args:
    p = argparse.ArgumentParser(prog="bench.pd", description=__doc__.split("\n")[0])
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--prefill", type=int, default=3, help="prefill engines in P/D systems")
    p.add_argument("--rate", type=float, default=8.0, help="requests/s (Poisson)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals")
    p.add_argument("--system-tokens", type=int, default=2000)
    p.add_argument("--tool-tokens", type=int, default=8000)
    p.add_argument("--tool-sigma", type=float, default=0.0,
                   help="lognormal sigma of tool sizes (0: uniform ±50 %%)")
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--agents", type=int, default=4, help="distinct system prompts")
    p.add_argument("--time-scale", type=float, default=1.0, help="simulator time scale")
    p.add_argument("--batched-tokens", type=int, default=2048,
                   help="engines' max_num_batched_tokens (chunked-prefill chunk budget)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--systems", default="agg-rr,agg-load,pd-rr,pd-token")
    p.add_argument("--with-vllm-router", action="store_true")
    p.add_argument("--cpus", default="0-1", help="taskset core list for every process")
    p.add_argument("--out", help="write the results as JSON here")
    ns = p.parse_args(argv)
    systems = tuple(s for s in ns.systems.split(",") if s)
    if ns.with_vllm_router:
        systems += ("vllm-router-pd",)
    return Args(ns.engines, ns.prefill, ns.rate, ns.duration, ns.system_tokens, ns.tool_tokens,
                ns.tool_sigma, ns.output_tokens, ns.agents, ns.time_scale, ns.batched_tokens,
                ns.seed, systems, ns.cpus, ns.out)


def main(argv: Sequence[str] | None = None) -> int:
    a = parse(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvgate-pd-") as tmp:
        for system in a.systems:
            try:
                rows.append(run_system(a, system, Path(tmp)))
            except procs.StartError as exc:
                print(f"{system}: did not start: {exc}", file=sys.stderr)
                continue
            print(json.dumps(rows[-1]), file=sys.stderr)
    print(table(rows))
    if a.out:
        Path(a.out).write_text(json.dumps({"args": asdict(a), "results": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
