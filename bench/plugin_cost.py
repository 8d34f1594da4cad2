"""What each plugin of the quick-start default costs per request, in CPU time (µs).

:mod:`bench.overhead` measures the whole gateway against the Rust routers; this benchmark splits
kvgate's own figure by plugin, so that work on the per-request cost goes where the cost is.

How. The fake engine (:mod:`bench.upstream`) runs on the load core. For each variant a worker
process on the gateway core builds the config ``kvgate serve --engine URL`` builds (the default
preset), or that config with plugins taken out, and drives the gateway's ASGI app directly:
``--requests`` chat requests of ~``--body-size`` bytes, ``--concurrency`` at a time, after
``--warmup`` untimed ones. The body is the same each time (one session's repeated prompt: the
prefix caches hit, as in :mod:`bench.overhead`). The worker reports its own CPU time per request.
The access log goes to a file through the handler ``kvgate serve`` installs, as in production.
No HTTP server runs, so its cost, the same in every variant, is left out; the absolute figures
are therefore below :mod:`bench.overhead`'s, and they include the in-process driver's own work
(a watcher task per request, which the HTTP server replaces by a callback). The differences
between variants are the plugins' costs.

Variants, all in each trial in a rotated order; the table gives medians:

* ``default``: the preset as the quick start runs it.
* ``without <plugin>``: that plugin taken out of the plugin list and the profiles. Parameters of
  other plugins that name it are dropped, so their defaults apply: without the token-load
  scorer, the placement scorer reads the engines' in-flight tokens instead. A variant the
  config validation refuses is reported and skipped. The difference also counts what the
  plugin makes others do: without the tokenizer, the prefix-cache producer has no token ids to
  hash and match.
* ``routing off``: the profile's filters and picker only, with no scorer, producer or hook.

``--engines N`` puts N fake engines behind the gateway (one process each, on the load core):
what grows with the fleet (snapshots, matches per engine, scores) then shows.

``--hooks``: one more run of the default with every hook call timed
(``server.hook_timing_every: 1``), and each plugin hook's time per request from the gateway's
own ``kvgate_plugin_hook_duration_seconds`` (its sums over the timed requests). Timing every
call costs a few µs per request itself, so this run's CPU figure is not compared with the
others; the hooks' shares are what it is for (the scheduler's filter, score and pick calls are
hooks too).

Run: ``.venv/bin/python -m bench.plugin_cost`` (about 3 minutes with the defaults). It writes
``bench/results/plugin-cost-<timestamp>.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench import harness, procs
from bench.loadgen import make_body

RESULTS_DIR = Path("bench/results")
DEFAULT = "default"
#: The hook-time histogram's sum series in ``/metrics`` (labels: hook, plugin).
HOOK_SUM = "kvgate_plugin_hook_duration_seconds_sum{"
ROUTING_OFF = "routing off"
#: The worker's result line on stdout starts with this (logs may precede it).
RESULT_MARK = "PLUGIN-COST "
#: Attempts (0.1 s apart) for the first request, while the pool discovers the engine's models.
READY_TRIES = 100
MODEL = "bench-model"


# -- variants (pure) -------------------------------------------------------------------------
def plugin_name(entry: Mapping[str, Any]) -> str:
    """A plugin entry's name: ``name``, else its ``type``."""
    return str(entry.get("name", entry["type"]))


def without(data: Mapping[str, Any], name: str) -> dict[str, Any]:
    """``data`` with plugin ``name`` taken out of the plugins and profiles; other plugins'
    parameters whose value is that name are dropped."""
    out = copy.deepcopy(dict(data))
    plugins = []
    for entry in out["plugins"]:
        if plugin_name(entry) == name:
            continue
        if "params" in entry:
            entry["params"] = {k: v for k, v in entry["params"].items() if v != name}
        plugins.append(entry)
    out["plugins"] = plugins
    for profile in out.get("profiles", []):
        profile["plugins"] = [ref for ref in profile["plugins"] if ref["ref"] != name]
    return out


def routing_off(data: Mapping[str, Any], keep: set[str]) -> dict[str, Any]:
    """``data`` with only the profile entries named in ``keep`` (its filters and picker) and
    their plugins."""
    out = copy.deepcopy(dict(data))
    for profile in out.get("profiles", []):
        profile["plugins"] = [ref for ref in profile["plugins"] if ref["ref"] in keep]
    out["plugins"] = [entry for entry in out["plugins"] if plugin_name(entry) in keep]
    return out


