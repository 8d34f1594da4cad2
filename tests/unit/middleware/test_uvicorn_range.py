"""uvicorn is pinned to the range kvgate's HTTP front end was tested against
(middleware/transport/h1contract.py): its server builds ``H1Protocol`` through a contract of its own,
not a public API. These tests fail when the installed uvicorn is outside that range, or when
the front end imports a private uvicorn module again."""

from __future__ import annotations

import ast
import tomllib
from importlib.metadata import version
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[3]
#: The modules of the front end: none may import uvicorn's internals.
FRONT_END = ("h1server.py", "h1contract.py", "h1limits.py")


def _pinned() -> Requirement:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    found = [Requirement(d) for d in deps if Requirement(d).name == "uvicorn"]
    assert len(found) == 1, deps
    return found[0]


def test_uvicorn_is_pinned_to_a_bounded_range() -> None:
    spec = _pinned().specifier
    assert any(s.operator == "<" for s in spec) and any(s.operator == ">=" for s in spec), spec


def test_installed_uvicorn_is_inside_the_tested_range() -> None:
    installed = Version(version("uvicorn"))
    assert installed in _pinned().specifier, (
        f"uvicorn {installed} is outside {_pinned().specifier}: run tests/unit/middleware/"
        "test_h1server.py, test_h1limits.py and test_h1_smuggling.py against it, then widen "
        "the pin in pyproject.toml")


def test_the_front_end_imports_no_uvicorn_module() -> None:
    for name in FRONT_END:
        tree = ast.parse((ROOT / "middleware" / "transport" / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
            else:
                continue
            assert not any(m.split(".")[0] == "uvicorn" for m in modules), (name, modules)
