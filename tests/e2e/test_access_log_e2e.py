"""``kvgate serve`` writes its access log as pure JSON lines: on stderr by default (between the
gateway's own log lines, each access line a JSON object), in ``server.access_log.path`` when set
(and then not on stderr). One ``kvgate sim`` engine, one gateway process per case."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.servers import free_port, running_process

KVGATE = str(Path(sys.executable).with_name("kvgate"))


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("sim")
    url = f"http://127.0.0.1:{free_port()}"
    with running_process([KVGATE, "sim", "--port", url.rsplit(":", 1)[1]], url + "/health",
                         log=tmp / "sim.log", limit_s=60):
        yield url


@contextlib.contextmanager
def gateway(tmp: Path, engine: str, access_log: dict[str, Any]) -> Iterator[str]:
    port = free_port()
    config = {"server": {"port": port, "access_log": access_log},
              "engines": [{"name": "sim-0", "url": engine}],
              "plugins": [{"type": "max-score-picker"}],
              "profiles": [{"name": "default", "plugins": [{"ref": "max-score-picker"}]}]}
    path = tmp / "kvgate.yaml"
    path.write_text(yaml.safe_dump(config))
    url = f"http://127.0.0.1:{port}"
    with running_process([KVGATE, "serve", "--config", str(path)], url + "/v1/models",
                         log=tmp / "kvgate.log", limit_s=60):
        yield url


def _ask(url: str, rid: str) -> None:
    resp = httpx.post(url + "/v1/chat/completions", timeout=30, headers={"x-request-id": rid},
                      json={"model": "sim-model", "max_tokens": 3,
                            "messages": [{"role": "user", "content": "hi"}]})
    assert resp.status_code == 200, resp.text


def _json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("to_file", [False, True])
def test_serve_writes_one_json_line_per_request(engine: str, tmp_path: Path,
                                                to_file: bool) -> None:
    target = tmp_path / "access.jsonl"
    with gateway(tmp_path, engine, {"path": str(target)} if to_file else {}) as url:
        for rid in ("one", "two"):
            _ask(url, rid)
        missing = httpx.post(url + "/v1/chat/completions", json={"model": "nope"}, timeout=30)
        assert missing.status_code == 400
    stderr = (tmp_path / "kvgate.log").read_text()
    lines = _json_lines(target.read_text() if to_file else stderr)
    assert [(r["client_request_id"], r["status"]) for r in lines] == [
        ("one", 200), ("two", 200), (None, 400)]
    assert all(r["engines"] == ["sim-0"] for r in lines[:2])
    if to_file:
        assert _json_lines(stderr) == []  # not also on stderr
    else:
        assert "kvgate ready" in stderr  # the gateway's own log is still there
