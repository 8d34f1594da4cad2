"""LMCache for local tests: a venv layered on the engine venv and the Mooncake venv.

Engine-side only: the gateway never imports LMCache. ``lmcache==0.5.6`` declares CUDA-only
dependencies (``cupy-cuda13x``, ``cuda-python``, ``cufile-python``) and pins versions the engine
venv already has newer (numpy, protobuf, OpenTelemetry), so a full install would pull GPU wheels
and churn the engine's packages. What its remote-storage path needs on CPU is the wheel itself
plus ``sortedcontainers`` and ``aiofile``; torch, numpy, msgspec, pyzmq... come from the engine
venv and ``mooncake.store`` from the Mooncake venv, each added to ``sys.path`` by a ``.pth``
file after the venv's own packages (all three venvs share one base interpreter).

:func:`ensure_lmcache_venv` builds ``$KVGATE_HOME/lmcache-venv`` on first use (~20 s with pip's
cache; the 17 MB wheel otherwise), checks that LMCache's remote backend imports, and writes a
marker holding the requirements last: a matching venv is reused, a half-built one rebuilt.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

from kvgate.engines.local.mooncake import Progress, ensure_mooncake_venv, mooncake_venv
from kvgate.engines.local.paths import base_python, engine_venv, kvgate_home
from kvgate.engines.local.venv import ensure_engine_venv
from kvgate.middleware.framework.errors import KvgateError

REQUIREMENT = "lmcache==0.5.6"
EXTRA = ("sortedcontainers", "aiofile")
MARKER = "kvgate-lmcache-venv.req"
#: What the codec's data path imports from LMCache (engines/kvcodec/lmcache_plugin.py).
PROBE = ("import lmcache.v1.storage_backend.remote_backend, "
         "lmcache.v1.storage_backend.local_cpu_backend, mooncake.store")


class LmcacheError(KvgateError):
    """The LMCache venv could not be built (the message says why)."""


def lmcache_venv() -> Path:
    return kvgate_home() / "lmcache-venv"


def lmcache_python() -> Path:
    return lmcache_venv() / "bin" / "python"


def _marker_text() -> str:
    return " ".join([REQUIREMENT, *EXTRA])


def venv_ready() -> bool:
    marker = lmcache_venv() / MARKER
    return marker.is_file() and marker.read_text().strip() == _marker_text()


def _site(venv: Path) -> Path:
    found = sorted((venv / "lib").glob("python*/site-packages"))
    if not found:
        raise LmcacheError(f"no site-packages under {venv}")
    return found[0]


def _run(args: list[str], what: str) -> None:
    done = subprocess.run(args, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise LmcacheError(f"lmcache venv: {what} failed (exit {done.returncode}):\n"
                           f"{(done.stdout + done.stderr)[-3000:]}")


def ensure_lmcache_venv(progress: Progress = print) -> Path:
    """The LMCache venv's python (engine and Mooncake venvs built first when needed)."""
    ensure_engine_venv(progress)
    ensure_mooncake_venv(progress)
    venv = lmcache_venv()
    if venv_ready():
        progress(f"lmcache venv: reusing {venv}")
        return lmcache_python()
    if venv.exists():
        progress(f"lmcache venv: outdated or half-built, rebuilding {venv}")
        shutil.rmtree(venv)
    started = time.monotonic()
    _run([base_python(), "-m", "venv", str(venv)], "create")
    site = _site(venv)
    # after the venv's own packages: "zz" sorts the .pth files last, engine before Mooncake
    (site / "zz-kvgate-engine.pth").write_text(f"{_site(engine_venv())}\n")
    (site / "zzz-kvgate-mooncake.pth").write_text(f"{_site(mooncake_venv())}\n")
    pip = [str(lmcache_python()), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    _run([*pip, "--no-deps", REQUIREMENT], f"pip install --no-deps {REQUIREMENT}")
    _run([*pip, *EXTRA], f"pip install {' '.join(EXTRA)}")
    _run([str(lmcache_python()), "-c", PROBE], "import LMCache's remote backend")
    (venv / MARKER).write_text(_marker_text())
    progress(f"lmcache venv: ready at {venv} after {time.monotonic() - started:.0f} s")
    return lmcache_python()
