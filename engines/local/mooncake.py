"""Mooncake Store for local tests: its own venv and a ``mooncake_master`` on loopback ports.

Engine-side only: the gateway never imports Mooncake (it is not a kvgate dependency).

* **Venv** (:func:`ensure_mooncake_venv`): ``$KVGATE_HOME/mooncake-venv`` with
  ``mooncake-transfer-engine-non-cuda==0.3.13.post1`` (the CUDA wheel does not import without
  CUDA libraries; ~185 MB, ~10 s here). It ships the ``mooncake_master`` executable and the
  ``mooncake.store`` client. Both link ``libibverbs.so.1`` even for TCP, so the system package
  ``libibverbs1`` is checked first. A marker holding the requirement is written last, after
  ``import mooncake.store`` succeeded: a matching venv is reused, a half-built or outdated one
  rebuilt.
* **Master** (:func:`running_master`, :func:`local_master`): starts a command (the venv's
  ``mooncake_master`` or a rendered ``mooncake-master.sh``) with the venv's ``bin`` first on
  ``PATH``, in its own session, logging to a file; ready when the admin server's ``/health``
  says ``service_ready`` and the RPC port accepts TCP; a timeout or an early exit raises with
  the log tail; leaving the block sends SIGTERM to exactly that process, SIGKILL after a grace.
"""

from __future__ import annotations

import contextlib
import ctypes.util
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvgate.engines.local.paths import base_python, kvgate_home
from kvgate.engines.ports import free_port
from kvgate.middleware.framework.errors import KvgateError

REQUIREMENT = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
MARKER = "kvgate-mooncake-venv.req"
IBVERBS_HINT = "install it with: apt-get install -y libibverbs1"
#: The master is serving ~0.2 s after exec here; 30 s leaves room for a loaded CI machine.
READY_TIMEOUT_S = 30.0
#: SIGTERM grace before SIGKILL (the master exits in well under a second on SIGTERM).
STOP_GRACE_S = 10.0

Progress = Callable[[str], None]


class MooncakeError(KvgateError):
    """Mooncake could not be installed, imported or started (the message says why)."""


def mooncake_venv() -> Path:
    return kvgate_home() / "mooncake-venv"


def mooncake_python() -> Path:
    return mooncake_venv() / "bin" / "python"


def mooncake_bin() -> Path:
    return mooncake_venv() / "bin"


def libibverbs_present() -> bool:
    """Whether the dynamic linker can find ``libibverbs.so.1`` (Debian: ``libibverbs1``)."""
    return ctypes.util.find_library("ibverbs") is not None


def venv_ready() -> bool:
    marker = mooncake_venv() / MARKER
    return (marker.is_file() and marker.read_text().strip() == REQUIREMENT
            and (mooncake_bin() / "mooncake_master").exists())


def _run(args: list[str], what: str) -> None:
    done = subprocess.run(args, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-3000:]
        hint = f"\n{IBVERBS_HINT}" if "libibverbs" in tail else ""
        raise MooncakeError(f"mooncake venv: {what} failed (exit {done.returncode}):\n"
                            f"{tail}{hint}")


def ensure_mooncake_venv(progress: Progress = print) -> Path:
    """The Mooncake venv's python, building the venv first when needed."""
    if not libibverbs_present():
        raise MooncakeError(f"Mooncake needs the system library libibverbs.so.1; {IBVERBS_HINT}")
    venv = mooncake_venv()
    if venv_ready():
        progress(f"mooncake venv: reusing {venv}")
        return mooncake_python()
    if venv.exists():
        progress(f"mooncake venv: outdated or half-built, rebuilding {venv}")
        shutil.rmtree(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    _run([base_python(), "-m", "venv", str(venv)], "create")
    _run([str(mooncake_python()), "-m", "pip", "install", "-q", "--disable-pip-version-check",
          REQUIREMENT], f"pip install {REQUIREMENT}")
    _run([str(mooncake_python()), "-c", "import mooncake.store"], "import mooncake.store")
    (venv / MARKER).write_text(REQUIREMENT)
    progress(f"mooncake venv: ready at {venv} after {time.monotonic() - started:.0f} s")
    return mooncake_python()


def venv_env() -> dict[str, str]:
    """The environment with the Mooncake venv's ``bin`` first on ``PATH``."""
    return {**os.environ, "PATH": f"{mooncake_bin()}{os.pathsep}{os.environ.get('PATH', '')}"}


@dataclass(frozen=True)
class MasterAddress:
    """Where a master listens: RPC (store clients) and the HTTP admin/metrics server."""

    host: str
    rpc_port: int
    metrics_port: int

    @property
    def rpc_address(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    @property
    def admin_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}"


def master_command(addr: MasterAddress) -> list[str]:
    """``mooncake_master`` bound to ``addr.host`` for both RPC and the admin server."""
    return [str(mooncake_bin() / "mooncake_master"), "-rpc_port", str(addr.rpc_port),
            "-rpc_address", addr.host, "-metrics_host", addr.host,
            "-metrics_port", str(addr.metrics_port)]


def _log_tail(log: Path, lines: int = 30) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(no log: {exc})"


def _serving(addr: MasterAddress) -> bool:
    try:
        with urllib.request.urlopen(addr.admin_url + "/health", timeout=2) as resp:
            ready = bool(json.loads(resp.read()).get("service_ready"))
        with socket.create_connection((addr.host, addr.rpc_port), timeout=2):
            return ready
    except (OSError, ValueError):
        return False


def wait_ready(proc: subprocess.Popen[bytes], addr: MasterAddress, log: Path,
               timeout_s: float = READY_TIMEOUT_S) -> None:
    """Block until the master serves; raises :class:`MooncakeError` with the log tail."""
    deadline = time.monotonic() + timeout_s
    while not _serving(addr):
        if proc.poll() is not None:
            raise MooncakeError(f"mooncake_master exited (code {proc.returncode}) during "
                                f"startup; log tail:\n{_log_tail(log)}")
        if time.monotonic() > deadline:
            raise MooncakeError(f"mooncake_master not ready after {timeout_s:.0f} s at "
                                f"{addr.admin_url}/health; log tail:\n{_log_tail(log)}")
        time.sleep(0.1)


def stop_process(proc: subprocess.Popen[Any], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM exactly ``proc``, SIGKILL after ``grace_s``; reaps it."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        if proc.poll() is not None:
            return
        proc.send_signal(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait)


@contextlib.contextmanager
def running_master(addr: MasterAddress, log: Path, command: Sequence[str] | None = None,
                   timeout_s: float = READY_TIMEOUT_S) -> Iterator[MasterAddress]:
    """Run ``command`` (default :func:`master_command`) until the block ends.

    A rendered ``mooncake-master.sh`` ``exec``s ``mooncake_master``, whose Python entry point
    ``exec``s the binary: the started PID is the master itself, so stopping it stops exactly it.
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        proc = subprocess.Popen(list(command or master_command(addr)), stdout=out,
                                stderr=subprocess.STDOUT, env=venv_env(),
                                start_new_session=True)
    try:
        wait_ready(proc, addr, log, timeout_s)
        yield addr
    finally:
        stop_process(proc)


@contextlib.contextmanager
def local_master(log_dir: Path | None = None) -> Iterator[MasterAddress]:
    """A master from the Mooncake venv (built if needed) on free loopback ports."""
    ensure_mooncake_venv(progress=lambda _msg: None)
    addr = MasterAddress("127.0.0.1", free_port(), free_port())
    logs = log_dir or kvgate_home() / "logs"
    with running_master(addr, logs / f"mooncake-master-{addr.rpc_port}.log") as ready:
        yield ready
