"""The LiteLLM proxy's own virtual environment, built on first use (like the engine venv).

``litellm[proxy]`` pulls a large web stack of its own (~740 MB, ~40 s to install here), so it
lives outside kvgate's environment, in ``$KVGATE_HOME/litellm-proxy-venv``. A marker holding the
requirement is written last: a matching venv is reused, a half-built or outdated one rebuilt.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from kvgate.engines.local.paths import base_python, kvgate_home

REQUIREMENT = "litellm[proxy]==1.106.2"
MARKER = "kvgate-litellm-proxy.req"


def proxy_venv() -> Path:
    return kvgate_home() / "litellm-proxy-venv"


def ensure_proxy_venv() -> Path:
    """The ``litellm`` proxy executable, installing its venv first when needed."""
    venv = proxy_venv()
    marker = venv / MARKER
    exe = venv / "bin" / "litellm"
    if marker.is_file() and marker.read_text().strip() == REQUIREMENT and exe.exists():
        return exe
    if venv.exists():
        shutil.rmtree(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    for args in ([base_python(), "-m", "venv", str(venv)],
                 [str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
                  "--disable-pip-version-check", REQUIREMENT]):
        done = subprocess.run(args, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"LiteLLM proxy venv: {args[2:]} failed (exit {done.returncode}):"
                               f"\n{(done.stdout + done.stderr)[-3000:]}")
    marker.write_text(REQUIREMENT)
    return exe
