"""The systems of the KV-pressure benchmark, each in front of the same running vLLM engines.

* ``kvgate-default``: exactly what a user runs, ``kvgate serve --engine URL1 --engine URL2``;
* ``kvgate-precise``: ``kvgate serve --engine ... --kv-events ADDR1 --kv-events ADDR2
  --tokenizer MODEL_DIR`` (the engines' own bound KV-event sockets, in ``--engine`` order);
* ``random``: health + model filters and ``max-score-picker`` with no scorer: every engine ties
  at 0 and the picker breaks ties with the scheduler's seeded RNG, a uniform cache-blind spread
  (one mode: nothing in it reads headers). Not ``weighted-random-picker``: with all scores 0 its
  keys ``u ** (1 / 1e-6)`` underflow to 0.0 and the stable sort sends everything to the first
  engine (seen here: 102 of 102 requests on engine-0);
* ``session-pin``: ``session-affinity-scorer`` alone with a load bound no run reaches
  (``load_factor`` 1000): pure rendezvous pinning of each session (headers only);
* ``least-loaded``: health + model filters, ``least-in-flight-scorer`` and ``max-score-picker``
  (ties broken by the seeded RNG): the fewest requests in flight, cache-blind (one mode);
* ``vllm-router-cache_aware``, ``vllm-router-consistent_hash``: the peer router 0.1.17 (venv
  from :mod:`bench.venvs`), optional. ``cache_aware`` routes on the prompt text (one mode: it
  reads no session header); ``consistent_hash`` hashes ``x-session-id`` (the client sends it
  next to ``x-session-affinity`` in the headers mode), so it runs with headers only.

Config-file systems name the engines ``engine-<i>`` like ``kvgate serve --engine`` does, so the
``x-kvgate-engine`` response header means the same in every kvgate run.
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from bench import procs, venvs
from bench.replay_metrics import parse_prometheus

KVGATE = str(Path(sys.executable).parent / "kvgate")
CPUS = "0-1"  # the gateway floats over both cores, like the load generator
HEADERS, NO_HEADERS = "headers", "no-headers"
#: Engine counters read before and after each run (labels summed).
ENGINE_METRICS = ("vllm:request_success_total", "vllm:prompt_tokens_total",
                  "vllm:prompt_tokens_cached_total", "vllm:num_preemptions_total")
#: Effectively no load bound for session-pin: pinning must never move a session.
PIN_LOAD_FACTOR = 1000.0


@dataclass(frozen=True, slots=True)
class Fleet:
    """The running engines: URLs, bound KV-event addresses (same order), model folder."""

    urls: tuple[str, ...]
    kv_events: tuple[str, ...]
    model_dir: Path
    model: str


@dataclass(frozen=True, slots=True)
class System:
    name: str
    modes: tuple[str, ...]
    kind: str  # "serve" (kvgate flags), "config" (kvgate --config), "variant", "vllm-router"


SYSTEMS: Mapping[str, System] = {s.name: s for s in (
    System("kvgate-default", (HEADERS, NO_HEADERS), "serve"),
    System("kvgate-precise", (HEADERS, NO_HEADERS), "serve"),
    System("random", (NO_HEADERS,), "config"),
    System("session-pin", (HEADERS,), "config"),
    System("least-loaded", (NO_HEADERS,), "config"),
    System("vllm-router-cache_aware", (NO_HEADERS,), "vllm-router"),
    System("vllm-router-consistent_hash", (HEADERS,), "vllm-router"),
)}
#: A kvgate system with placement parameters changed: ``<kvgate system>+<param>=<number>...``
#: (e.g. ``kvgate-precise+pressure_floor=0.07``): the quick start of that system as a config
#: file, its ``kv-placement-scorer`` params updated.
VARIANT_SEP = "+"
#: The vllm-router systems' ``--policy``.
VLLM_ROUTER_PREFIX = "vllm-router-"
DEFAULT_SYSTEMS = ("kvgate-default", "kvgate-precise", "random", "session-pin")


def lookup(name: str) -> System:
    """The system called ``name``: one of :data:`SYSTEMS` or a variant (:data:`VARIANT_SEP`);
    KeyError for anything else."""
    if name in SYSTEMS:
        return SYSTEMS[name]
    base, _, _ = name.partition(VARIANT_SEP)
    if base not in ("kvgate-default", "kvgate-precise"):
        raise KeyError(name)
    variant_params(name)  # ValueError when malformed
    return System(name, SYSTEMS[base].modes, "variant")


def variant_params(name: str) -> dict[str, float]:
    """The placement params a variant's name sets (``+key=number`` each)."""
    out: dict[str, float] = {}
    for part in name.split(VARIANT_SEP)[1:]:
        key, eq, value = part.partition("=")
        if not eq or not key:
            raise ValueError(f"{name}: expected +param=number, got {part!r}")
        out[key] = float(value)
    if not out:
        raise ValueError(f"{name}: no parameter after {VARIANT_SEP!r}")
    return out


def variant_config(name: str, fleet: Fleet, port: int) -> dict[str, Any]:
    """The config of a variant: its base system's quick start with the placement params set."""
    from kvgate.middleware.framework.composition.quickstart import (
        QuickStart,
        quick_start_config,
    )
    precise = name.startswith("kvgate-precise")
    qs = QuickStart(engines=fleet.urls, kv_events=fleet.kv_events if precise else (),
                    tokenizer=str(fleet.model_dir) if precise else None)
    data = quick_start_config(qs).model_dump(mode="json", exclude={"source"})
    data["server"].update({"host": "127.0.0.1", "port": port, "log_level": "warning"})
    for plugin in data["plugins"]:
        if plugin["type"] == "kv-placement-scorer":
            plugin["params"] = {**(plugin.get("params") or {}), **variant_params(name)}
    return dict(data)


