"""Shared by the async-queue tests: a persistent throwaway redis-server (AOF on, so a stop and
restart keeps the queue, as a production Redis must), job specs, and polling."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from kvgate.asyncq.api import JobSpec
from tests.servers import RedisServer

T = TypeVar("T")


class PersistentRedis(RedisServer):
    """redis-server on loopback that keeps its data in ``data`` across ``stop()``/``start()``
    (tests.servers.RedisServer with persistence)."""

    def __init__(self, data: Path) -> None:
        super().__init__(data=data)


def spec(job_id: str, *, kind: str = "queued", tenant: str | None = "t1",
         created_at: float = 1000.0, deadline: float | None = None, priority: int = 0,
         batch_id: str | None = None, prefix_key: str = "", body: bytes = b"{}",
         path: str = "/v1/chat/completions") -> JobSpec:
    return JobSpec(id=job_id, kind=kind, method="POST", path=path, body=body, tenant=tenant,
                   key_id=None if tenant is None else f"{tenant}-key", created_at=created_at,
                   deadline=deadline, priority=priority, batch_id=batch_id,
                   custom_id=None if batch_id is None else f"c-{job_id}", prefix_key=prefix_key)


async def until(probe: Callable[[], Awaitable[T | None]], timeout_s: float = 20.0,
                every_s: float = 0.05) -> T:
    """Poll ``probe`` until it returns something truthy (AssertionError after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = await probe()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(every_s)
