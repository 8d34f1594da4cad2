"""Real vLLM CPU engines for the e2e tests: the engine venv and the tiny model are built on first
use (minutes on a fresh machine, reused afterwards).

``vllm_fleet``, ``bind_fleet``, ``small_kv_fleet``: two engines each, started once per session
and shared by every module that asks for them, each module finding them healthy, idle and with
empty prefix caches (tests/e2e/shared_fleet.py); the modules on one of them run back to back
and its engines stop after the last. A module that needs other engine flags or stops its
engines for good starts its own (agent APIs, tracing, P/D, ...)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from kvgate.engines.local.launcher import LocalEngine
from kvgate.engines.local.model import ensure_model
from kvgate.engines.ports import free_port
from tests.e2e.shared_fleet import SharedFleet

KVGATE = str(Path(sys.executable).with_name("kvgate"))


def precise_plugins(events_port: int, model_dir: Path) -> list[dict[str, Any]]:
    """The tokenizer (the model's own), the KV-event listener bound to ``events_port`` and the
    precise prefix-cache producer: what a profile scoring on the fleet's real caches needs."""
    return [
        {"type": "tokenizer",
         "params": {"tokenizer": {"kind": "hf", "model_dir": str(model_dir)}}},
        {"type": "kv-events",
         "params": {"bind": f"tcp://127.0.0.1:{events_port}", "connect": False}},
        {"type": "prefix-cache-producer", "params": {"mode": "precise"}},
    ]


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return ensure_model(0)


@pytest.fixture(scope="session")
def events_port() -> int:
    """Where ``vllm_fleet``'s engines send their KV events: a gateway binds it."""
    return free_port()


#: The fixtures handing out a fleet shared by the session (tests/e2e/shared_fleet.py).
SHARED_FLEETS = ("vllm_fleet", "bind_fleet", "small_kv_fleet")
#: ``small_kv_fleet``'s KV cache per engine: 24 MiB = 48 blocks of 128 tokens, room for a few
#: agent sessions (the sizing of tests/e2e/test_kv_pressure_e2e.py and test_kv_steady_e2e.py).
SMALL_KV_CACHE_BYTES = 24 << 20


@pytest.fixture(scope="session")
def shared_fleets(tiny_model: Path, events_port: int) -> Iterator[dict[str, SharedFleet]]:
    """Each shared fleet, started by the first module that asks for it."""
    fleets = {"vllm_fleet": SharedFleet(tiny_model, 2, events_port=events_port),
              "bind_fleet": SharedFleet(tiny_model, 2),
              "small_kv_fleet": SharedFleet(tiny_model, 2, kv_cache_bytes=SMALL_KV_CACHE_BYTES)}
    try:
        yield fleets
    finally:
        for fleet in fleets.values():
            fleet.stop()


def _uses(item: pytest.Item, fixture: str) -> bool:
    return fixture in getattr(item, "fixturenames", ())


def _lend(fleets: dict[str, SharedFleet], fixture: str,
          request: pytest.FixtureRequest) -> Iterator[list[LocalEngine]]:
    """The shared fleet behind ``fixture``, clean for this module; stopped after the session's
    last module on it (not idle through the modules after it)."""
    fleet = fleets[fixture]
    yield fleet.acquire()
    users = [item.path for item in request.session.items if _uses(item, fixture)]
    if not users or users[-1] == request.path:
        fleet.stop()


@pytest.fixture(scope="module")
def vllm_fleet(shared_fleets: dict[str, SharedFleet],
               request: pytest.FixtureRequest) -> Iterator[list[LocalEngine]]:
    """Two engines with the default KV cache (64 MiB), publishing their KV events to
    ``events_port`` (``precise_plugins``)."""
    yield from _lend(shared_fleets, "vllm_fleet", request)


@pytest.fixture(scope="module")
def bind_fleet(shared_fleets: dict[str, SharedFleet],
               request: pytest.FixtureRequest) -> Iterator[list[LocalEngine]]:
    """Two engines with the default KV cache, each binding its own KV-event socket with vLLM's
    default (empty) topic (``LocalEngine.kv_events``), as deployed."""
    yield from _lend(shared_fleets, "bind_fleet", request)


@pytest.fixture(scope="module")
def small_kv_fleet(shared_fleets: dict[str, SharedFleet],
                   request: pytest.FixtureRequest) -> Iterator[list[LocalEngine]]:
    """Two engines binding their own KV-event sockets, with ``SMALL_KV_CACHE_BYTES`` of KV
    each: a few agent sessions fill them."""
    yield from _lend(shared_fleets, "small_kv_fleet", request)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules on a shared fleet run back to back, where the first of them would: its
    engines are not left idle (memory, a core's background work) under the modules between
    them, which start engines of their own. Every other test keeps its place and order."""
    for fixture in SHARED_FLEETS:
        users = {item.path for item in items if _uses(item, fixture)}
        first = next((i for i, item in enumerate(items) if item.path in users), None)
        if first is not None:
            rest = items[first:]
            items[first:] = ([i for i in rest if i.path in users]
                             + [i for i in rest if i.path not in users])


@contextlib.contextmanager
def kvgate_serve(config: dict[str, Any], tmp: Path) -> Iterator[str]:
    """``kvgate serve --config`` as a real process; yields its base URL."""
    port = free_port()
    config = {**config, "server": {**config.get("server", {}), "port": port}}
    path = tmp / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    log = (tmp / "gateway.log").open("wb")
    proc = subprocess.Popen([KVGATE, "serve", "--config", str(path)], stdout=log,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120  # a readiness wait: a loaded machine starts slowly
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError((tmp / "gateway.log").read_text()[-3000:])
            time.sleep(0.2)
        yield url
    finally:  # gone before the next gateway binds what this one bound (the KV-event port)
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(15)
        log.close()