def serve_argv(name: str, fleet: Fleet, port: int) -> list[str]:
    """``kvgate serve --engine ...`` as a user types it (plus where to listen)."""
    argv = [KVGATE, "serve", *(a for u in fleet.urls for a in ("--engine", u))]
    if name == "kvgate-precise":
        argv += [a for e in fleet.kv_events for a in ("--kv-events", e)]
        argv += ["--tokenizer", str(fleet.model_dir)]
    return [*argv, "--host", "127.0.0.1", "--port", str(port)]


def _profile(plugins: list[dict[str, Any]], weights: Mapping[str, float]) -> dict[str, Any]:
    refs = [{"ref": p["type"], **({"weight": weights[p["type"]]} if p["type"] in weights
                                  else {})} for p in plugins]
    return {"plugins": plugins, "profiles": [{"name": "default", "plugins": refs}]}


def config(name: str, fleet: Fleet, port: int) -> dict[str, Any]:
    """The ``kvgate serve --config`` document of a config system."""
    base = [{"type": "health-filter"}, {"type": "model-filter"}]
    if name == "random":
        profile = _profile([*base, {"type": "max-score-picker"}], {})
    elif name == "least-loaded":
        least = {"type": "least-in-flight-scorer"}
        profile = _profile([*base, least, {"type": "max-score-picker"}],
                           {"least-in-flight-scorer": 1.0})
    elif name == "session-pin":
        pin = {"type": "session-affinity-scorer",
               "params": {"load_factor": PIN_LOAD_FACTOR, "load_slack": PIN_LOAD_FACTOR}}
        profile = _profile([*base, pin, {"type": "max-score-picker"}],
                           {"session-affinity-scorer": 1.0})
    else:
        raise ValueError(f"{name} is not a config system")
    return {"server": {"host": "127.0.0.1", "port": port, "log_level": "warning"},
            "engines": [{"name": f"engine-{i}", "url": u} for i, u in enumerate(fleet.urls)],
            **profile}


def vllm_router_argv(fleet: Fleet, port: int, root: Path, policy: str = "cache_aware"
                     ) -> list[str]:
    program = venvs.bin_path(venvs.VLLM_ROUTER, "vllm-router", root)
    return [str(program), "--worker-urls", *fleet.urls, "--policy", policy,
            "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(procs.free_port()), "--log-level", "warning"]


def argv_for(system: System, fleet: Fleet, port: int, logs: Path, root: Path) -> list[str]:
    if system.kind == "serve":
        return serve_argv(system.name, fleet, port)
    if system.kind in ("config", "variant"):
        path = logs / f"{system.name}.json"
        doc = (config if system.kind == "config" else variant_config)(system.name, fleet, port)
        path.write_text(json.dumps(doc, indent=1))
        return [KVGATE, "serve", "--config", str(path)]
    venvs.ensure(venvs.VLLM_ROUTER, root)
    return vllm_router_argv(fleet, port, root, system.name.removeprefix(VLLM_ROUTER_PREFIX))


@contextlib.contextmanager
def running(system: System, fleet: Fleet, logs: Path, root: Path) -> Iterator[str]:
    """Start ``system`` in front of ``fleet``; yields its base URL once it serves the model."""
    logs.mkdir(parents=True, exist_ok=True)
    port = procs.free_port()
    base = f"http://127.0.0.1:{port}"
    log = logs / f"{system.name}.log"
    with procs.running(argv_for(system, fleet, port, logs, root), CPUS, log) as proc:
        procs.wait_healthy(base + "/health", proc, 120.0, log)
        if system.kind != "vllm-router":
            procs.wait_healthy(base + "/v1/models", proc, 120.0, log, fleet.model.encode())
        time.sleep(1.0)  # KV-event subscriptions connect asynchronously
        yield base


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        body: bytes = resp.read()
        return body.decode()


def engine_counters(url: str) -> dict[str, float]:
    """One engine's request, prompt, cached and preemption counters."""
    return parse_prometheus(_get(url + "/metrics"), ENGINE_METRICS)


def counter_deltas(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """Requests, prefill (computed prompt) tokens and preemptions between two readings."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in ENGINE_METRICS}
    return {"requests": d["vllm:request_success_total"],
            "prefill_tokens": d["vllm:prompt_tokens_total"] - d["vllm:prompt_tokens_cached_total"],
            "preemptions": d["vllm:num_preemptions_total"]}


def kv_blocks(url: str) -> int | None:
    """The engine's KV capacity in blocks (``vllm:cache_config_info`` label ``num_gpu_blocks``)."""
    text = _get(url + "/metrics")
    match = re.search(r'vllm:cache_config_info\{[^}]*num_gpu_blocks="(\d+)"', text)
    return int(match.group(1)) if match else None


def predictions(url: str) -> dict[str, float]:
    """kvgate's ``kvgate_kv_predictions_total`` by ``result`` (engines summed): how its
    predicted cached tokens compared with the engines' reports; {} for other systems."""
    try:
        text = _get(url + "/metrics")
    except OSError:
        return {}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvgate_kv_predictions_total":
                result = sample.labels.get("result", "?")
                out[result] = out.get(result, 0.0) + sample.value
    return out


def health(url: str) -> dict[str, Any]:
    """The system's ``/health`` document ({} when it is not JSON)."""
    try:
        doc = json.loads(_get(url + "/health"))
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}
