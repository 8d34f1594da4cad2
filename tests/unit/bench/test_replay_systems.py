"""bench.replay_systems: the quick start's config with tuned placement params."""

from __future__ import annotations

import pytest

from bench.replay_systems import tuned_quick_start
from kvgate.middleware.framework.composition.config import parse_config


@pytest.mark.parametrize("params", [{"load_weight": 0.0}, {"load_weight": 0.02, "pin_tokens": 0}])
def test_tuned_quick_start_is_the_quick_start_with_the_params_merged(
    params: dict[str, float],
) -> None:
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    data = tuned_quick_start(urls, 9000, "tcp://127.0.0.1:5557", params)
    config = parse_config(data, "test")
    placement = [p for p in config.plugins if p.type == "kv-placement-scorer"]
    assert len(placement) == 1
    assert placement[0].params == {"load": "token-load-scorer", **params}
    assert [e.url for e in config.engines] == urls and config.server.port == 9000
    events = [p for p in config.plugins if p.type == "kv-events"]
    assert events[0].params["bind"] == "tcp://127.0.0.1:5557"
