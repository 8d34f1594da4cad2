"""Start and stop local vLLM CPU engines (the tiny model) as process groups.

Each engine: ``python -m vllm.entrypoints.openai.api_server`` under the engine venv on a free
loopback port, with prefix caching, prompt-token details, bounded KV memory (``kv_cache_bytes``,
default 64 MiB: without it each engine reserves ~10 GiB), ``-O0`` (cold start ~35 s instead of
~120 s), pinned to one core (``VLLM_CPU_OMP_THREADS_BIND``; otherwise every engine computes on
core 0), optional ZMQ KV events, optional NixlConnector prefill/decode roles.

KV events come in two modes: ``kv_events=ADDRESS`` (a plain address: the engine *connects* to
the gateway's bound SUB socket; topic ``kv@<name>``), or ``kv_events_bind=True`` (what real
deployments do: each engine binds its own ``tcp://*:<free port>`` with vLLM's default, empty,
topic; the address to connect to is kept in ``LocalEngine.kv_events``).

Logs go to files; a health wait that times out raises with the log tail. A state file lets
``kvgate engines down`` stop exactly what ``up`` started.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from kvgate.engines.local.model import SERVED_NAME
from kvgate.engines.local.paths import engine_python, kvgate_home
from kvgate.engines.ports import (
    free_port as free_port,  # re-exported: callers use launcher.free_port()
)

#: Cold start measured at 30-60 s on this 2-core machine; allow for a loaded CI machine.
HEALTH_TIMEOUT_S = 300.0
#: KV cache per engine unless told otherwise: 64 MiB = 16,384 tokens of the tiny model (4 KiB of
#: K and V per token), room for a few 4k-token prompts; vLLM's own default would be ~10 GiB.
DEFAULT_KV_CACHE_BYTES = 64 << 20
PdRole = Literal["prefill", "decode"]


@dataclass
class LocalEngine:
    """One started engine process."""

    name: str
    port: int
    pid: int
    log: str
    started_at: float
    role: PdRole | None = None
    ready_after_s: float | None = None
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def kv_events(self) -> str | None:
        """Where this engine's bound KV-event socket accepts subscribers (bind mode only)."""
        return self.extra.get("kv_events")


def _bytes_arg(size: int) -> str:
    """vLLM's human-readable form: ``64M`` is 64 MiB (binary suffix), else plain bytes."""
    return f"{size >> 20}M" if size > 0 and size % (1 << 20) == 0 else str(size)


def _events_config(kv_events: str | None, name: str, bind_port: int | None) -> dict[str, object]:
    cfg: dict[str, object] = {"enable_kv_cache_events": True, "publisher": "zmq"}
    if bind_port is not None:  # no "topic": vLLM's default (empty), as deployed engines have
        return {**cfg, "endpoint": f"tcp://*:{bind_port}"}
    return {**cfg, "endpoint": kv_events, "topic": f"kv@{name}"}


#: What coding agents need from an engine: tools with automatic choice (``pythonic``: the tiny
#: model's tokenizer has no ``<|python_tag|>``, which ``llama3_json`` requires).
AGENT_ARGS = ("--enable-auto-tool-choice", "--tool-call-parser", "pythonic")
#: ... and vLLM's Responses store (``previous_response_id``, ``GET /v1/responses/{id}``).
AGENT_ENV = {"VLLM_ENABLE_RESPONSES_API_STORE": "1"}


