"""The replay benchmark's systems: a fleet of simulated engines and the routers in front of it.

Every system gets a fresh fleet (caches start empty): ``N`` ``python -m engines.sim`` processes
named ``e0..e{N-1}``. For the kvgate policies that read KV events the engines connect to the
gateway's bound SUB socket (topic ``kv@e<i>@sim-model``); the others run without events.

kvgate runs as ``kvgate serve --config <generated JSON>`` (JSON is YAML); the peers run from the
venvs of :mod:`bench.venvs` with every engine as a worker URL.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import procs, venvs
from bench.replay_metrics import parse_prometheus

MODEL = "sim-model"
CPUS = "0-1"  # everything floats over both cores: the fleet needs more than one
#: Seconds between a kvgate that binds the KV-event socket being ready and the first request:
#: the engines connect to it with ZMQ's reconnect interval (100 ms), and what they publish
#: before their connection and subscription are up is dropped. In 3,000-request conversation
#: replays whose first request left 64 ms after the bind, kvgate_kv_index_orphan_blocks_total
#: was 68-191 (early sessions' later blocks, whose parents' events were lost; their next turns
#: were placed blind); in those whose first request left 0.3 s after it, and in a rerun
#: with this wait (replay-20261127-023608.json), 0.
EVENTS_SETTLE_S = 1.0
PROMPT_METRICS = ("vllm:prompt_tokens_total", "vllm:prompt_tokens_cached_total",
                  "vllm:num_preemptions_total")


@dataclass(frozen=True, slots=True)
class FleetSpec:
    """Simulated engines: count, KV block size (tokens), capacity (blocks), time scale."""

    engines: int = 8
    block_size: int = 512
    capacity_blocks: int = 4096
    time_scale: float = 0.1

    @property
    def max_model_len(self) -> int:
        """The whole cache: the traces' longest prompts exceed 128k tokens."""
        return self.block_size * self.capacity_blocks


@dataclass(frozen=True, slots=True)
class SystemSpec:
    """One system under test: ``kind`` kvgate/sglang-router/vllm-router and its policy."""

    name: str
    kind: str
    policy: str
    #: kvgate replicas sharing state through Redis (policy ``quickstart-connect``: engines bind
    #: their KV-event sockets, every replica connects; bench/replicas.py)
    replicas: int = 1

    @property
    def text_prompt(self) -> bool:
        """Peers get text prompts: sglang-router 0.3.2 rejects token-id prompts, and both peers'
        ``cache_aware`` trees match text. The engines tokenize the text to the same ids."""
        return self.kind != "kvgate"

    @property
    def uses_events(self) -> bool:
        return self.kind == "kvgate" and self.policy in {
            "prefix", "v1-default", "v1-default-noguard", "quickstart", "quickstart-connect"}

    @property
    def engines_bind(self) -> bool:
        """Each engine binds its own KV-event socket and the gateways connect to it."""
        return self.policy.startswith("quickstart-connect")

    @property
    def quick_start(self) -> bool:
        """Run as users run the default: ``kvgate serve --engine URL ...`` flags, no config."""
        return self.kind == "kvgate" and self.policy.startswith("quickstart")


SYSTEMS: Mapping[str, SystemSpec] = {s.name: s for s in (
    SystemSpec("kvgate-round-robin", "kvgate", "round-robin"),
    SystemSpec("kvgate-least-load", "kvgate", "least-load"),
    SystemSpec("kvgate-session", "kvgate", "session"),
    SystemSpec("kvgate-prefix", "kvgate", "prefix"),
    # the default: `kvgate serve --engine ... --kv-events-bind ...` (capacity-aware placement,
    # precise from the engines' KV events) and without events (approximate: its own record)
    SystemSpec("kvgate-default", "kvgate", "quickstart"),
    SystemSpec("kvgate-default-approx", "kvgate", "quickstart-approx"),
    # the default behind a round-robin load balancer: 1 or 3 replicas sharing one Redis
    SystemSpec("kvgate-default-1r", "kvgate", "quickstart-connect"),
    SystemSpec("kvgate-default-3r", "kvgate", "quickstart-connect", replicas=3),
    # the same without KV events (each replica's approximate record + the shared pins)
    SystemSpec("kvgate-default-approx-1r", "kvgate", "quickstart-connect-approx"),
    SystemSpec("kvgate-default-approx-3r", "kvgate", "quickstart-connect-approx", replicas=3),
    # the first tranche's documented profile (prefix 3 / load 2 / session 1 + imbalance filter)
    # and the same without its token-imbalance-filter
    SystemSpec("kvgate-v1-default", "kvgate", "v1-default"),
    SystemSpec("kvgate-v1-default-noguard", "kvgate", "v1-default-noguard"),
    SystemSpec("sglang-router-cache_aware", "sglang-router", "cache_aware"),
    SystemSpec("vllm-router-consistent_hash", "vllm-router", "consistent_hash"),
    SystemSpec("vllm-router-cache_aware", "vllm-router", "cache_aware"),
)}


