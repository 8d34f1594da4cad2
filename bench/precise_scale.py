"""Precise routing at agent scale: multi-turn conversations growing to ~100k tokens.

Issue 28 item 4. Several concurrent sessions, each a conversation that starts from one shared
system prompt and grows by a few hundred tokens per turn (an assistant reply and a new user
message, text from the standard library's sources: code, as an agent's context is) until it
holds ``--max-tokens`` tokens. The same seeded conversations are sent, one system after the
other in the same run, to:

* ``direct`` — the instant fake engine (``bench.upstream``) itself: the latency floor;
* ``kvgate`` — ``kvgate serve --engine FAKE``: the approximate default (pseudo-tokens);
* ``kvgate-precise`` — ``kvgate serve --engine FAKE --kv-events ADDR --tokenizer MODEL_DIR``:
  every chat is rendered by the model's chat template, tokenized, hashed in the engines' block
  layout and looked up in the KV-event index (nothing publishes on ADDR: the fake engine has no
  KV cache, so the index holds the gateway's own speculative entries; the work per request is
  the same).

Each session waits an exponential think time (mean ``--think-ms``) between turns, so the load
is an open, unsaturated one and latency is the gateway's, not a queue's. Per system: the
gateway process's CPU time (all threads) per request, hence req/s per core = 1e6 / µs per
request; latency p50/p99 and the added latency over ``direct`` (percentile differences, and the
percentiles of the per-request differences: the same (session, turn) in both systems); and, from
``/metrics``, the memory the tokenization and hashing caches hold and their hits and evictions.

The gateway runs pinned to core 0; the fake engine and this client share core 1.
Writes ``bench/results/precise-scale-<timestamp>.json``; prints markdown tables.

Run: ``.venv/bin/python -m bench.precise_scale`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import uvloop

from bench import harness, procs, profile, venvs
from bench.harness import RunConfig, fmt, markdown_table
from bench.systems import (
    DEFAULT_TOKENIZER,
    DIRECT,
    KVGATE,
    KVGATE_PRECISE,
    MODEL,
    TOKENIZER_ENV,
    catalogue,
    launched,
)
from bench.tokenization import corpus

RESULTS_DIR = Path("bench/results")
DEFAULT_SYSTEMS = (DIRECT, KVGATE, KVGATE_PRECISE)
#: Characters per token of the standard library's sources under the tiny test model's
#: byte-level BPE (measured: 3.7); used to size turns, the exact count is reported.
CHARS_PER_TOKEN = 3.7
TARGET_RPS_PER_CORE = 50.0
TARGET_ADDED_P99_MS = 5.0
#: /metrics series kept in the JSON and the memory table (substring match).
METRIC_KEYS = ('plugin="tokenizer"', 'chains.stats', "kvgate_kv_index_blocks ",
               'holder="hashes', "process_resident_memory_bytes ")


@dataclass(frozen=True)
class Options:
    """Parsed command line."""

    systems: tuple[str, ...]
    sessions: int
    max_tokens: int
    turn_tokens: int
    reply_tokens: int
    system_tokens: int
    think_ms: float
    seed: int
    trials: int
    model_dir: Path
    out: Path
    #: A system to py-spy during its run ("" for none).
    profile: str = ""


@dataclass
class Sample:
    session: int
    turn: int
    body_bytes: int
    latency_ms: float
    ok: bool


@dataclass
class Conversation:
    """One session's growing chat body: shared system prompt, then turns from its own text."""

    text: str
    pos: int
    parts: bytearray = field(default_factory=bytearray)
    turns: int = 0

    def add(self, role: str, chars: int) -> None:
        content = self.text[self.pos:self.pos + chars]
        self.pos += chars
        sep = b"," if self.parts else b""
        self.parts += sep + json.dumps({"role": role, "content": content}).encode()

    def next_body(self, opts: Options) -> bytes:
        """The next turn's body: the previous one plus (a reply and) a user message."""
        user = opts.turn_tokens - (opts.reply_tokens if self.turns else 0)
        if self.turns:
            self.add("assistant", int(opts.reply_tokens * CHARS_PER_TOKEN))
        self.add("user", int(user * CHARS_PER_TOKEN))
        self.turns += 1
        return (b'{"model":"' + MODEL.encode() + b'","max_tokens":16,"messages":['
                + self.parts + b"]}")