def engine_args(model: Path, name: str, port: int, kv_events: str | None,
                pd_role: PdRole | None, kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
                kv_events_bind_port: int | None = None, *, agent: bool = False) -> list[str]:
    """The engine's command line; ``kv_events`` (connect) and ``kv_events_bind_port`` (bind
    ``tcp://*:port``) are exclusive; ``agent``: with :data:`AGENT_ARGS`."""
    if kv_events is not None and kv_events_bind_port is not None:
        raise ValueError("kv_events (connect) and kv_events_bind_port (bind) are exclusive")
    args = [
        str(engine_python()), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", SERVED_NAME,
        "--host", "127.0.0.1", "--port", str(port), "--enable-prefix-caching",
        "--enable-prompt-tokens-details", "--max-model-len", "4096",
        "--kv-cache-memory-bytes", _bytes_arg(kv_cache_bytes), "-O0",
        "--disable-uvicorn-access-log",
    ]
    if kv_events is not None or kv_events_bind_port is not None:
        cfg = _events_config(kv_events, name, kv_events_bind_port)
        args += ["--kv-events-config", json.dumps(cfg)]
    if pd_role is not None:
        role = "kv_producer" if pd_role == "prefill" else "kv_consumer"
        cfg = {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}
        args += ["--kv-transfer-config", json.dumps(cfg)]
    if agent:
        args += AGENT_ARGS
    return args


def engine_env(core: int, pd_role: PdRole | None) -> dict[str, str]:
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": str(core), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    if pd_role is not None:
        env.update({"VLLM_HOST_IP": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                    "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()), "UCX_TLS": "tcp,self",
                    "UCX_NET_DEVICES": "lo"})
    return env


def spawn(model: Path, name: str, core: int, kv_events: str | None = None,
          pd_role: PdRole | None = None, log_dir: Path | None = None, *,
          kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
          kv_events_bind: bool = False, agent: bool = False) -> LocalEngine:
    port = free_port()
    bind_port = free_port() if kv_events_bind else None
    logs = log_dir or kvgate_home() / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{name}-{port}.log"
    argv = engine_args(model, name, port, kv_events, pd_role, kv_cache_bytes, bind_port,
                       agent=agent)
    env = {**engine_env(core, pd_role), **(AGENT_ENV if agent else {})}
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    extra = {} if bind_port is None else {"kv_events": f"tcp://127.0.0.1:{bind_port}"}
    return LocalEngine(name, port, proc.pid, str(log), time.monotonic(), pd_role, extra=extra)


def log_tail(engine: LocalEngine, lines: int = 40) -> str:
    try:
        return "\n".join(Path(engine.log).read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(no log: {exc})"


def _alive(pid: int) -> bool:
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        waited = 0
    if waited == pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _healthy(engine: LocalEngine) -> bool:
    try:
        with urllib.request.urlopen(engine.url + "/health", timeout=2) as resp:
            return int(resp.status) == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_healthy(engines: Sequence[LocalEngine], timeout_s: float = HEALTH_TIMEOUT_S) -> None:
    """Block until every engine answers /health; raises with the log tail on death/timeout."""
    deadline = time.monotonic() + timeout_s
    pending = list(engines)
    while pending:
        for engine in list(pending):
            if _healthy(engine):
                engine.ready_after_s = time.monotonic() - engine.started_at
                pending.remove(engine)
            elif not _alive(engine.pid):
                raise RuntimeError(f"engine {engine.name} exited during startup; log tail:\n"
                                   f"{log_tail(engine)}")
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"engine {pending[0].name} not healthy after {timeout_s:.0f} s; "
                               f"log tail:\n{log_tail(pending[0])}")
        if pending:
            time.sleep(0.5)


def stop(engine: LocalEngine, grace_s: float = 15.0) -> None:
    """SIGTERM the engine's process group, SIGKILL after ``grace_s``."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(engine.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not _alive(engine.pid):
                return
            time.sleep(0.2)


def rss_mib(engine: LocalEngine) -> float:
    """Resident memory of the engine's whole process group, MiB (Linux /proc)."""
    total = 0
    for status in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = status.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == engine.pid:  # pgrp
                statm = (status.parent / "statm").read_text().split()
                total += int(statm[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            continue
    return total / (1 << 20)


def save_state(engines: Sequence[LocalEngine], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([asdict(e) for e in engines], indent=2))


def load_state(path: Path) -> list[LocalEngine]:
    if not path.is_file():
        return []
    return [LocalEngine(**item) for item in json.loads(path.read_text())]
