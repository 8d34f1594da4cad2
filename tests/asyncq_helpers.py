"""Shared by the async-queue tests: a persistent throwaway redis-server (AOF on, so a stop and
restart keeps the queue, as a production Redis must), job specs, and polling."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from asyncq.api import JobSpec
from tests.servers import free_port

REDIS_SERVER = shutil.which("redis-server")
T = TypeVar("T")


class PersistentRedis:
    """redis-server on loopback with ``appendonly yes`` / ``appendfsync always`` in ``data``;
    ``stop()`` then ``start()`` comes back with the same data on the same port."""

    def __init__(self, data: Path) -> None:
        self.port = free_port()
        self.data = data
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        assert REDIS_SERVER is not None
        self.proc = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.data),
             "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False


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
