"""Serving helpers shared by the tests: an ASGI app on a free loopback port in the running event
loop (:func:`serve_asgi`), a real process started and waited for until its health URL answers
200 (:func:`running_process`), and :func:`free_port` (the one in engines/local/launcher.py)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import uvicorn

from kvgate.engines.ports import free_port

__all__ = ["REDIS_SERVER", "RedisServer", "free_port", "running_process", "serve_asgi", "wait_ready"]


@contextlib.asynccontextmanager
async def serve_asgi(app: Any, lifespan: Literal["on", "off"] = "on",
                     http: str = "httptools") -> AsyncIterator[str]:
    """Serve ``app`` with uvicorn on a free loopback port in this loop; yields its base URL.
    ``http``: uvicorn's protocol name, or a class path such as kvgate's own
    ``kvgate.middleware.cli.HTTP_FRONTS["kvgate"]`` (what ``kvgate serve`` runs).

    A startup failure is re-raised; leaving the block stops the server and closes the socket.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    sock.setblocking(False)
    server = uvicorn.Server(uvicorn.Config(app, lifespan=lifespan, log_level="warning",
                                           access_log=False, http=http))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.005)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task
        sock.close()


def _output(proc: subprocess.Popen[bytes], log: Path | None) -> str:
    """The tail of what the process wrote (its log file, else its stdout pipe)."""
    if log is not None:
        return log.read_text()[-3000:]
    return proc.stdout.read().decode()[-3000:] if proc.stdout else ""


def wait_ready(url: str, proc: subprocess.Popen[bytes], limit_s: float,
               log: Path | None = None) -> None:
    """Poll ``url`` until it answers 200; fails with the process output if it exits first."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode}: {_output(proc, log)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1).status_code == 200:
                return
        time.sleep(0.05)
    tail = f": {_output(proc, log)}" if log is not None else ""
    raise AssertionError(f"{url} not ready after {limit_s} s{tail}")


@contextlib.contextmanager
def running_process(args: list[str], ready_url: str, *, log: Path | None = None,
                    cwd: Path | None = None, limit_s: float = 20.0,
                    stop_s: float = 10.0) -> Iterator[subprocess.Popen[bytes]]:
    """``args`` as a process (output appended to ``log``, else piped), ready once ``ready_url``
    answers 200; terminated (killed after ``stop_s``) on leaving, unless already gone."""
    if log is not None:
        with log.open("ab") as out:
            proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=cwd)
    else:
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=cwd)
    try:
        wait_ready(ready_url, proc, limit_s, log)
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(stop_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


REDIS_SERVER = shutil.which("redis-server")


class RedisServer:
    """A throwaway redis-server on loopback. With ``data`` it persists (``appendonly yes``,
    ``appendfsync always`` in that folder), so ``stop()`` then ``start()`` comes back with the
    same data on the same port, as a production Redis must; without, nothing is kept."""

    def __init__(self, port: int | None = None, data: Path | None = None) -> None:
        self.port = free_port() if port is None else port
        self.data = data
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        assert REDIS_SERVER is not None
        persistence = ["--appendonly", "no"] if self.data is None else [
            "--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.data)]
        self.proc = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             *persistence, "--protected-mode", "no"],
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


@contextlib.contextmanager
def redis_running() -> Iterator[RedisServer]:
    """A fresh ``redis-server`` on a free loopback port for the block, stopped after it."""
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()
