"""The tiny offline model: built once per seed into ``$KVGATE_HOME/models/tiny-llama-<seed>``
by ``build_model_script.py`` under the engine venv; a marker written last tells a complete
folder from a half-built one (which is rebuilt)."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from kvgate.engines.local.paths import models_dir
from kvgate.engines.local.venv import ensure_engine_venv

SCRIPT = Path(__file__).with_name("build_model_script.py")
MARKER = "kvgate-model-complete"
#: Name the engines serve the model under.
SERVED_NAME = "tiny-llama"


def model_dir(seed: int = 0) -> Path:
    return models_dir() / f"tiny-llama-{seed}"


def ensure_model(seed: int = 0, progress: Callable[[str], None] = print) -> Path:
    """The tiny model's folder, building it (~10 s) when missing or incomplete."""
    out = model_dir(seed)
    if (out / MARKER).is_file():
        progress(f"tiny model: reusing {out}")
        return out
    python = ensure_engine_venv(progress)
    if out.exists():
        shutil.rmtree(out)
    progress(f"tiny model: building {out} (seed {seed}) ...")
    started = time.monotonic()
    done = subprocess.run([str(python), str(SCRIPT), "--out", str(out), "--seed", str(seed)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"tiny model build failed:\n{(done.stdout + done.stderr)[-3000:]}")
    (out / MARKER).write_text(f"seed={seed}\n")
    progress(f"tiny model: built in {time.monotonic() - started:.0f} s")
    return out