def variants(data: Mapping[str, Any], keep: set[str]) -> dict[str, dict[str, Any]]:
    """The default, one variant per plugin taken out, and routing off."""
    out = {DEFAULT: copy.deepcopy(dict(data))}
    for entry in data["plugins"]:
        out[f"without {plugin_name(entry)}"] = without(data, plugin_name(entry))
    out[ROUTING_OFF] = routing_off(data, keep)
    return out


def rotated(names: Sequence[str], trial: int) -> list[str]:
    """``names`` rotated by ``trial`` (slow drift of the machine favours no variant)."""
    k = trial % len(names) if names else 0
    return [*names[k:], *names[:k]]


def summarise(samples: Mapping[str, Sequence[float]]) -> dict[str, dict[str, float]]:
    """Median CPU µs per request per variant, and its difference to the default."""
    medians = {name: statistics.median(values) for name, values in samples.items() if values}
    base = medians.get(DEFAULT)
    return {name: {"cpu_us_per_request": value,
                   "minus_default_us": (value - base) if base is not None else float("nan")}
            for name, value in medians.items()}


def hook_sums(metrics: str) -> dict[str, float]:
    """``plugin hook`` -> seconds, from the hook-time histogram's sums in ``metrics`` (the text
    ``/metrics`` serves)."""
    out: dict[str, float] = {}
    for line in metrics.splitlines():
        if not line.startswith(HOOK_SUM):
            continue
        labels, _, value = line[len(HOOK_SUM):].rpartition("} ")
        pairs = dict(part.split("=", 1) for part in labels.split(","))
        out[f"{pairs['plugin'].strip(chr(34))} {pairs['hook'].strip(chr(34))}"] = float(value)
    return out


def per_hook_us(before: Mapping[str, float], after: Mapping[str, float],
                requests: int) -> dict[str, float]:
    """Each hook's µs per request between two :func:`hook_sums`, largest first."""
    spent = {k: (v - before.get(k, 0.0)) / requests * 1e6 for k, v in after.items()}
    return dict(sorted(spent.items(), key=lambda kv: -kv[1]))


def hooks_table(hooks: Mapping[str, float], cpu_us: float) -> str:
    """The ``--hooks`` table: µs per request of each hook, and their total."""
    rows = [[name, f"{us:.2f}"] for name, us in hooks.items()]
    rows.append([f"all hooks (of {cpu_us:.1f} µs/request with every call timed)",
                 f"{sum(hooks.values()):.2f}"])
    return harness.markdown_table(["plugin hook", "µs/request"], rows)


def table(summary: Mapping[str, Mapping[str, float]], skipped: Mapping[str, str]) -> str:
    """The markdown table: each variant's median, and what it saves against the default."""
    rows = [[name, f"{row['cpu_us_per_request']:.1f}",
             "-" if name == DEFAULT else f"{0.0 - row['minus_default_us']:+.1f}"]
            for name, row in summary.items()]
    rows += [[name, "skipped", reason] for name, reason in skipped.items()]
    return harness.markdown_table(["variant", "CPU µs/request", "saved vs default (µs)"], rows)


# -- config ------------------------------------------------------------------------------------
def preset_data(upstreams: Sequence[str]) -> dict[str, Any]:
    """The config data ``kvgate serve --engine URL ...`` builds (the default preset)."""
    from kvgate.middleware.framework.composition.quickstart import (
        DEFAULT_PRESET,
        QuickStart,
        presets,
    )

    qs = QuickStart(engines=tuple(upstreams))
    return {"engines": qs.engine_list(), **presets()[DEFAULT_PRESET](qs)}


def profile_keep(data: Mapping[str, Any]) -> set[str]:
    """The default profile's filters and picker (by their plugins' classes)."""
    from kvgate.middleware.framework.composition.registry import Registry
    from kvgate.middleware.framework.plugin import Filter, Picker

    registry = Registry.from_entry_points()
    types = {plugin_name(entry): entry["type"] for entry in data["plugins"]}
    keep = set()
    for profile in data.get("profiles", []):
        for ref in profile["plugins"]:
            cls = registry.plugin_class(types.get(ref["ref"], ""))
            if cls is not None and issubclass(cls, Filter | Picker):
                keep.add(ref["ref"])
    return keep


