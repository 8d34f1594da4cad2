"""``kvgate serve --prefill URL --decode URL [--pd-protocol ...]``: the P/D quick start."""

from __future__ import annotations

import pytest

from kvgate.middleware import cli
from kvgate.middleware.framework.composition.pipeline import build_pipeline
from kvgate.middleware.framework.composition.registry import Registry
from kvgate.middleware.framework.types import Role
from tests.cli_helpers import served_config

_serve = served_config


@pytest.mark.parametrize(("flags", "connector"), [
    ([], "vllm-nixl"), (["--pd-protocol", "nixl"], "vllm-nixl"),
    (["--pd-protocol", "mooncake"], "vllm-mooncake"), (["--pd-protocol", "sglang"], "sglang"),
])
def test_pd_quick_start(monkeypatch: pytest.MonkeyPatch, flags: list[str],
                        connector: str) -> None:
    config = _serve(monkeypatch, ["--prefill", "http://p0:8000", "--prefill", "http://p1:8000",
                                  "--decode", "http://d0:8000", "--port", "9000", *flags])
    assert config.server.port == 9000
    assert [(e.name, e.role) for e in config.engines] == [
        ("prefill-0", Role.PREFILL), ("prefill-1", Role.PREFILL), ("decode-0", Role.DECODE)]
    assert config.disaggregation is not None
    assert config.disaggregation.connector == connector
    assert config.profile_handler == "pd-profile-handler"
    pipeline = build_pipeline(config, Registry.from_entry_points())  # composes with real plugins
    assert pipeline.connector is not None and type(pipeline.connector).name == connector


@pytest.mark.parametrize("argv", [
    ["--prefill", "http://p:1"],  # no decode engine
    ["--decode", "http://d:1"],  # no prefill engine
    ["--prefill", "http://p:1", "--decode", "http://d:1", "--engine", "http://e:1"],
])
def test_pd_quick_start_refuses(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", *argv]) == 2
    assert "configuration error" in capsys.readouterr().err
