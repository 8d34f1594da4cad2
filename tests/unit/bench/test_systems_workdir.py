"""bench/systems.py starts kvgate systems in a fresh working directory each launch, so one
launch never restores another's routing state (``.kvgate/routing-state``), and removes it."""

from __future__ import annotations

import http.server
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import systems
from bench.systems import System

#: A tiny HTTP server that answers /health and reports its working directory.
_SERVER = (
    "import http.server, os, sys\n"
    "class H(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        body = os.getcwd().encode()\n"
    "        self.send_response(200); self.send_header('content-length', str(len(body)))\n"
    "        self.end_headers(); self.wfile.write(body)\n"
    "    def log_message(self, *a): pass\n"
    "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n"
)


def _argv(_upstream: str, port: int, _aux: int, _root: Path) -> list[str]:
    return [sys.executable, "-c", _SERVER, str(port)]


@pytest.fixture
def upstream() -> Iterator[str]:
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


@pytest.mark.parametrize("own_workdir", [True, False])
def test_launch_working_directory(tmp_path: Path, upstream: str, own_workdir: bool) -> None:
    system = System("probe", _argv, own_workdir=own_workdir)
    seen: list[Path] = []
    for _ in range(2):
        with (systems.launched(system, upstream, 0, tmp_path / "log", tmp_path) as endpoint,
              urllib.request.urlopen(endpoint.base_url + "/") as r):
            seen.append(Path(r.read().decode()))
    if own_workdir:
        assert seen[0] != seen[1] and all(p.name.startswith("kvgate-bench-") for p in seen)
        assert not any(p.exists() for p in seen)  # removed after each launch
    else:
        assert seen == [Path.cwd(), Path.cwd()]


def test_every_kvgate_system_gets_its_own_workdir() -> None:
    kvgates = [s for name, s in systems.catalogue().items() if name.startswith("kvgate")]
    assert len(kvgates) == 7 and all(s.own_workdir for s in kvgates)  # + aiohttp, granian
