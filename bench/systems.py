"""The systems a benchmark can put between the load generator and the fake upstream.

``direct`` is no system at all (the load goes straight to the upstream); every other one is a
process started on the system-under-test core, in front of the same upstream.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from bench import procs, venvs

DIRECT = "direct"
KVGATE = "kvgate"
#: kvgate served by uvicorn's own HTTP protocol (``kvgate serve --http uvicorn``), as before
#: middleware/transport/h1server.py became the default: the before/after of the front end in one
#: run.
KVGATE_UVICORN = "kvgate-uvicorn"
#: kvgate with aiohttp as the engine call's transport for every engine (``kvgate serve
#: --engine-client aiohttp``) instead of its own HTTP/1.1 client
#: (middleware/transport/h1client.py): what
#: the lean client saves, in one run.
KVGATE_AIOHTTP = "kvgate-aiohttp"
#: kvgate's ASGI app served by granian (Rust HTTP server; bench/granian_kvgate.py), to compare
#: HTTP front ends: kvgate's own, uvicorn's protocol, granian.
KVGATE_GRANIAN = "kvgate-granian"
#: kvgate from another checkout (``KVGATE_BASE_TREE``: a ``git worktree`` of the commit to
#: compare with, put first on ``PYTHONPATH``; the venv's installed dependencies and entry points
#: are shared): a before/after of any change in one run.
KVGATE_BASE = "kvgate-base"
BASE_TREE_ENV = "KVGATE_BASE_TREE"
VLLM_ROUTER = "vllm-router"
#: vllm-router with its own default policy, ``cache_aware`` (a radix tree of each request's
#: text per worker): the like-for-like peer of kvgate's cache-aware default. ``vllm-router``
#: runs ``round_robin``, the cheapest policy, which issue 12's per-core target names.
VLLM_ROUTER_CA = "vllm-router-cache-aware"
SGLANG_ROUTER = "sglang-router"
PASS_AIOHTTP = "passthrough-aiohttp"
PASS_HTTPX = "passthrough-httpx"
#: kvgate's own HTTP server and engine client around an app that only forwards the body: the
#: floor under ``kvgate``'s CPU per request (what kvgate costs above it is the gateway's work).
PASS_H1 = "passthrough-h1"
#: kvgate's quick start with the precise preset: the model's tokenizer (``KVGATE_BENCH_TOKENIZER``,
#: default the local tiny test model's folder) and ``--kv-events`` on a loopback address where
#: nothing publishes (the fake engine has no KV cache): every request is tokenized, hashed in
#: the engines' block layout and looked up in the KV-event index, as with real engines.
KVGATE_PRECISE = "kvgate-precise"
TOKENIZER_ENV = "KVGATE_BENCH_TOKENIZER"
#: :data:`KVGATE_PRECISE` from the ``KVGATE_BASE_TREE`` checkout: its before/after in one run.
KVGATE_BASE_PRECISE = "kvgate-base-precise"
DEFAULT_TOKENIZER = Path.home() / ".cache" / "kvgate" / "models" / "tiny-llama-0"
#: The cache-aware default's essential work in one flat function on kvgate's own server,
#: client and primitives (bench/flat_bound.py): a lower bound for a Python gateway.
FLAT_BOUND = "flat-bound"

MODEL = "bench-model"  # what the fake engine serves and the load asks for
Argv = Callable[[str, int, int, Path], list[str]]


@dataclass(frozen=True)
class System:
    """How to start one system: argv from (upstream URL, port, spare port, venv root)."""

    name: str
    argv: Argv | None
    health_path: str = "/health"
    tool: venvs.Tool | None = None
    start_timeout_s: float = 60.0
    ready_path: str | None = None  # then also wait until GET ready_path mentions the model
    #: Start in a fresh empty working directory, removed afterwards: kvgate keeps routing state
    #: (placement's insertion ledger, session pins) under ``.kvgate/`` of its working
    #: directory and restores it at start, so launches sharing one would inherit each other's
    #: (kvgate and kvgate-base in one run, and every trial after the first).
    own_workdir: bool = False


@dataclass(frozen=True)
class Endpoint:
    """A running system: where to send load, and the pid whose CPU time to count."""

    name: str
    base_url: str
    pid: int | None


def _kvgate(upstream: str, port: int, _aux: int, _root: Path) -> list[str]:
    kvgate = Path(sys.executable).parent / "kvgate"
    return [str(kvgate), "serve", "--engine", upstream, "--host", "127.0.0.1", "--port", str(port)]


def _kvgate_precise(upstream: str, port: int, aux: int, root: Path) -> list[str]:
    model_dir = Path(os.environ.get(TOKENIZER_ENV) or DEFAULT_TOKENIZER)
    if not (model_dir / "tokenizer.json").is_file():
        raise SystemExit(f"{KVGATE_PRECISE}: no tokenizer.json in {model_dir} (set {TOKENIZER_ENV}"
                         " to a model folder; the e2e tests build the tiny one)")
    return [*_kvgate(upstream, port, aux, root), "--kv-events", f"tcp://127.0.0.1:{aux}",
            "--tokenizer", str(model_dir)]


def _kvgate_uvicorn(upstream: str, port: int, aux: int, root: Path) -> list[str]:
    return [*_kvgate(upstream, port, aux, root), "--http", "uvicorn"]


def _kvgate_aiohttp(upstream: str, port: int, aux: int, root: Path) -> list[str]:
    return [*_kvgate(upstream, port, aux, root), "--engine-client", "aiohttp"]


def _kvgate_granian(upstream: str, port: int, _aux: int, _root: Path) -> list[str]:
    root = Path(__file__).resolve().parent.parent  # it starts in its own empty directory
    return ["env", f"PYTHONPATH={root}", sys.executable, "-m", "bench.granian_kvgate",
            "--engine", upstream, "--host", "127.0.0.1", "--port", str(port)]


def _base_env() -> list[str]:
    tree = os.environ.get(BASE_TREE_ENV)
    root = Path(tree or ".")
    if not tree or not any(p.is_file() for p in (root / "kvgate" / "__init__.py",
                                                 root / "middleware" / "cli.py")):
        raise SystemExit(f"{KVGATE_BASE}: set {BASE_TREE_ENV} to a kvgate checkout "
                         "(git worktree add /tmp/kvgate-base <commit>)")
    return ["env", f"PYTHONPATH={Path(tree).resolve()}"]


def _from_base(argv: list[str]) -> list[str]:
    """A ``kvgate ...`` command run from the base tree. With its own ``.venv`` (``python3 -m venv
    .venv && .venv/bin/pip install -e .`` there), that install's ``kvgate``: needed for a tree
    from before the one import root, whose modules the installed entry points of this checkout
    do not name. Otherwise this checkout's command with the base tree first on ``PYTHONPATH``."""
    env = _base_env()
    own = Path(env[1].split("=", 1)[1]) / ".venv" / "bin" / "kvgate"
    return [str(own), *argv[1:]] if own.is_file() else [*env, *argv]


