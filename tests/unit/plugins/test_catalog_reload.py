"""Catalog reload (plugins/catalog.py's Reloadable side, driven by plugins/reload.py): a new
file is checked against the gateway config the catalog was built with; a refused one keeps the
last good catalog serving."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from middleware.config import parse_config
from middleware.pipeline import build_pipeline
from middleware.registry import Registry
from plugins.catalog import Catalog
from plugins.reload import FileReloader

POOL: dict[str, Any] = {"name": "sim-model", "aliases": ["sim"], "pool": {"engines": ["e0"]}}


def _catalog(tmp_path: Path) -> Catalog:
    path = tmp_path / "catalog.yaml"
    path.write_text(yaml.safe_dump({"models": [POOL]}))
    data = {"engines": [{"name": "e0", "url": "http://x:1"}],
            "plugins": [{"type": "catalog", "params": {"file": str(path)}},
                        {"type": "max-score-picker"}],
            "profiles": [{"name": "default", "plugins": [{"ref": "max-score-picker"}]}]}
    catalog = build_pipeline(parse_config(data, "gw.yaml"), Registry.from_entry_points()).catalog
    assert isinstance(catalog, Catalog)
    return catalog


CASES: list[tuple[str, Any, str | None]] = [
    ("new alias", [{**POOL, "aliases": ["sim", "new"]}], None),
    ("unknown engine", [{**POOL, "pool": {"engines": ["e9"]}}], "pool engine 'e9'"),
    ("unknown profile", [{**POOL, "pool": {"profile": "fast"}}], "routing profile 'fast'"),
    ("backend kind not started", [POOL, {"name": "gpt", "provider": {
        "model": "openai/gpt-x", "backend": "other"}}], "not installed"),
    ("installed kind the gateway did not start", [POOL, {"name": "gpt", "provider": {
        "model": "openai/gpt-x", "backend": "litellm"}}], "were not started with the gateway"),
    ("not yaml", "models: [", "invalid YAML"),
    ("duplicate alias", [POOL, {"name": "x", "aliases": ["sim"], "pool": {}}],
     "already the name or an alias"),
]


@pytest.mark.parametrize(("case", "models", "error"), CASES, ids=[c[0] for c in CASES])
async def test_reload_checks_against_the_gateway_config(tmp_path: Path, case: str, models: Any,
                                                        error: str | None) -> None:
    catalog = _catalog(tmp_path)
    reloader = FileReloader("catalog", catalog)
    text = models if isinstance(models, str) else yaml.safe_dump({"models": models})
    (tmp_path / "catalog.yaml").write_text(text + "\n# changed\n")
    await reloader.poll()
    if error is None:
        assert reloader.status.error is None and catalog.canonical("new") == "sim-model"
    else:
        assert reloader.status.error is not None and error in reloader.status.error
        assert catalog.canonical("sim") == "sim-model" and catalog.canonical("new") is None
        assert [e.name for e in catalog.file.models] == ["sim-model"]  # the last good one
