"""``kvgate serve --otlp-endpoint URL``: tracing on from the command line, in the quick start
and over a config file (its other tracing settings kept); a bad URL fails at startup."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvgate.middleware import cli
from tests.cli_helpers import served_config

_serve = served_config


def test_quick_start_without_the_flag_does_not_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _serve(monkeypatch, ["--engine", "http://e0:8000"]).tracing is None


def test_quick_start_with_the_flag_traces(monkeypatch: pytest.MonkeyPatch) -> None:
    config = _serve(monkeypatch, ["--engine", "http://e0:8000",
                                  "--otlp-endpoint", "http://collector:4318"])
    assert config.tracing is not None
    assert config.tracing.otlp_endpoint == "http://collector:4318"
    assert config.tracing.service_name == "kvgate"


def test_flag_overrides_only_the_endpoint_of_a_config(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    path = tmp_path / "kvgate.yaml"
    path.write_text(yaml.safe_dump({
        "engines": [{"name": "e0", "url": "http://e0:8000"}],
        "tracing": {"otlp_endpoint": "http://old:4318", "service_name": "gw-eu",
                    "sample_ratio": 0.25}}))
    config = _serve(monkeypatch, ["--config", str(path), "--otlp-endpoint", "https://new:4318"])
    assert config.tracing is not None
    assert (config.tracing.otlp_endpoint, config.tracing.service_name,
            config.tracing.sample_ratio) == ("https://new:4318", "gw-eu", 0.25)


def test_bad_endpoint_is_a_startup_error(monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(cli, "serve_config", lambda config, workers=1, http="kvgate": 0)
    assert cli.main(["serve", "--engine", "http://e0:8000", "--otlp-endpoint", "collector"]) == 2
    assert "--otlp-endpoint 'collector': not an http(s) URL" in capsys.readouterr().err