def conversations(opts: Options) -> list[Conversation]:
    """The sessions' conversations (seeded: the same for every system)."""
    text = "".join(corpus())
    rng = random.Random(opts.seed)
    system_chars = int(opts.system_tokens * CHARS_PER_TOKEN)
    span = int(opts.max_tokens * CHARS_PER_TOKEN * 1.1)
    out = []
    for _ in range(opts.sessions):
        start = rng.randrange(system_chars, max(system_chars + 1, len(text) - span))
        conv = Conversation(text, start)
        conv.parts += json.dumps({"role": "system", "content": text[:system_chars]}).encode()
        out.append(conv)
    return out


def turns_per_session(opts: Options) -> int:
    return max(1, (opts.max_tokens - opts.system_tokens) // opts.turn_tokens)


async def _session(http: aiohttp.ClientSession, url: str, index: int, conv: Conversation,
                   opts: Options, out: list[Sample]) -> None:
    rng = random.Random(opts.seed * 1000 + index)
    await asyncio.sleep(rng.uniform(0, opts.think_ms / 1000))
    for turn in range(turns_per_session(opts)):
        body = conv.next_body(opts)
        t0 = time.perf_counter()
        ok = False
        try:
            async with http.post(url, data=body,
                                 headers={"content-type": "application/json"}) as resp:
                await resp.read()
                ok = resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            pass
        out.append(Sample(index, turn, len(body), (time.perf_counter() - t0) * 1e3, ok))
        await asyncio.sleep(rng.expovariate(1000 / opts.think_ms) if opts.think_ms > 0 else 0)


async def drive(base_url: str, opts: Options) -> list[Sample]:
    """Every session's conversation against ``base_url``; the samples."""
    samples: list[Sample] = []
    url = base_url + "/v1/chat/completions"
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        await asyncio.gather(*(_session(http, url, i, conv, opts, samples)
                               for i, conv in enumerate(conversations(opts))))
    return samples


def scrape(base_url: str) -> dict[str, float]:
    """The /metrics series of :data:`METRIC_KEYS` (name with labels -> value)."""
    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith(("#", "kvgate_plugin_hook")):
            continue
        if any(k in line + " " for k in METRIC_KEYS):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def measure(system: str, upstream: str, opts: Options, cfg: RunConfig) -> dict[str, Any]:
    """One system on the whole load: CPU per request, latency, its /metrics."""
    spec = catalogue()[system]
    log = cfg.log_dir / f"{system}.log"
    spy_out = cfg.log_dir / f"{system}-py-spy.collapsed"
    with launched(spec, upstream, harness.SUT_CPU, log, cfg.venv_root) as ep:
        spy = None
        if opts.profile == system and ep.pid:
            argv = profile.py_spy_argv(ep.pid, 3600, spy_out, cfg.venv_root)
            spy = subprocess.Popen(["taskset", "-c", str(harness.LOAD_CPU), *argv],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        cpu0 = procs.tree_cpu_seconds(ep.pid) if ep.pid else 0.0
        t0 = time.monotonic()
        samples = uvloop.run(drive(ep.base_url, opts))
        wall = time.monotonic() - t0
        cpu = (procs.tree_cpu_seconds(ep.pid) - cpu0) if ep.pid else None
        metrics = scrape(ep.base_url) if ep.pid else {}
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait(timeout=120)
    profiled = profile.summarise(spy_out.read_text()) if spy_out.is_file() else None
    good = [s for s in samples if s.ok]
    lat = [s.latency_ms for s in good]
    return {
        "system": system, "requests": len(samples), "errors": len(samples) - len(good),
        "wall_s": wall, "rps": len(good) / wall if wall else None,
        "cpu_s": cpu, "cpu_us_per_req": None if cpu is None or not good else cpu * 1e6 / len(good),
        "p50_ms": percentile(lat, 0.5) if lat else None,
        "p99_ms": percentile(lat, 0.99) if lat else None,
        "mean_body_kib": statistics.fmean(s.body_bytes for s in samples) / 1024,
        "max_body_kib": max(s.body_bytes for s in samples) / 1024,
        "latency": {f"{s.session}/{s.turn}": round(s.latency_ms, 3) for s in good},
        "metrics": metrics, "profile": profiled,
    }


def added(result: dict[str, Any], direct: dict[str, Any] | None) -> dict[str, float | None]:
    """Added latency over ``direct``: percentile differences, and percentiles of the paired
    (same session and turn) differences."""
    if direct is None or result["p50_ms"] is None or direct["p50_ms"] is None:
        return {"added_p50_ms": None, "added_p99_ms": None,
                "paired_p50_ms": None, "paired_p99_ms": None}
    pairs = [v - direct["latency"][k] for k, v in result["latency"].items()
             if k in direct["latency"]]
    return {"added_p50_ms": result["p50_ms"] - direct["p50_ms"],
            "added_p99_ms": result["p99_ms"] - direct["p99_ms"],
            "paired_p50_ms": percentile(pairs, 0.5) if pairs else None,
            "paired_p99_ms": percentile(pairs, 0.99) if pairs else None}


def final_tokens(opts: Options) -> int | None:
    """Exact tokens of session 0's last prompt under the model's tokenizer and template."""
    try:
        from kvgate.plugins.prefix.tokenizer import HfBackend
        backend = HfBackend(opts.model_dir)
    except (OSError, ImportError):
        return None
    conv = conversations(opts)[0]
    body = b""
    for _ in range(turns_per_session(opts)):
        body = conv.next_body(opts)
    messages = json.loads(body)["messages"]
    return len(backend.encode(backend.render_chat(messages, True, {}), False))


def summary_rows(results: Sequence[dict[str, Any]]) -> list[list[str]]:
    direct = next((r for r in results if r["system"] == DIRECT), None)
    rows = []
    for r in results:
        add = added(r, direct) if r["system"] != DIRECT else {}
        cpu = r["cpu_us_per_req"]
        rows.append([
            r["system"], str(r["requests"]), str(r["errors"]), fmt(r["rps"], 1),
            fmt(None if cpu is None else cpu / 1000, 2),
            fmt(None if cpu is None else 1e6 / cpu, 0),
            fmt(r["p50_ms"]), fmt(r["p99_ms"]),
            fmt(add.get("added_p50_ms")), fmt(add.get("added_p99_ms")),
            fmt(add.get("paired_p50_ms")), fmt(add.get("paired_p99_ms")),
        ])
    return rows


def report(opts: Options, results: Sequence[dict[str, Any]], tokens: int | None) -> str:
    header = ["system", "requests", "errors", "req/s", "gateway CPU ms/req", "req/s per core",
              "p50 ms", "p99 ms", "added p50", "added p99", "paired added p50",
              "paired added p99"]
    lines = [f"{opts.sessions} sessions x {turns_per_session(opts)} turns, "
             f"+{opts.turn_tokens} tokens/turn, last prompt {tokens} tokens "
             f"({fmt(results[0]['max_body_kib'], 0)} KiB body, mean "
             f"{fmt(results[0]['mean_body_kib'], 0)} KiB), think {opts.think_ms:g} ms mean\n",
             markdown_table(header, summary_rows(results))]
    for r in results:
        if r["metrics"]:
            lines.append(f"\n{r['system']} /metrics (caches and index):\n")
            lines += [f"- `{k}` {v:g}" for k, v in sorted(r["metrics"].items())]
    precise = next((r for r in results if r["system"] == KVGATE_PRECISE), None)
    direct = next((r for r in results if r["system"] == DIRECT), None)
    if precise is not None and precise["cpu_us_per_req"]:
        per_core = 1e6 / precise["cpu_us_per_req"]
        p99 = added(precise, direct)["added_p99_ms"]
        lines.append(f"\nTargets ({KVGATE_PRECISE}): req/s per core {per_core:.0f} (need >= "
                     f"{TARGET_RPS_PER_CORE:g}) -> {'PASS' if per_core >= 50 else 'FAIL'}; "
                     f"added p99 {fmt(p99)} ms (need <= {TARGET_ADDED_P99_MS:g}) -> "
                     f"{'n/a' if p99 is None else 'PASS' if p99 <= 5 else 'FAIL'}")
    return "\n".join(lines)


def parse_options(argv: Sequence[str] | None = None) -> Options:
    p = argparse.ArgumentParser(prog="python -m bench.precise_scale",
                                description=__doc__.splitlines()[0])
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS))
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=100_000, help="tokens of the last turn")
    p.add_argument("--turn-tokens", type=int, default=400, help="growth per turn, tokens")
    p.add_argument("--reply-tokens", type=int, default=100, help="of which the reply")
    p.add_argument("--system-tokens", type=int, default=2_000, help="shared system prompt")
    p.add_argument("--think-ms", type=float, default=250.0, help="mean think time")
    p.add_argument("--seed", type=int, default=28)
    p.add_argument("--trials", type=int, default=1)
    p.add_argument("--model-dir", type=Path, default=DEFAULT_TOKENIZER)
    p.add_argument("--quick", action="store_true", help="4 sessions to 20k tokens")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--profile", default="", metavar="SYSTEM", help="py-spy SYSTEM's run")
    a = p.parse_args(argv)
    systems = tuple(s for s in a.systems.split(",") if s)
    unknown = [s for s in systems if s not in catalogue()]
    if unknown:
        p.error(f"unknown system(s): {unknown}")
    if a.quick:
        a.sessions, a.max_tokens = 4, 20_000
    out = a.out or RESULTS_DIR / f"precise-scale-{time.strftime('%Y%m%d-%H%M%S')}.json"
    return Options(systems, a.sessions, a.max_tokens, a.turn_tokens, a.reply_tokens,
                   a.system_tokens, a.think_ms, a.seed, max(1, a.trials), a.model_dir, out,
                   a.profile)


