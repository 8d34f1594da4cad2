"""Several ``kvgate serve`` replicas sharing routing state through one Redis, for the replay.

Systems ``kvgate-default-1r`` and ``kvgate-default-3r`` of :mod:`bench.replay_systems`: the
quick start as a platform team runs it behind a load balancer — every engine *binds* its KV-event
socket (``tcp://*:PORT``) and every replica connects to every engine, each replica runs from its
own working directory (its own ``.kvgate/``) with ``--redis``, and the replay client sends
request *i* to replica ``i mod N`` (round robin: a session's turns land on different replicas).
``-1r`` is the same topology with one replica, the baseline of ``-3r``.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from bench import procs

REDIS_SERVER = shutil.which("redis-server")


@contextlib.contextmanager
def redis_running(logs: Path) -> Iterator[str]:
    """A throwaway redis-server on loopback (no persistence); yields its URL."""
    if REDIS_SERVER is None:
        raise procs.StartError("redis-server not found (apt-get install redis-server)")
    port = procs.free_port()
    argv = [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--protected-mode", "no"]
    with procs.running(argv, "0-1", logs / "redis.log") as proc:
        deadline = time.monotonic() + 10
        while subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True,
                             check=False).stdout.strip() != b"PONG":
            if proc.poll() is not None or time.monotonic() > deadline:
                raise procs.StartError(f"redis-server did not start on port {port}")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"


def replica_argv(port: int, urls: list[str], events: list[str], redis: str | None,
                 cwd: Path) -> list[str]:
    """``kvgate serve`` quick start over ``urls`` connecting to each engine's KV events."""
    argv = ["env", "-C", str(cwd), str(Path(sys.executable).parent / "kvgate"), "serve",
            "--port", str(port)]
    argv += [a for u in urls for a in ("--engine", u)]
    argv += [a for e in events for a in ("--kv-events", e)]
    return argv + (["--redis", redis] if redis else [])


@contextlib.contextmanager
def replicas_running(
    count: int, urls: list[str], events: list[str], logs: Path, model: str,
) -> Iterator[list[str]]:
    """``count`` replicas (with a Redis when more than one); yields their base URLs."""
    with contextlib.ExitStack() as stack:
        redis = stack.enter_context(redis_running(logs)) if count > 1 else None
        bases: list[str] = []
        for i in range(count):
            cwd = logs / f"replica-{i}"
            cwd.mkdir(parents=True, exist_ok=True)
            port = procs.free_port()
            log = logs / f"kvgate-{i}.log"
            proc = stack.enter_context(
                procs.running(replica_argv(port, urls, events, redis, cwd), "0-1", log))
            base = f"http://127.0.0.1:{port}"
            procs.wait_healthy(base + "/health", proc, 120.0, log)
            procs.wait_healthy(base + "/v1/models", proc, 120.0, log, model.encode())
            bases.append(base)
        yield bases
