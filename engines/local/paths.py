"""Where local engine artefacts live: ``$KVGATE_HOME`` (default ``~/.cache/kvgate``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def kvgate_home() -> Path:
    return Path(os.environ.get("KVGATE_HOME", Path.home() / ".cache" / "kvgate")).expanduser()


def engine_venv() -> Path:
    return kvgate_home() / "engine-venv"


def engine_python() -> Path:
    return engine_venv() / "bin" / "python"


def models_dir() -> Path:
    return kvgate_home() / "models"


def fleet_state_file() -> Path:
    return kvgate_home() / "fleet.json"


def base_python() -> str:
    """The interpreter the engine venv is created from (the one running kvgate's parent)."""
    return getattr(sys, "_base_executable", sys.executable)
