"""The built wheel, installed with no extras into a fresh virtual environment, outside the checkout.

What a user gets from ``pip install kvgate``: one import name at the top of site-packages
(``kvgate``; the folders ``middleware/``, ``plugins/``, … install as ``kvgate.middleware``, …),
a ``kvgate`` command whose ``--help`` works without any extra (no ``httpx``, ``redis``,
``psycopg``, ``litellm`` or OpenTelemetry), and ``kvgate demo`` answering a chat completion.
Every command runs from a temporary folder so that nothing of the checkout is importable.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvgate.engines.ports import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
#: Extras-only distributions that must not be needed by the base install (fastapi itself
#: requires opentelemetry-api, so the SDK is what the `tracing` extra adds).
EXTRAS_ONLY = ("httpx", "redis", "psycopg", "litellm", "opentelemetry.sdk", "openai",
               "anthropic")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # Built from a copy of the tracked files: setuptools writes build/ and *.egg-info beside
    # its sources, which must not land in the checkout.
    source = tmp_path_factory.mktemp("source") / "kvgate"
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, check=True,
                             capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, tracked):
        src, dst = REPO / rel, source / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            dst.symlink_to(src.readlink())
        elif src.is_file():
            shutil.copy2(src, dst)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out),
                    str(source)], check=True, timeout=600)
    (built,) = out.glob("kvgate-*.whl")
    return built


@pytest.fixture(scope="module")
def fresh_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = tmp_path_factory.mktemp("fresh") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", str(wheel)], check=True,
                   timeout=900)
    return venv


def test_wheel_installs_one_import_name(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        tops = {name.split("/")[0] for name in zf.namelist()}
        names = zf.namelist()
    assert {t for t in tops if not t.endswith(".dist-info")} == {"kvgate"}
    for folder in ("middleware", "plugins", "engines", "pricing", "apis", "asyncq"):
        assert f"kvgate/{folder}/__init__.py" in names
    assert "kvgate/engines/local/requirements-engine.txt" in names


def test_base_install_has_no_extras(fresh_venv: Path, tmp_path: Path) -> None:
    code = ("import importlib.util, json; print(json.dumps({n: importlib.util.find_spec(n) "
            f"is not None for n in {EXTRAS_ONLY!r}}}))")
    out = subprocess.run([str(fresh_venv / "bin" / "python"), "-c", code], cwd=tmp_path,
                         check=True, capture_output=True, text=True, timeout=60).stdout
    present = [name for name, found in json.loads(out).items() if found]
    assert present == [], f"the base install pulled in extras: {present}"


def test_help_without_extras(fresh_venv: Path, tmp_path: Path) -> None:
    for argv in (["--help"], ["serve", "--help"], ["demo", "--help"], ["keys", "--help"]):
        run = subprocess.run([str(fresh_venv / "bin" / "kvgate"), *argv], cwd=tmp_path,
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, (argv, run.stderr[-2000:])
        assert "usage:" in run.stdout


@pytest.fixture
def demo(fresh_venv: Path, tmp_path: Path) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [str(fresh_venv / "bin" / "kvgate"), "demo", "--engines", "2", "--time-scale", "0",
         "--port", str(port), "--duration", "120"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                with urllib.request.urlopen(f"{base}/v1/models", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                time.sleep(0.3)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_demo_answers_a_chat_completion(demo: str) -> None:
    with urllib.request.urlopen(f"{demo}/v1/models", timeout=10) as resp:
        model = json.loads(resp.read())["data"][0]["id"]
    body = json.dumps({"model": model, "max_tokens": 8,
                       "messages": [{"role": "user", "content": "hello"}]}).encode()
    req = urllib.request.Request(f"{demo}/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        answer = json.loads(resp.read())
    assert answer["object"] == "chat.completion"
    assert answer["choices"][0]["message"]["content"]
    assert answer["usage"]["prompt_tokens"] > 0
