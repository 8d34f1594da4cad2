"""The access log (middleware/observe/access_log.py): exactly one JSON line per API request, on every
path, with the request's fields and never a secret (the API key, the raw session id)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvgate.engines.sim.core.faults import FaultSpec
from kvgate.engines.sim.testing import RunningSim
from kvgate.middleware.framework.composition.config import AccessLogConfig
from kvgate.middleware.framework.composition.quickstart import pd_config_data
from kvgate.middleware.observe.access_log import LOGGER, AccessLog, install_handler
from tests.integration.billing_helpers import Keys, billing_config, write_keys
from tests.integration.conftest import FAST_POOL, gateway, serve_gateway, sim_fleet

SESSION = "raw-session-0f3c9a"  # must never appear in a line
CHAT = {"model": "sim-model", "max_tokens": 5,
        "messages": [{"role": "user", "content": "hello " * 40}]}


def _lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == LOGGER]


def _one(caplog: pytest.LogCaptureFixture, rid: str) -> dict[str, Any]:
    """The one line of the request the client called ``rid`` (its x-request-id)."""
    found = [line for line in _lines(caplog) if line["client_request_id"] == rid]
    assert len(found) == 1, found
    return found[0]


def _no_secrets(caplog: pytest.LogCaptureFixture, keys: Keys) -> None:
    for record in caplog.records:
        if record.name == LOGGER:
            text = record.getMessage()
            assert SESSION not in text
            assert all(k not in text for k in (keys.admin, keys.user, keys.narrow, keys.budget))


def _config(sims: list[RunningSim], tmp: Path, keys: Keys) -> dict[str, Any]:
    data = billing_config([s.url for s in sims], tmp, keys,
                          plugins_before=[{"type": "session-affinity-scorer"}])
    data["profiles"][0]["plugins"].insert(2, {"ref": "session-affinity-scorer", "weight": 1})
    return data


# (name, request body changes, headers role, faults, expected status, expected error, checks)
CASES: list[tuple[str, dict[str, Any], str | None, FaultSpec | None, int, str | None]] = [
    ("json", {}, "user", None, 200, None),
    ("stream", {"stream": True, "stream_options": {"include_usage": True}}, "user", None, 200,
     None),
    ("no key", {}, None, None, 401, "invalid_api_key"),
    ("bad body", {"max_tokens": "many"}, "user", None, 400, "invalid_request_error"),
    ("model not allowed", {}, "narrow", None, 403, "model_not_allowed"),
    ("engine 503", {}, "user", FaultSpec(fail_next=2, status=503), 503, "no_healthy_engine"),
    ("dies mid-stream", {"stream": True, "max_tokens": 20}, "user",
     FaultSpec(drop_after_chunks=2), 200, "stream_broken"),
]


async def test_one_line_per_request_on_every_path(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    keys = write_keys(tmp_path)
    async with sim_fleet(1) as sims, \
            gateway(_config(sims, tmp_path, keys)) as (_, client):
        for name, change, role, faults, status, _ in CASES:
            if faults is not None:
                sims[0].faults.apply(faults)
            rid = name.replace(" ", "-")
            headers = {"x-request-id": rid, "x-session-id": SESSION,
                       **(keys.auth(role) if role else {})}
            resp = await client.post("/v1/chat/completions", json={**CHAT, **change},
                                     headers=headers)
            assert resp.status_code == status, (name, resp.text)
            sims[0].faults.clear()
        assert len(_lines(caplog)) == len(CASES)
        for name, _, role, _, status, error in CASES:
            line = _one(caplog, name.replace(" ", "-"))
            assert line["status"] == status, name
            assert line["api"] == "chat" and line["method"] == "POST", name
            assert line["path"] == "/v1/chat/completions"
            assert line["total_s"] >= 0
            if error is not None:
                assert line["error"] == error, (name, line)
            if role is None:
                assert line["tenant"] is None and line["key_id"] is None
            else:
                assert line["tenant"] == ("globex" if role == "user" else "acme"), name
                assert line["key_id"] is not None and line["key_id"] != getattr(keys, role)
        _check_served(caplog)
    _no_secrets(caplog, keys)


def _check_served(caplog: pytest.LogCaptureFixture) -> None:
    for rid in ("json", "stream"):
        line = _one(caplog, rid)
        assert line["engines"] == ["sim-0"] and line["profiles"] == ["default"]
        assert line["stream"] is (rid == "stream")
        assert line["model"] == "sim-model"
        assert line["prompt_tokens"] > 0 and line["output_tokens"] == 5
        assert line["cached_tokens"] is not None
        assert float(line["cost"]) > 0 and isinstance(line["cost"], str)
        assert line["session"].startswith("hs1:")  # the ledger's keyed digest
        assert line["affinity"] in {"new", "kept", "moved"}
        assert 0 <= line["ttfb_s"] <= line["total_s"]
        assert 0 < line["upstream_s"] <= line["total_s"]
    rejected = _one(caplog, "no-key")
    assert rejected["engines"] == [] and rejected["upstream_s"] is None
    assert rejected["prompt_tokens"] is None and rejected["cached_tokens"] is None
    assert _one(caplog, "engine-503")["engines"] == ["sim-0"]  # one engine: no retry target
    broken = _one(caplog, "dies-mid-stream")
    assert broken["output_tokens"] is None and broken["engines"] == ["sim-0"]


async def _until(predicate: Callable[[], bool]) -> None:
    for _ in range(500):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


async def test_client_disconnect_is_one_499_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    async with sim_fleet(1, time_scale=1.0) as sims, \
            serve_gateway({"engines": [{"name": "sim-0", "url": sims[0].url}],
                           "pool": FAST_POOL, "plugins": [{"type": "max-score-picker"}],
                           "profiles": [{"name": "default",
                                         "plugins": [{"ref": "max-score-picker"}]}]}) as (_, url):
        body = {**CHAT, "max_tokens": 2000, "ignore_eos": True, "stream": True}
        async with aiohttp.ClientSession() as session:
            resp = await session.post(url + "/v1/chat/completions", json=body,
                                      headers={"x-request-id": "leaves"})
            assert (await resp.content.readany()).startswith(b"data: ")
            resp.close()
        await _until(lambda: bool(_lines(caplog)))
        line = _one(caplog, "leaves")
        assert line["status"] == 499 and line["engines"] == ["sim-0"]
        assert line["ttfb_s"] is not None


async def test_two_hops_name_both_engines(caplog: pytest.LogCaptureFixture) -> None:
    from kvgate.engines.sim.core.config import PdSimConfig, SimConfig
    from kvgate.engines.sim.testing import serve_sim

    caplog.set_level(logging.INFO, logger=LOGGER)
    pd = PdSimConfig(bootstrap_port=0)
    async with serve_sim(SimConfig(engine_id="p0", role="prefill", time_scale=0.0, pd=pd)) as pre, \
            serve_sim(SimConfig(engine_id="d0", role="decode", time_scale=0.0, pd=pd)) as dec:
        data = pd_config_data([pre.url], [dec.url], "nixl")
        for plugin in data["plugins"]:
            if plugin["type"] == "pd-profile-handler":
                plugin["params"]["min_uncached_tokens"] = 0
        data["pool"] = FAST_POOL
        async with gateway(data) as (_, client):
            resp = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4},
                                     headers={"x-request-id": "pd"})
            assert resp.headers["x-kvgate-prefill-engine"] == "prefill-0"
    line = _one(caplog, "pd")
    assert line["status"] == 200
    assert sorted(line["engines"]) == ["decode-0", "prefill:prefill-0"]
    assert line["output_tokens"] == 4 and line["prompt_tokens"] > 0


async def test_disabled_writes_nothing_and_file_handler_writes_json(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    async with sim_fleet(1) as sims:
        data = {"engines": [{"name": "sim-0", "url": sims[0].url}], "pool": FAST_POOL,
                "plugins": [{"type": "max-score-picker"}],
                "profiles": [{"name": "default", "plugins": [{"ref": "max-score-picker"}]}]}
        off = {**data, "server": {"access_log": {"enabled": False}}}
        async with gateway(off) as (app, client):
            assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
            assert isinstance(app.gateway.access_log, AccessLog)
        assert _lines(caplog) == []
        path = tmp_path / "access.jsonl"
        install_handler(AccessLogConfig(path=str(path)))
        try:
            async with gateway(data) as (_, client):
                for _ in range(2):
                    assert (await client.post("/v1/chat/completions",
                                              json=CHAT)).status_code == 200
        finally:
            install_handler(AccessLogConfig(enabled=False))  # removes the file handler
            logging.getLogger(LOGGER).propagate = True
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["status"] for r in rows] == [200, 200]
    assert len({r["request_id"] for r in rows}) == 2


@pytest.mark.parametrize("bad", [{"enabled": "maybe"}, {"path": ""}, {"file": "x"}])
def test_access_log_config_is_strict(bad: dict[str, Any]) -> None:
    from kvgate.middleware.framework.composition.config import parse_config
    from kvgate.middleware.framework.errors import ConfigError

    with pytest.raises(ConfigError):
        parse_config({"server": {"access_log": bad}, "engines": [{"name": "e", "url": "http://x"}],
                      "plugins": [{"type": "max-score-picker"}],
                      "profiles": [{"name": "d", "plugins": [{"ref": "max-score-picker"}]}]},
                     "test")