def _plugin(kind: str, **params: Any) -> dict[str, Any]:
    return {"type": kind, "params": params} if params else {"type": kind}


@dataclass(frozen=True, slots=True)
class DefaultTuning:
    """Overrides for tuning runs: the first tranche's scorer weights (prefix, load, session)
    and token-imbalance-filter params (None: as in docs/routing.md), and ``placement``: params
    merged into the quick start's ``kv-placement-scorer`` (None: the shipped defaults)."""

    weights: tuple[float, float, float] = (3.0, 2.0, 1.0)
    guard: Mapping[str, float] | None = None
    placement: Mapping[str, Any] | None = None


def _compose(
    producers: list[dict[str, Any]], filters: list[dict[str, Any]],
    scorers: list[tuple[dict[str, Any], float]], picker: str = "max-score-picker",
) -> tuple[list[Any], list[Any]]:
    """(plugins, profile refs): producers, health and model filters, ``filters``, weighted
    ``scorers`` and ``picker``; every instance is named after its type. Scorers are declared
    before ``filters`` (the token-imbalance-filter reads the token-load-scorer)."""
    base = [_plugin("health-filter"), _plugin("model-filter")]
    plugins = [*producers, *base, *(s for s, _ in scorers), *filters, _plugin(picker)]
    refs = [{"ref": f["type"]} for f in [*base, *filters]]
    refs += [{"ref": s["type"], "weight": w} for s, w in scorers]
    return plugins, [*refs, {"ref": picker}]


def _policy_plugins(
    policy: str, events: str, block_size: int, tuning: DefaultTuning | None = None
) -> tuple[list[Any], list[Any]]:
    """(plugins, profile refs) of a kvgate policy; ``tuning`` changes ``default``."""
    tok = _plugin("tokenizer")  # token-id prompts pass straight through
    precise = [tok, _plugin("kv-events", bind=events, connect=False, default_block_size=block_size),
               _plugin("prefix-cache-producer", mode="precise")]
    if policy == "round-robin":
        return _compose([], [], [], "round-robin-picker")
    if policy == "least-load":
        return _compose([tok], [], [(_plugin("token-load-scorer"), 1.0)])
    if policy == "session":
        return _compose([], [], [(_plugin("session-affinity-scorer"), 1.0)])
    if policy == "prefix":
        return _compose(precise, [], [(_plugin("prefix-cache-scorer"), 1.0)])
    if policy in {"v1-default", "v1-default-noguard"}:  # the first tranche's default
        tune = tuning or DefaultTuning()
        prefix, load, session = tune.weights
        guard = [_plugin("token-imbalance-filter", **(tune.guard or {}))]
        return _compose(
            precise, guard if policy == "v1-default" else [],
            [(_plugin("prefix-cache-scorer"), prefix), (_plugin("token-load-scorer"), load),
             (_plugin("session-affinity-scorer"), session)])
    raise ValueError(f"unknown kvgate policy {policy!r}")


def kvgate_config(
    policy: str, urls: list[str], port: int, events: str, block_size: int,
    tuning: DefaultTuning | None = None,
) -> dict[str, Any]:
    """The ``kvgate serve --config`` document of ``policy`` over engines ``e0..``."""
    plugins, refs = _policy_plugins(policy, events, block_size, tuning)
    return {
        "server": {"host": "127.0.0.1", "port": port, "log_level": "warning"},
        "pool": {"health_interval_s": 1.0, "metrics_interval_s": 1.0},
        "engines": [{"name": f"engine-{i}", "url": u, "models": [MODEL]}
                    for i, u in enumerate(urls)],
        "plugins": plugins,
        "profiles": [{"name": "default", "plugins": refs}],
    }


def tuned_quick_start(
    urls: list[str], port: int, events: str | None, placement: Mapping[str, Any]
) -> dict[str, Any]:
    """The config ``kvgate serve --engine URL ... [--kv-events-bind E]`` builds, with
    ``placement`` merged into the ``kv-placement-scorer``'s params (tuning runs)."""
    from kvgate.middleware.framework.composition.quickstart import QuickStart, quick_start_config

    qs = QuickStart(engines=tuple(urls), kv_events_bind=events,
                    server={"host": "127.0.0.1", "port": port})
    data: dict[str, Any] = quick_start_config(qs).model_dump(mode="json", exclude={"source"})
    for plugin in data["plugins"]:
        if plugin["type"] == "kv-placement-scorer":
            plugin["params"] = {**(plugin.get("params") or {}), **placement}
    return data


def sim_argv(i: int, port: int, fleet: FleetSpec, events: str | list[str] | None) -> list[str]:
    """Command line of engine ``e<i>``."""
    argv = [sys.executable, "-m", "kvgate.engines.sim", "--port", str(port),
            "--engine-id", f"engine-{i}",
            "--model", MODEL, "--block-size", str(fleet.block_size),
            "--capacity-blocks", str(fleet.capacity_blocks),
            "--max-model-len", str(fleet.max_model_len), "--time-scale", str(fleet.time_scale),
            "--seed", str(i)]
    if isinstance(events, list):
        events = events[i]
    return argv + (["--kv-events", events] if events else [])


