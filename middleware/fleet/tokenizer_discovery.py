"""Find the model's tokenizer for precise routing when the operator gave none.

Precise prefix routing needs the engines' own token ids. ``kvgate serve --kv-events ...`` without
``--tokenizer`` asks the first engine which model it serves (``GET /v1/models``: vLLM reports the
served name as ``id`` and what it loaded as ``root``) and looks for ``tokenizer.json``:

1. in ``root`` when it is a folder on this host (engines started from a local model folder,
   the gateway on the same host or on a shared volume);
2. in the Hugging Face hub cache (``$HF_HUB_CACHE``, ``$HF_HOME/hub``, ``~/.cache/huggingface/hub``)
   under ``models--<org>--<name>/snapshots/*`` for ``root`` and ``id`` read as hub names.

Nothing is downloaded. Startup-time I/O only (blocking, 5 s timeout); ``None`` when not found.
"""

from __future__ import annotations

import json
import logging
import os
import urllib.error
import urllib.request
from pathlib import Path

log = logging.getLogger("kvgate.tokenizer_discovery")

TIMEOUT_S = 5.0


def served_models(url: str, timeout_s: float = TIMEOUT_S) -> list[tuple[str, str]]:
    """``(id, root)`` of each model the engine at ``url`` serves ([] when it cannot tell)."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/v1/models", timeout=timeout_s) as resp:
            payload = json.loads(resp.read())
    except (OSError, urllib.error.URLError, ValueError) as exc:
        log.debug("tokenizer discovery: %s/v1/models: %s", url, exc)
        return []
    data = payload.get("data") if isinstance(payload, dict) else None
    out = []
    for card in data if isinstance(data, list) else []:
        if isinstance(card, dict) and isinstance(card.get("id"), str):
            root = card.get("root")
            out.append((card["id"], root if isinstance(root, str) else card["id"]))
    return out


def hub_cache_dirs() -> list[Path]:
    dirs = []
    if os.environ.get("HF_HUB_CACHE"):
        dirs.append(Path(os.environ["HF_HUB_CACHE"]))
    if os.environ.get("HF_HOME"):
        dirs.append(Path(os.environ["HF_HOME"]) / "hub")
    dirs.append(Path.home() / ".cache" / "huggingface" / "hub")
    return dirs


def find_local(name: str, cache_dirs: list[Path]) -> Path | None:
    """A folder with ``tokenizer.json`` for ``name``: the path itself or a hub snapshot."""
    path = Path(name)
    if path.is_absolute() and (path / "tokenizer.json").is_file():
        return path
    if name.count("/") != 1:
        return None
    org, model = name.split("/")
    for cache in cache_dirs:
        snapshots = cache / f"models--{org}--{model}" / "snapshots"
        for snap in sorted(snapshots.glob("*"), reverse=True) if snapshots.is_dir() else []:
            if (snap / "tokenizer.json").is_file():
                return snap
    return None


def discover_tokenizer(url: str) -> str | None:
    """The tokenizer folder of the model served at ``url`` (see the module docstring)."""
    caches = hub_cache_dirs()
    for model_id, root in served_models(url):
        for name in (root, model_id):
            found = find_local(name, caches)
            if found is not None:
                return str(found)
    return None