def _kvgate_base(upstream: str, port: int, aux: int, root: Path) -> list[str]:
    return _from_base(_kvgate(upstream, port, aux, root))


def _kvgate_base_precise(upstream: str, port: int, aux: int, root: Path) -> list[str]:
    return _from_base(_kvgate_precise(upstream, port, aux, root))


def _vllm_router_with(policy: str) -> Argv:
    def argv(upstream: str, port: int, aux: int, root: Path) -> list[str]:
        program = venvs.bin_path(venvs.VLLM_ROUTER, "vllm-router", root)
        return [
            str(program), "--worker-urls", upstream, "--policy", policy,
            "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(aux),
            "--log-level", "warning",
        ]

    return argv


def _sglang_router(upstream: str, port: int, aux: int, root: Path) -> list[str]:
    python = venvs.bin_path(venvs.SGLANG_ROUTER, "python", root)
    return [
        str(python), "-m", "sglang_router.launch_router", "--worker-urls", upstream,
        "--policy", "round_robin", "--host", "127.0.0.1", "--port", str(port),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(aux),
        "--log-level", "warn",
    ]


def _passthrough(client: str) -> Argv:
    def argv(upstream: str, port: int, _aux: int, _root: Path) -> list[str]:
        return [
            sys.executable, "-m", "bench.passthrough", "--client", client,
            "--upstream", upstream, "--host", "127.0.0.1", "--port", str(port),
        ]

    return argv


def _flat_bound(upstream: str, port: int, _aux: int, _root: Path) -> list[str]:
    return [sys.executable, "-m", "bench.flat_bound", "--upstream", upstream,
            "--host", "127.0.0.1", "--port", str(port)]


def catalogue() -> dict[str, System]:
    """Every known system by name."""
    systems = [
        System(DIRECT, None),
        System(KVGATE, _kvgate, start_timeout_s=120.0, ready_path="/v1/models",
               own_workdir=True),
        System(KVGATE_PRECISE, _kvgate_precise, start_timeout_s=120.0, ready_path="/v1/models",
               own_workdir=True),
        System(KVGATE_BASE_PRECISE, _kvgate_base_precise, start_timeout_s=120.0,
               ready_path="/v1/models", own_workdir=True),
        System(KVGATE_UVICORN, _kvgate_uvicorn, start_timeout_s=120.0, ready_path="/v1/models",
               own_workdir=True),
        System(KVGATE_AIOHTTP, _kvgate_aiohttp, start_timeout_s=120.0, ready_path="/v1/models",
               own_workdir=True),
        System(KVGATE_GRANIAN, _kvgate_granian, start_timeout_s=120.0,
               ready_path="/v1/models", own_workdir=True),
        System(KVGATE_BASE, _kvgate_base, start_timeout_s=120.0, ready_path="/v1/models",
               own_workdir=True),
        System(VLLM_ROUTER, _vllm_router_with("round_robin"), tool=venvs.VLLM_ROUTER),
        System(VLLM_ROUTER_CA, _vllm_router_with("cache_aware"), tool=venvs.VLLM_ROUTER),
        System(SGLANG_ROUTER, _sglang_router, tool=venvs.SGLANG_ROUTER),
        System(PASS_AIOHTTP, _passthrough("aiohttp")),
        System(PASS_HTTPX, _passthrough("httpx")),
        System(PASS_H1, _passthrough("h1")),
        System(FLAT_BOUND, _flat_bound, ready_path="/v1/models"),
    ]
    return {system.name: system for system in systems}


@contextlib.contextmanager
def launched(
    system: System, upstream: str, cpu: int, log_path: Path, venv_root: Path
) -> Iterator[Endpoint]:
    """Start ``system`` pinned to ``cpu`` in front of ``upstream``; stop it on exit."""
    if system.argv is None:
        yield Endpoint(system.name, upstream, None)
        return
    port, aux = procs.free_port(), procs.free_port()
    argv = system.argv(upstream, port, aux, venv_root)
    base = f"http://127.0.0.1:{port}"
    with contextlib.ExitStack() as stack:
        cwd = (Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvgate-bench-")))
               if system.own_workdir else None)
        proc = stack.enter_context(procs.running(argv, cpu, log_path, cwd=cwd))
        procs.wait_healthy(base + system.health_path, proc, system.start_timeout_s, log_path)
        if system.ready_path is not None:
            procs.wait_healthy(base + system.ready_path, proc, system.start_timeout_s, log_path,
                               must_contain=MODEL.encode())
        yield Endpoint(system.name, base, proc.pid)