def router_argv(spec: SystemSpec, urls: list[str], port: int, root: Path) -> list[str]:
    """Command line of a peer router in front of ``urls``."""
    common = ["--worker-urls", *urls, "--policy", spec.policy, "--host", "127.0.0.1",
              "--port", str(port), "--prometheus-host", "127.0.0.1",
              "--prometheus-port", str(procs.free_port())]
    if spec.kind == "sglang-router":
        python = venvs.bin_path(venvs.SGLANG_ROUTER, "python", root)
        return [str(python), "-m", "sglang_router.launch_router", *common, "--log-level", "warn"]
    program = venvs.bin_path(venvs.VLLM_ROUTER, "vllm-router", root)
    return [str(program), *common, "--log-level", "warning"]


@dataclass(frozen=True, slots=True)
class Running:
    """A started system: where to send load and its engines' URLs."""

    base_url: str
    engine_urls: list[str]
    #: every replica's base URL (the first is ``base_url``)
    base_urls: tuple[str, ...] = ()


@contextlib.contextmanager
def fleet_running(
    fleet: FleetSpec, events: str | list[str] | None, logs: Path
) -> Iterator[list[str]]:
    """Start the engines; yield their URLs once all are healthy; stop them on exit."""
    with contextlib.ExitStack() as stack:
        urls: list[str] = []
        started = []
        for i in range(fleet.engines):
            port = procs.free_port()
            log = logs / f"e{i}.log"
            proc = stack.enter_context(procs.running(sim_argv(i, port, fleet, events), CPUS, log))
            urls.append(f"http://127.0.0.1:{port}")
            started.append((proc, log))
        for url, (proc, log) in zip(urls, started, strict=True):
            procs.wait_healthy(url + "/health", proc, 60.0, log)
        yield urls


@contextlib.contextmanager
def system_running(
    spec: SystemSpec, fleet: FleetSpec, logs: Path, venv_root: Path,
    tuning: DefaultTuning | None = None,
) -> Iterator[Running]:
    """A fresh fleet and ``spec`` in front of it."""
    if spec.engines_bind:
        yield from _replicas_system(spec, fleet, logs)
        return
    events = f"tcp://127.0.0.1:{procs.free_port()}" if spec.uses_events else None
    with fleet_running(fleet, events, logs) as urls:
        port = procs.free_port()
        base = f"http://127.0.0.1:{port}"
        if spec.quick_start and tuning is not None and tuning.placement is not None:
            config = logs / "kvgate.json"
            config.write_text(json.dumps(
                tuned_quick_start(urls, port, events, tuning.placement), indent=1))
            argv = [str(Path(sys.executable).parent / "kvgate"), "serve", "--config", str(config)]
        elif spec.quick_start:
            argv = [str(Path(sys.executable).parent / "kvgate"), "serve", "--port", str(port)]
            argv += [a for u in urls for a in ("--engine", u)]
            argv += ["--kv-events-bind", events] if events else []
        elif spec.kind == "kvgate":
            config = logs / "kvgate.json"
            config.write_text(json.dumps(
                kvgate_config(spec.policy, urls, port, events or "", fleet.block_size, tuning),
                indent=1))
            argv = [str(Path(sys.executable).parent / "kvgate"), "serve", "--config", str(config)]
        else:
            argv = router_argv(spec, urls, port, venv_root)
        log = logs / f"{spec.kind}.log"
        with procs.running(argv, CPUS, log) as proc:
            procs.wait_healthy(base + "/health", proc, 120.0, log)
            if spec.kind == "kvgate":
                procs.wait_healthy(base + "/v1/models", proc, 120.0, log, MODEL.encode())
            if events:
                time.sleep(EVENTS_SETTLE_S)
            yield Running(base, urls)


def _replicas_system(spec: SystemSpec, fleet: FleetSpec, logs: Path) -> Iterator[Running]:
    """Engines binding ``tcp://*:PORT`` each, ``spec.replicas`` gateways connecting to all."""
    from bench.replicas import replicas_running

    events = [f"tcp://*:{procs.free_port()}" for _ in range(fleet.engines)]
    if not spec.uses_events:
        events = []
    with fleet_running(fleet, events or None, logs) as urls, \
            replicas_running(spec.replicas, urls, events, logs, MODEL) as bases:
        yield Running(bases[0], urls, tuple(bases))


def gateway_counters(url: str) -> dict[str, float]:
    """kvgate's KV-event and index counters (``kvgate_kv_*``, labels summed); {} for peers."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
    except OSError:
        return {}
    names = sorted({line.split("{", 1)[0].split(" ", 1)[0] for line in text.splitlines()
                    if line.startswith("kvgate_kv_")})
    return parse_prometheus(text, names)


def engine_counters(url: str) -> dict[str, float]:
    """The prompt/cached token and preemption counters of one engine's ``/metrics``."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        return parse_prometheus(resp.read().decode(), PROMPT_METRICS)