def refusal(data: Mapping[str, Any]) -> str | None:
    """Why the config validation refuses ``data`` (None: it accepts it)."""
    from kvgate.middleware.framework.composition.config import parse_config
    from kvgate.middleware.framework.composition.pipeline import build_pipeline
    from kvgate.middleware.framework.composition.registry import Registry
    from kvgate.middleware.framework.errors import ConfigError

    try:
        build_pipeline(parse_config(dict(data), "<plugin-cost>"), Registry.from_entry_points())
    except ConfigError as err:
        return str(err).splitlines()[0]
    return None


# -- the worker (one variant, one process) ---------------------------------------------------
async def _one(app: Any, scope: Mapping[str, Any], body: bytes) -> int:
    """One request into the ASGI app; its status."""
    sent = False
    done = asyncio.Event()
    status = 0

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: Mapping[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = int(message["status"])

    await app(dict(scope), receive, send)
    done.set()
    return status


def _scope(body: bytes) -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
            "scheme": "http", "path": "/v1/chat/completions",
            "raw_path": b"/v1/chat/completions", "query_string": b"", "root_path": "",
            "headers": [(b"host", b"kvgate"), (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode())],
            "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1), "state": {}}


async def _batch(app: Any, scope: Mapping[str, Any], body: bytes, requests: int,
                 concurrency: int) -> None:
    per_worker, extra = divmod(requests, concurrency)

    async def worker(n: int) -> None:
        for _ in range(n):
            status = await _one(app, scope, body)
            if status != 200:
                raise RuntimeError(f"the gateway answered {status}")

    await asyncio.gather(*(worker(per_worker + (i < extra)) for i in range(concurrency)))


async def _measure(data: dict[str, Any], body: bytes, requests: int, warmup: int,
                   concurrency: int) -> tuple[float, dict[str, float]]:
    """CPU µs per request of this process over ``requests`` (after ``warmup``), and the
    hooks' µs per request over them from the hook-time histogram (whole only when every hook
    call is timed, as ``--hooks`` runs it; otherwise the sampled calls' share)."""
    from kvgate.middleware.app import create_app
    from kvgate.middleware.framework.composition.config import parse_config
    from kvgate.middleware.process import tune_gc

    app = create_app(parse_config(data, "<plugin-cost>"))
    tune_gc()  # as ``kvgate serve`` does once its app is built
    scope = _scope(body)
    async with app.running():
        for _ in range(READY_TRIES):
            if await _one(app, scope, body) == 200:
                break
            await asyncio.sleep(0.1)
        else:
            raise RuntimeError("the gateway never answered 200 (engine not discovered?)")
        await _batch(app, scope, body, warmup, concurrency)
        before = hook_sums(app.metrics.render().decode())
        start = time.process_time()
        await _batch(app, scope, body, requests, concurrency)
        us = (time.process_time() - start) / requests * 1e6
        return us, per_hook_us(before, hook_sums(app.metrics.render().decode()), requests)


def run_worker(args: argparse.Namespace) -> int:
    """``--worker``: measure the variant whose config data is in ``args.worker`` (a file)."""
    import uvloop

    from kvgate.middleware.framework.composition.config import AccessLogConfig
    from kvgate.middleware.process import configure_logging

    data = json.loads(Path(args.worker).read_text())
    with tempfile.TemporaryDirectory(prefix="kvgate-plugin-cost-") as tmp:
        data.setdefault("server", {})["routing_state_dir"] = tmp
        if args.hooks:
            data["server"]["hook_timing_every"] = 1
        configure_logging("WARNING", AccessLogConfig(path=str(Path(tmp) / "access.log")))
        body = make_body(args.body_size, False, MODEL)
        us, hooks = uvloop.run(
            _measure(data, body, args.requests, args.warmup, args.concurrency))
    print(RESULT_MARK + json.dumps({"cpu_us_per_request": us, "hooks": hooks}), flush=True)
    return 0


# -- the parent ------------------------------------------------------------------------------
def _worker_argv(config_path: Path, args: argparse.Namespace) -> list[str]:
    return [sys.executable, "-m", "bench.plugin_cost", "--worker", str(config_path),
            "--requests", str(args.requests), "--warmup", str(args.warmup),
            "--concurrency", str(args.concurrency), "--body-size", str(args.body_size)]


def _run_worker(config_path: Path, args: argparse.Namespace, hooks: bool) -> dict[str, Any]:
    """Run one worker on the gateway core; its result (``hooks``: every hook call timed)."""
    argv = ["taskset", "-c", str(harness.SUT_CPU), *_worker_argv(config_path, args),
            *(["--hooks"] if hooks else [])]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout_s,
                          check=False)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith(RESULT_MARK)]
    if done.returncode != 0 or not lines:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-8:])
        raise RuntimeError(f"worker for {config_path.name} failed ({done.returncode}):\n{tail}")
    result: dict[str, Any] = json.loads(lines[-1][len(RESULT_MARK):])
    return result


