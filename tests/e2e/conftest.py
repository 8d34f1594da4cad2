"""Real vLLM CPU engines for the e2e tests: the engine venv and the tiny model are built on first
use (minutes on a fresh machine, reused afterwards); two engines start once per module."""

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

from kvgate.engines.local.fleet import start_fleet
from kvgate.engines.local.launcher import LocalEngine, stop
from kvgate.engines.local.model import ensure_model
from kvgate.engines.ports import free_port

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


@pytest.fixture(scope="module")
def events_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def vllm_fleet(tiny_model: Path, events_port: int) -> Iterator[list[LocalEngine]]:
    engines = start_fleet(2, kv_events=f"tcp://127.0.0.1:{events_port}")
    try:
        yield engines
    finally:
        for engine in engines:
            stop(engine)


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
    finally:
        proc.terminate()
        proc.wait(15)
        log.close()
