"""Idempotent private virtual environments for benchmark tools (peer routers, py-spy), and wrk.

Each tool lives in its own venv under ``.kvgate/bench-venvs/<name>`` (git-ignored), so its
dependencies never touch the gateway's venv. A marker file records the requirement that was
installed; a venv whose marker matches is reused as is.

wrk (the closed-loop load driver, see :mod:`bench.wrkload`) is a Debian package: installed with
``apt-get`` when missing and this process runs as root.

Run ``python -m bench.venvs`` to create them all (and install wrk) ahead of time.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

DEFAULT_ROOT = Path(".kvgate/bench-venvs")
MARKER = "kvgate-bench-requirement.txt"


@dataclass(frozen=True)
class Tool:
    """One installable tool: its venv name and the exact pip requirement."""

    name: str
    requirement: str


SGLANG_ROUTER = Tool("sglang-router", "sglang-router==0.3.2")
VLLM_ROUTER = Tool("vllm-router", "vllm-router==0.1.17")
PY_SPY = Tool("py-spy", "py-spy==0.4.3")
ALL_TOOLS = (SGLANG_ROUTER, VLLM_ROUTER, PY_SPY)


def venv_dir(tool: Tool, root: Path = DEFAULT_ROOT) -> Path:
    """Where ``tool``'s venv lives."""
    return root / tool.name


def bin_path(tool: Tool, program: str, root: Path = DEFAULT_ROOT) -> Path:
    """Path of ``program`` inside ``tool``'s venv."""
    return venv_dir(tool, root) / "bin" / program


def is_ready(tool: Tool, root: Path = DEFAULT_ROOT) -> bool:
    """True when the venv exists and holds exactly ``tool.requirement``."""
    marker = venv_dir(tool, root) / MARKER
    python = bin_path(tool, "python", root)
    return python.exists() and marker.exists() and marker.read_text().strip() == tool.requirement


def ensure(tool: Tool, root: Path = DEFAULT_ROOT, log: bool = True) -> Path:
    """Create (or repair) ``tool``'s venv if needed; return the venv folder."""
    target = venv_dir(tool, root)
    if is_ready(tool, root):
        return target
    if log:
        print(f"[setup] installing {tool.requirement} into {target} ...", file=sys.stderr)
    target.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(target)], check=True)
    pip = [str(target / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, tool.requirement], check=True)
    (target / MARKER).write_text(tool.requirement + "\n")
    return target


def ensure_all(tools: Sequence[Tool], root: Path = DEFAULT_ROOT) -> None:
    """:func:`ensure` each of ``tools``."""
    for tool in tools:
        ensure(tool, root)


def ensure_wrk(log: bool = True) -> bool:
    """Install Debian's wrk if it is missing (root + apt-get only); True when wrk is on PATH."""
    if shutil.which("wrk"):
        return True
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return False
    if log:
        print("[setup] installing wrk with apt-get ...", file=sys.stderr)
    install = ["apt-get", "install", "-y", "-qq", "wrk"]
    if _quiet(install) != 0:
        _quiet(["apt-get", "update", "-qq"])
        _quiet(install)
    return shutil.which("wrk") is not None


def _quiet(argv: Sequence[str]) -> int:
    """Run a command with its output discarded; return its exit status."""
    done = subprocess.run(argv, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return done.returncode


def closed_loop_tool(choice: str, may_install: bool) -> str:
    """Resolve ``auto``/``wrk``/``aiohttp`` to the tool that will drive the closed loop."""
    if choice == "aiohttp":
        return "aiohttp"
    have = ensure_wrk() if may_install or choice == "wrk" else shutil.which("wrk") is not None
    if have:
        return "wrk"
    if choice == "wrk":
        raise SystemExit("wrk is missing and could not be installed (try --closed-tool aiohttp)")
    print("[setup] wrk unavailable: closed loop falls back to the aiohttp client, whose ceiling "
          "on the shared core may cap the fastest systems", file=sys.stderr)
    return "aiohttp"


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point: create every benchmark venv (or the named ones)."""
    names = {tool.name: tool for tool in ALL_TOOLS}
    parser = argparse.ArgumentParser(description="Create the benchmark tools' private venvs.")
    parser.add_argument("tools", nargs="*", help=f"any of {', '.join(names)} (default: all)")
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT)
    args = parser.parse_args(argv)
    unknown = sorted(set(args.tools) - set(names))
    if unknown:
        parser.error(f"unknown tool(s): {', '.join(unknown)}")
    chosen = [names[n] for n in args.tools] or list(ALL_TOOLS)
    ensure_all(chosen, args.root)
    for tool in chosen:
        print(f"{tool.requirement}: {venv_dir(tool, args.root)}")
    print(f"wrk: {shutil.which('wrk') if ensure_wrk() else 'not available'}")


if __name__ == "__main__":
    main()