def measure_variant(config_path: Path, args: argparse.Namespace) -> float:
    """One worker's CPU µs per request (hooks not timed)."""
    return float(_run_worker(config_path, args, hooks=False)["cpu_us_per_request"])


def run(args: argparse.Namespace, upstreams: Sequence[str], work: Path) -> dict[str, Any]:
    """Every variant ``args.trials`` times (rotated order); the result document."""
    data = preset_data(upstreams)
    skipped: dict[str, str] = {}
    paths: dict[str, Path] = {}
    for name, variant in variants(data, profile_keep(data)).items():
        if args.variants and name not in args.variants:
            continue
        reason = refusal(variant)
        if reason is not None:
            skipped[name] = reason
            continue
        paths[name] = work / f"variant-{len(paths)}.json"
        paths[name].write_text(json.dumps(variant))
    samples: dict[str, list[float]] = {name: [] for name in paths}
    for trial in range(args.trials):
        for name in rotated(list(paths), trial):
            samples[name].append(measure_variant(paths[name], args))
            print(f"trial {trial + 1}/{args.trials} {name}: "
                  f"{samples[name][-1]:.1f} µs/request", file=sys.stderr, flush=True)
    summary = summarise(samples)
    text = table(summary, skipped)
    timed: dict[str, Any] | None = None
    if args.hooks:
        path = work / "hooks.json"
        path.write_text(json.dumps(data))
        timed = _run_worker(path, args, hooks=True)
        text += "\n\n" + hooks_table(timed["hooks"], timed["cpu_us_per_request"])
    return {"benchmark": "plugin_cost", "machine": harness.machine_info(),
            "options": {k: v for k, v in vars(args).items() if k not in ("worker", "out")},
            "preset": data, "samples": samples, "summary": summary, "skipped": skipped,
            "hooks": timed, "table": text}


def start_upstream(stack: contextlib.ExitStack, log: Path) -> str:
    """One fake engine on the load core, stopped with ``stack``; its base URL."""
    port = procs.free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "bench.upstream", "--host", "127.0.0.1", "--port", str(port)]
    proc = stack.enter_context(procs.running(argv, harness.LOAD_CPU, log))
    procs.wait_healthy(url + "/health", proc, 30.0, log)
    return url


def _names(text: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in text.split(",") if n.strip())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.plugin_cost",
        description="CPU per request of each plugin of the quick-start default (ablation)")
    parser.add_argument("--requests", type=int, default=4000, help="timed requests per worker")
    parser.add_argument("--warmup", type=int, default=400, help="untimed requests first")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    parser.add_argument("--body-size", type=int, default=1024, help="chat body size [bytes]")
    parser.add_argument("--engines", type=int, default=1,
                        help="fake engines (one process each, on the load core)")
    parser.add_argument("--trials", type=int, default=3, help="runs of every variant")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="per worker")
    parser.add_argument("--variants", type=_names, default=(),
                        help="comma-separated variants to run (default: all), e.g. "
                             "'default,routing off'")
    parser.add_argument("--hooks", action="store_true",
                        help="also time every hook call of the default (one more run)")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: timestamped)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker is not None:
        return run_worker(args)
    if min(args.requests, args.concurrency, args.trials, args.body_size, args.engines) < 1 \
            or args.warmup < 0:
        raise SystemExit("--requests, --concurrency, --trials, --body-size and --engines "
                         "must be >= 1")
    return with_engines("plugin-cost", args.engines, args.out,
                        lambda upstreams, work: run(args, upstreams, work))


def with_engines(name: str, engines: int, out: Path | None,
                 measure: Callable[[list[str], Path], dict[str, Any]]) -> int:
    """``measure`` (given the fake engines' URLs and a scratch folder) with ``engines`` fake
    engines running; its document written to ``out`` (default: timestamped under
    ``bench/results/<name>-...``) and its ``table`` printed."""
    out = out or RESULTS_DIR / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    with tempfile.TemporaryDirectory(prefix=f"kvgate-{name}-") as tmp, \
            contextlib.ExitStack() as stack:
        work = Path(tmp)
        upstreams = [start_upstream(stack, work / f"upstream-{i}.log") for i in range(engines)]
        doc = measure(upstreams, work)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print(doc["table"])
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
