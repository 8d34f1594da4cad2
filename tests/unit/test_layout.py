"""The house's plan, held against the code (docs/architecture.md, "Layout").

Product code is what installs as ``kvgate``: the folders ``middleware/``, ``plugins/``,
``engines/``, ``pricing/``, ``apis/`` and ``asyncq/``. Every import is counted, also those under
``TYPE_CHECKING`` and inside functions: a circle kept alive by a local import is still a circle.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("middleware", "plugins", "engines", "pricing", "apis", "asyncq")
OLD_ROOTS = re.compile(r"^(?:" + "|".join(ROOTS) + r")(?:\.|$)")
MAX_MODULES = 12
MAX_LINES = 500
MAX_FUNCTION_LINES = 60

#: What a plugin capability may import besides the framework, pricing, ``plugins.common`` and
#: itself: its declared neighbours, each with the reason.
NEIGHBOURS: dict[str, dict[str, str]] = {
    "placement": {"load": "placement charges and reads the token load of each engine"},
    "pd": {"load": "the prefill/decode pools are balanced by their in-flight tokens"},
    "prefix": {"load": "the shared record rides on the shared-load Redis connection"},
    "billing": {"tenancy": "records carry the tenant and are signed with the gateway secret"},
    "quotas": {"tenancy": "limits are per key and tenant",
               "billing": "budgets are settled from the billed cost"},
    "tenancy": {"load": "`kvgate isolation` reports what session affinity hashes"},
    "flow": {"load": "tenants' served tokens ride on the replicas' shared-load exchange"},
}
#: Single modules outside the framework a plugin module may import, with the reason.
EXCEPTIONS: dict[str, dict[str, str]] = {
    "kvgate.plugins.tenancy.keys_admin": {
        "kvgate.middleware.transport.fastapi_errors":
            "the admin API is a FastAPI app: its errors use the front end's one mapping"},
}


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    tree: ast.Module


def _name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return "kvgate." + ".".join(parts)


@cache
def modules() -> dict[str, Module]:
    out = {}
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            name = _name(path)
            out[name] = Module(name, path, ast.parse(path.read_text(), str(path)))
    return out


def imported(mod: Module) -> Iterator[tuple[str, int]]:
    """Every ``kvgate`` module ``mod`` imports (a name imported from a package counts as the
    module of that name when there is one), with the line."""
    known = modules()
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                yield (full if full in known else node.module), node.lineno


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: {dep for dep, _ in imported(mod) if dep in known and dep != name}
            for name, mod in known.items()}


def test_product_code_imports_only_through_kvgate() -> None:
    bad = [f"{mod.path.relative_to(REPO)}:{line}: {dep}" for mod in modules().values()
           for dep, line in imported(mod) if OLD_ROOTS.match(dep)]
    assert bad == []


def test_tests_and_benchmarks_import_through_kvgate() -> None:
    bad = []
    for folder in ("tests", "bench"):
        for path in (REPO / folder).rglob("*.py"):
            for dep, line in imported(Module("", path, ast.parse(path.read_text()))):
                if OLD_ROOTS.match(dep):
                    bad.append(f"{path.relative_to(REPO)}:{line}: {dep}")
    assert bad == []


def test_no_folder_over_the_module_limit() -> None:
    counts: dict[Path, int] = {}
    for mod in modules().values():
        if mod.path.name not in ("__init__.py", "__main__.py"):
            counts[mod.path.parent] = counts.get(mod.path.parent, 0) + 1
    over = {str(p.relative_to(REPO)): n for p, n in counts.items() if n > MAX_MODULES}
    assert over == {}


def test_no_module_over_the_line_limit() -> None:
    over = {str(m.path.relative_to(REPO)): n for m in modules().values()
            if (n := len(m.path.read_text().splitlines())) > MAX_LINES}
    assert over == {}


def test_no_function_over_the_line_limit() -> None:
    over = [f"{m.path.relative_to(REPO)}:{node.lineno} {node.name} ({size} lines)"
            for m in modules().values() for node in ast.walk(m.tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and (size := (node.end_lineno or node.lineno) - node.lineno + 1) > MAX_FUNCTION_LINES]
    assert over == []


def test_every_capability_folder_has_a_readme() -> None:
    missing = [str(p.relative_to(REPO)) for p in (REPO / "plugins").iterdir()
               if p.is_dir() and p.name != "__pycache__" and not (p / "README.md").is_file()]
    assert missing == []


def _violations(prefix: str, allowed: tuple[str, ...]) -> list[str]:
    out = []
    for name, deps in graph().items():
        if name.startswith(prefix):
            out += [f"{name} -> {dep}" for dep in sorted(deps)
                    if not dep.startswith(allowed) and dep not in EXCEPTIONS.get(name, {})]
    return out


def test_framework_imports_nothing_of_the_rest_of_the_gateway() -> None:
    allowed = ("kvgate.middleware.framework", "kvgate.pricing")
    assert _violations("kvgate.middleware.framework", allowed) == []


@pytest.mark.parametrize("capability", sorted(
    p.name for p in (REPO / "plugins").iterdir() if p.is_dir() and p.name != "__pycache__"))
def test_plugins_import_the_framework_pricing_and_declared_neighbours(capability: str) -> None:
    allowed = ("kvgate.middleware.framework", "kvgate.pricing", "kvgate.plugins.common",
               f"kvgate.plugins.{capability}",
               *(f"kvgate.plugins.{n}" for n in NEIGHBOURS.get(capability, {})))
    assert _violations(f"kvgate.plugins.{capability}", allowed) == []


def test_the_core_never_names_a_plugin_or_an_engine() -> None:
    allowed = ("kvgate.middleware", "kvgate.pricing", "kvgate.apis")
    assert _violations("kvgate.middleware", allowed) == []


def _cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in g:
        if root in index:
            continue
        work = [(root, iter(sorted(g[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(g[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_circles() -> None:
    assert _cycles(graph()) == []


@pytest.mark.parametrize(("g", "expected"), [
    ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"a"}}, []),
])
def test_the_circle_finder_itself(g: dict[str, set[str]], expected: list[list[str]]) -> None:
    assert _cycles(g) == expected
