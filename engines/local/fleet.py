"""A local fleet of real vLLM CPU engines, for tests and ``kvgate engines up``."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from kvgate.engines.local.launcher import (
    DEFAULT_KV_CACHE_BYTES,
    LocalEngine,
    spawn,
    stop,
    wait_healthy,
)
from kvgate.engines.local.model import ensure_model


def _cores() -> int:
    return len(os.sched_getaffinity(0))


def start_fleet(count: int, kv_events: str | None = None, seed: int = 0,
                progress: Callable[[str], None] = print, *,
                kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
                kv_events_bind: bool = False, agent: bool = False) -> list[LocalEngine]:
    """Start ``count`` engines (one core each, round robin over the cores) and wait for health.

    ``kv_cache_bytes``: each engine's KV cache; ``kv_events_bind``: each engine binds its own
    KV-event socket (``LocalEngine.kv_events``) instead of connecting to ``kv_events``;
    ``agent``: ready for coding agents (tools with automatic choice, the Responses store).
    Stops whatever it started if any engine fails to come up.
    """
    model = ensure_model(seed, progress)
    engines = [spawn(model, f"vllm-{i}", i % _cores(), kv_events, kv_cache_bytes=kv_cache_bytes,
                     kv_events_bind=kv_events_bind, agent=agent) for i in range(count)]
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
def local_fleet(count: int, kv_events: str | None = None, *,
                kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
                kv_events_bind: bool = False,
                progress: Callable[[str], None] = print) -> Iterator[list[LocalEngine]]:
    engines = start_fleet(count, kv_events, progress=progress, kv_cache_bytes=kv_cache_bytes,
                          kv_events_bind=kv_events_bind)
    try:
        yield engines
    finally:
        for engine in engines:
            stop(engine)
