"""Shared by the ``kvgate serve`` command-line tests: the config the command would serve."""

from __future__ import annotations

import pytest

from kvgate.middleware import cli
from kvgate.middleware.framework.composition.config import GatewayConfig


def served_config(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> GatewayConfig:
    """Run ``kvgate serve ARGV`` with the server replaced: the config it would have served."""
    seen: list[GatewayConfig] = []

    def fake_serve(config: GatewayConfig, workers: int = 1, http: str = "kvgate") -> int:
        seen.append(config)
        return 0

    monkeypatch.setattr(cli, "serve_config", fake_serve)
    assert cli.main(["serve", *argv]) == 0
    return seen[0]
