"""The quick start: flags -> engines, KV-event addresses, presets, tokenizer discovery."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest

from kvgate.middleware import cli
from kvgate.middleware.fleet.tokenizer_discovery import discover_tokenizer, find_local
from kvgate.middleware.framework.composition.quickstart import QuickStart, quick_start_config
from kvgate.middleware.framework.errors import ConfigError


@pytest.mark.parametrize(("qs", "expected"), [
    (QuickStart(engines=("http://a:1", "http://b:1")), [None, None]),
    (QuickStart(engines=("http://a:1", "http://b:1"), kv_events=("tcp://*:5557",)),
     ["tcp://*:5557", "tcp://*:5557"]),
    (QuickStart(engines=("http://a:1", "http://b:1"), kv_events=("tcp://a:1", "tcp://b:2")),
     ["tcp://a:1", "tcp://b:2"]),
    (QuickStart(prefill=("http://p:1",), decode=("http://d:1",), kv_events=("tcp://p:9", "tcp://d:9")),
     ["tcp://p:9", "tcp://d:9"]),
])
def test_kv_event_addresses_per_engine(qs: QuickStart, expected: list[str | None]) -> None:
    config = quick_start_config(qs)
    assert [e.kv_events for e in config.engines] == expected
    types = [p.type for p in config.plugins]
    assert ("kv-events" in types) is any(expected)
    assert "kv-placement-scorer" in types


def test_replay_sockets_per_engine_from_the_flags() -> None:
    args = cli.build_parser().parse_args([
        "serve", "--engine", "http://a:1", "--engine", "http://b:1", "--kv-events",
        "tcp://*:5557", "--kv-events-replay", "tcp://*:5757", "--tokenizer", "sim"])
    config = quick_start_config(cli.quick_start(args))
    assert [e.kv_events_replay for e in config.engines] == ["tcp://*:5757"] * 2


@pytest.mark.parametrize(("qs", "problem"), [
    (QuickStart(engines=("http://a:1", "http://b:1"), kv_events=("tcp://a:1",)), "'\\*' host"),
    (QuickStart(engines=("http://a:1",), kv_events=("tcp://a:1",),
                kv_events_replay=("tcp://a:2", "tcp://b:2")), "2 --kv-events-replay"),
    (QuickStart(engines=("http://a:1",), kv_events=("tcp://a:1", "tcp://b:1")), "2 --kv-events"),
    (QuickStart(engines=("http://a:1",), prefill=("http://p:1",), decode=("http://d:1",)),
     "not both"),
    (QuickStart(prefill=("http://p:1",)), "at least one --prefill and one --decode"),
    (QuickStart(), "no engine"),
    (QuickStart(prefill=("http://p:1",), decode=("http://d:1",), pd_protocol="x"), "P/D protocol"),
])
def test_refused(qs: QuickStart, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        quick_start_config(qs)


def test_unknown_preset() -> None:
    with pytest.raises(ConfigError, match="unknown preset 'nope'"):
        quick_start_config(QuickStart(engines=("http://a:1",)), preset="nope")


def test_bind_mode_and_tokenizer_kinds(tmp_path: Path) -> None:
    config = quick_start_config(QuickStart(engines=("http://a:1",), kv_events_bind="tcp://*:1",
                                           tokenizer=str(tmp_path)))
    params = {p.type: p.params for p in config.plugins}
    assert params["kv-events"] == {"connect": False, "bind": "tcp://*:1"}
    assert params["tokenizer"]["tokenizer"] == {"kind": "hf", "model_dir": str(tmp_path)}
    assert params["prefix-cache-producer"] == {"mode": "auto"}
    named = quick_start_config(QuickStart(engines=("http://a:1",), tokenizer="sim"))
    tok = next(p for p in named.plugins if p.type == "tokenizer")
    assert tok.params["tokenizer"] == {"kind": "module", "module": "sim"}


@pytest.fixture
def engine_models(tmp_path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """A stand-in engine answering ``GET /v1/models`` with ``payload`` (mutable)."""
    payload: dict[str, Any] = {"object": "list", "data": []}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            return

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", payload
    finally:
        server.shutdown()
        server.server_close()


def test_tokenizer_found_from_the_models_root(
    tmp_path: Path, engine_models: tuple[str, dict[str, Any]]
) -> None:
    url, payload = engine_models
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_text("{}")
    payload["data"] = [{"id": "served", "object": "model", "root": str(model)}]
    assert discover_tokenizer(url) == str(model)
    args = cli.build_parser().parse_args(["serve", "--engine", url, "--kv-events", "tcp://*:5"])
    assert cli.quick_start(args).tokenizer == str(model)


def test_no_tokenizer_found_warns_that_text_prompts_stay_approximate(
    engine_models: tuple[str, dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    url, payload = engine_models
    payload["data"] = [{"id": "org/absent-model", "object": "model", "root": "/nowhere/x"}]
    args = cli.build_parser().parse_args(["serve", "--engine", url, "--kv-events", "tcp://*:5"])
    with caplog.at_level(logging.WARNING, logger="kvgate.cli"):
        assert cli.quick_start(args).tokenizer is None
    assert "text prompts are routed on the gateway's own record (approximate)" in caplog.text
    assert "only prompts sent as token ids match the engines' KV events" in caplog.text
    assert discover_tokenizer("http://127.0.0.1:9") is None  # nothing listens


def test_hub_cache_snapshot(tmp_path: Path) -> None:
    snap = tmp_path / "models--org--m" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "tokenizer.json").write_text("{}")
    assert find_local("org/m", [tmp_path]) == snap
    assert find_local("org/other", [tmp_path]) is None
    assert find_local("no-slash", [tmp_path]) is None


def test_config_and_quick_start_flags_do_not_mix(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", "--config", "x.yaml", "--tokenizer", "/m"]) == 2
    assert "quick-start flags" in capsys.readouterr().err
