"""A local fleet of real vLLM CPU engines, for tests and ``kvgate engines up``."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from engines.local.launcher import LocalEngine, spawn, stop, wait_healthy
from engines.local.model import ensure_model


def _cores() -> int:
    return len(os.sched_getaffinity(0))


def start_fleet(count: int, kv_events: str | None = None, seed: int = 0,
                progress: Callable[[str], None] = print) -> list[LocalEngine]:
    """Start ``count`` engines (one core each, round robin over the cores) and wait for health.

    Stops whatever it started if any engine fails to come up.
    """
    model = ensure_model(seed, progress)
    engines = [spawn(model, f"vllm-{i}", i % _cores(), kv_events) for i in range(count)]
    try:
        progress(f"engines: waiting for {count} vLLM CPU engines to become healthy ...")
        wait_healthy(engines)
    except BaseException:
        for engine in engines:
            stop(engine)
        raise
    for e in engines:
        progress(f"engines: {e.name} ready at {e.url} after {e.ready_after_s:.0f} s")
    return engines


def start_pd_pair(seed: int = 0, progress: Callable[[str], None] = print) -> list[LocalEngine]:
    """A NixlConnector prefill (core 0) + decode (core 1) pair on CPU."""
    model = ensure_model(seed, progress)
    engines = [spawn(model, "prefill-0", 0, pd_role="prefill"),
               spawn(model, "decode-0", 1 % _cores(), pd_role="decode")]
    try:
        wait_healthy(engines)
    except BaseException:
        for engine in engines:
            stop(engine)
        raise
    return engines


@contextmanager
def local_fleet(count: int, kv_events: str | None = None) -> Iterator[list[LocalEngine]]:
    engines = start_fleet(count, kv_events)
    try:
        yield engines
    finally:
        for engine in engines:
            stop(engine)
