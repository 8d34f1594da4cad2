"""Serving helpers shared by the tests: an ASGI app on a free loopback port in the running event
loop (:func:`serve_asgi`), a real process started and waited for until its health URL answers
200 (:func:`running_process`), and :func:`free_port` (the one in engines/local/launcher.py)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import uvicorn

from engines.local.launcher import free_port

__all__ = ["free_port", "running_process", "serve_asgi", "wait_ready"]


@contextlib.asynccontextmanager
async def serve_asgi(app: Any, lifespan: Literal["on", "off"] = "on") -> AsyncIterator[str]:
    """Serve ``app`` with uvicorn on a free loopback port in this loop; yields its base URL.

    A startup failure is re-raised; leaving the block stops the server and closes the socket.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    sock.setblocking(False)
    server = uvicorn.Server(uvicorn.Config(app, lifespan=lifespan, log_level="warning",
                                           access_log=False, http="httptools"))
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
