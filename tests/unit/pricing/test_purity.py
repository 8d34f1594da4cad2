"""``pricing`` stays pure: it imports nothing from the gateway or an HTTP stack, and does no
work at import time beyond defining things."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[3] / "pricing"
FORBIDDEN = {"middleware", "plugins", "engines", "fastapi", "httpx", "aiohttp", "starlette"}
MODULES = sorted(PACKAGE.glob("*.py"))


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_no_gateway_or_http_imports(path: Path) -> None:
    assert not _imports(path) & FORBIDDEN


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_modules_stay_small(path: Path) -> None:
    assert len(path.read_text().splitlines()) < 500


def test_importing_pulls_in_no_gateway_module() -> None:
    code = ("import sys, kvgate.pricing.cli, kvgate.pricing.ledger, kvgate.pricing.usage_api, kvgate.pricing.bench; "
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {sorted(FORBIDDEN)!r}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=PACKAGE.parent, check=True,
                         capture_output=True, text=True).stdout
    assert out.strip() == "[]"
