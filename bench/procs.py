"""Process helpers for benchmarks: start pinned to a core, wait for health, stop, count CPU time."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from kvgate.engines.ports import (
    free_port as free_port,  # re-exported: callers use procs.free_port()
)

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class StartError(RuntimeError):
    """A process under test did not come up."""


def pin_self(cpu: int) -> None:
    """Pin the calling process to one core (no-op where affinity is unsupported)."""
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setaffinity(0, {cpu})


def start(
    argv: Sequence[str],
    cpu: int | str,
    log_path: Path,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` pinned to ``cpu`` (a core, or a taskset list such as ``"0-1"``; children
    inherit the mask), output to ``log_path``, in ``cwd`` (default: this process's)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, **(env or {})}
    with log_path.open("wb") as log:
        return subprocess.Popen(
            ["taskset", "-c", str(cpu), *argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=full_env,
            cwd=cwd,
            start_new_session=True,
        )


def http_ok(url: str, timeout_s: float = 1.0, must_contain: bytes = b"") -> bool:
    """True when GET ``url`` answers 200 (with ``must_contain`` in its body, if given)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return int(resp.status) == 200 and must_contain in resp.read()
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_healthy(
    url: str, proc: subprocess.Popen[bytes] | None, timeout_s: float, log_path: Path | None = None,
    must_contain: bytes = b"",
) -> None:
    """Poll ``url`` until 200; raise :class:`StartError` if the process dies or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise StartError(f"exited with {proc.returncode}: {_log_tail(log_path)}")
        if http_ok(url, must_contain=must_contain):
            return
        time.sleep(0.1)
    raise StartError(f"no 200 from {url} within {timeout_s:.0f} s: {_log_tail(log_path)}")


def _log_tail(log_path: Path | None, lines: int = 8) -> str:
    if log_path is None or not log_path.exists():
        return ""
    text = log_path.read_text(errors="replace").splitlines()[-lines:]
    return " | ".join(text)


def stop(proc: subprocess.Popen[bytes], grace_s: float = 5.0) -> None:
    """SIGTERM the process group started by :func:`start`, then SIGKILL after ``grace_s``."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=grace_s)


@contextlib.contextmanager
def running(
    argv: Sequence[str], cpu: int | str, log_path: Path, env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    """:func:`start` as a context manager that always :func:`stop`\\ s."""
    proc = start(argv, cpu, log_path, env, cwd)
    try:
        yield proc
    finally:
        stop(proc)


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    task_dir = Path(f"/proc/{pid}/task")
    with contextlib.suppress(OSError):
        for task in task_dir.iterdir():
            with contextlib.suppress(OSError):
                kids.extend(int(x) for x in (task / "children").read_text().split())
    return kids


def _own_cpu_seconds(pid: int) -> float:
    """utime + stime of one process (all its threads), in seconds; 0 if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds used so far by ``pid`` and its live descendants."""
    total = 0.0
    pending = [pid]
    while pending:
        current = pending.pop()
        total += _own_cpu_seconds(current)
        pending.extend(_children(current))
    return total


def core_times() -> dict[int, tuple[float, float]]:
    """Per core: (busy seconds, total seconds) since boot, from /proc/stat."""
    out: dict[int, tuple[float, float]] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/stat").read_text().splitlines():
            name, *ticks = line.split()
            if not name.startswith("cpu") or name == "cpu":
                continue
            values = [int(t) for t in ticks]
            idle = values[3] + (values[4] if len(values) > 4 else 0)
            out[int(name[3:])] = ((sum(values) - idle) / CLOCK_TICKS, sum(values) / CLOCK_TICKS)
    return out


def busy_share(
    before: dict[int, tuple[float, float]], after: dict[int, tuple[float, float]], core: int
) -> float | None:
    """Fraction of ``core`` that was busy between two :func:`core_times` readings."""
    if core not in before or core not in after:
        return None
    busy = after[core][0] - before[core][0]
    total = after[core][1] - before[core][1]
    return busy / total if total > 0 else None