def _median_result(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per system, the trial with the median CPU per request (all trials kept in the JSON)."""
    ranked = sorted(runs, key=lambda r: r["cpu_us_per_req"] or 0.0)
    return ranked[len(ranked) // 2]


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_options(argv)
    commit = harness.git_commit()  # the tree the gateways start from (not edits made while it runs)
    os.environ.setdefault(TOKENIZER_ENV, str(opts.model_dir))
    cfg = RunConfig(rate=0, concurrency=opts.sessions, duration_s=0, warmup_s=0, trials=1,
                    venv_root=Path(".kvgate/bench-venvs"),
                    log_dir=opts.out.parent / f"{opts.out.stem}-logs")
    if opts.profile:
        venvs.ensure(venvs.PY_SPY, cfg.venv_root)
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in opts.systems}
    with harness.upstream_running(cfg) as upstream:
        procs.pin_self(harness.LOAD_CPU)
        for trial in range(opts.trials):
            for system in opts.systems[trial % len(opts.systems):] + \
                    opts.systems[:trial % len(opts.systems)]:
                print(f"[precise-scale] trial {trial + 1}: {system} ...", file=sys.stderr,
                      flush=True)
                runs[system].append(measure(system, upstream, opts, cfg))
    results = [_median_result(runs[s]) for s in opts.systems]
    tokens = final_tokens(opts)
    text = report(opts, results, tokens)
    doc = {"benchmark": "precise_scale", "commit": commit,
           "command": shlex.join([sys.executable, "-m", "bench.precise_scale",
                                  *(sys.argv[1:] if argv is None else argv)]),
           "machine": harness.machine_info(), "options": {
               k: str(v) if isinstance(v, Path) else v for k, v in vars(opts).items()},
           "last_prompt_tokens": tokens, "summary": summary_rows(results),
           "runs": {s: [{k: v for k, v in r.items() if k != "latency"} for r in rs]
                    for s, rs in runs.items()}}
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print(text)
    for r in results:
        if r.get("profile"):
            print(f"\n## {r['system']} profile (py-spy, self time)\n")
            print(profile.top_table(r["profile"], rows=25))
            print(f"\n## {r['system']} profile (py-spy, inclusive)\n")
            print(profile.top_table({"top_self": r["profile"]["top_inclusive"]}, rows=25))
    print(f"\nkvgate at {commit}. JSON: {opts.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
