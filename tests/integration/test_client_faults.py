"""Faults a client causes stay with that client (docs/security.md, "Client faults and the
breaker"): an input every engine refuses or fails on never opens an engine's circuit breaker,
so another tenant is still served; an engine's error reaches the client in the API's own
shape, with the engine's status and message, without tracebacks, addresses or paths."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvgate.engines.sim.core.faults import FaultSpec
from kvgate.engines.sim.testing import RunningSim
from kvgate.middleware.app import KvgateApp
from kvgate.middleware.framework.redact import MAX_MESSAGE_CHARS
from tests.integration.billing_helpers import Keys, write_keys
from tests.integration.conftest import gateway, gateway_config, sim_fleet

POISON = "poison-input-7f3a"
CHAT = {"model": "sim-model", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
MESSAGES = {"model": "sim-model", "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}]}
NO_PROBES = {"health_interval_s": 30, "metrics_interval_s": 30}


@contextlib.asynccontextmanager
async def _keyed(sims: list[RunningSim], tmp: Path, picker: str = "max-score-picker",
                 ) -> AsyncIterator[tuple[KvgateApp, httpx.AsyncClient, Keys]]:
    """The gateway over ``sims`` with API keys on (globex: "user", acme: "admin")."""
    keys = write_keys(tmp)
    data = gateway_config([s.url for s in sims], picker, pool=NO_PROBES)
    data["plugins"] = [{"type": "api-keys", "params": {"file": str(keys.path)}},
                       *data["plugins"]]
    async with gateway(data) as (app, client):
        yield app, client, keys


def _poisoned(text: str = POISON) -> dict[str, Any]:
    return {**CHAT, "messages": [{"role": "user", "content": f"please {text}"}]}


#: (case, the engines' answer to globex's input, the status globex gets)
CLIENT_FAULTS: list[tuple[str, int, int]] = [
    ("engine 400", 400, 400),
    ("engine 404", 404, 404),
    ("engine 413", 413, 413),
    ("engine 422", 422, 422),
    ("engine 408: load, retried elsewhere, a gateway timeout", 408, 504),
    ("engine 429: load, retried elsewhere", 429, 502),
    ("engine 500 on every engine: the input's fault", 500, 502),
    ("engine 503 on every engine: the input's fault", 503, 502),
]


@pytest.mark.parametrize(("case", "engine_status", "client_status"), CLIENT_FAULTS,
                         ids=[c[0] for c in CLIENT_FAULTS])
async def test_one_clients_failing_input_opens_no_breaker(
        tmp_path: Path, case: str, engine_status: int, client_status: int) -> None:
    """Five requests in a row that every engine fails (the input is the cause) leave both
    breakers closed; another tenant's request is served."""
    async with sim_fleet(2) as sims, _keyed(sims, tmp_path) as (app, client, keys):
        for sim in sims:
            sim.faults.apply(FaultSpec(fail_next=100, status=engine_status, match=POISON))
        for _ in range(5):
            resp = await client.post("/v1/chat/completions", json=_poisoned(),
                                     headers=keys.auth("user"))
            assert resp.status_code == client_status, resp.text
            assert set(resp.json()) == {"error"}
        assert app.pool.breaker_states() == {"sim-0": 0.0, "sim-1": 0.0}
        other = await client.post("/v1/chat/completions", json=CHAT, headers=keys.auth("admin"))
        assert other.status_code == 200, other.text


async def test_an_engine_failing_everyone_still_opens_its_breaker(tmp_path: Path) -> None:
    """The engine's own fault (it fails every request, another engine serves them) still
    counts: three in a row open its breaker, and the clients never see it."""
    async with sim_fleet(2) as sims, \
            _keyed(sims, tmp_path, "round-robin-picker") as (app, client, keys):
        sims[0].faults.apply(FaultSpec(fail_next=100, status=500))
        for _ in range(6):  # round robin: sim-0 is tried first in every other request
            resp = await client.post("/v1/chat/completions", json=CHAT,
                                     headers=keys.auth("user"))
            assert resp.status_code == 200 and resp.headers["x-kvgate-engine"] == "sim-1"
        assert app.pool.breaker_states() == {"sim-0": 2.0, "sim-1": 0.0}


TRACEBACK = ('Traceback (most recent call last):\n  File "/opt/vllm/entrypoints/serving.py", '
             'line 212, in create\n    raise ValueError(msg)\nValueError: prompt of 9000 '
             'tokens is longer than /models/qwen3-8b allows (engine http://10.1.2.3:8000)')
CLEAN = "ValueError: prompt of 9000 tokens is longer than <path> allows (engine <address>)"
OPENAI = "openai"
ANTHROPIC = "anthropic"
#: (case, path, body, engine status, engine message, API shape, message the client gets)
SHAPES: list[tuple[str, str, dict[str, Any], int, str, str, str]] = [
    ("chat: traceback", "/v1/chat/completions", CHAT, 400, TRACEBACK, OPENAI, CLEAN),
    ("chat stream: traceback", "/v1/chat/completions", {**CHAT, "stream": True}, 400,
     TRACEBACK, OPENAI, CLEAN),
    ("chat: 422 message kept", "/v1/chat/completions", CHAT, 422,
     "temperature: Input should be a valid number", OPENAI,
     "temperature: Input should be a valid number"),
    ("chat: long message capped", "/v1/chat/completions", CHAT, 400, "x" * 5000, OPENAI,
     "x" * (MAX_MESSAGE_CHARS - 1) + "…"),
    ("messages: traceback", "/v1/messages", MESSAGES, 400, TRACEBACK, ANTHROPIC, CLEAN),
    ("messages: 404 message kept", "/v1/messages", MESSAGES, 404, "no such LoRA adapter",
     ANTHROPIC, "no such LoRA adapter"),
]


@pytest.mark.parametrize(("case", "path", "body", "status", "engine_message", "shape",
                          "message"), SHAPES, ids=[c[0] for c in SHAPES])
async def test_engine_errors_reach_the_client_in_the_apis_shape(
        tmp_path: Path, case: str, path: str, body: dict[str, Any], status: int,
        engine_message: str, shape: str, message: str) -> None:
    async with sim_fleet(1) as sims, _keyed(sims, tmp_path) as (_, client, keys):
        sims[0].faults.apply(FaultSpec(fail_next=1, status=status, message=engine_message))
        resp = await client.post(path, json=body, headers=keys.auth("user"))
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"] == "application/json"
    if shape == OPENAI:
        assert resp.json() == {"error": {"message": message, "type": "invalid_request_error",
                                         "param": None, "code": None}}
    else:
        kind = {400: "invalid_request_error", 404: "not_found_error"}[status]
        assert resp.json() == {"type": "error", "error": {"type": kind, "message": message}}


#: (case, path, body, API shape): a real engine refusal (a prompt over max_model_len).
TOO_LONG: list[tuple[str, str, dict[str, Any], str]] = [
    ("chat", "/v1/chat/completions", CHAT, OPENAI),
    ("messages", "/v1/messages", MESSAGES, ANTHROPIC),
]


@pytest.mark.parametrize(("case", "path", "body", "shape"), TOO_LONG,
                         ids=[c[0] for c in TOO_LONG])
async def test_a_prompt_over_max_model_len_in_the_apis_shape(
        tmp_path: Path, case: str, path: str, body: dict[str, Any], shape: str) -> None:
    """vLLM's own refusal (the simulator's: status 400, ``type`` BadRequestError, ``code``
    400) becomes the API's error with the engine's message; five leave the breaker closed."""
    long = {**body, "messages": [{"role": "user", "content": "word " * 500}]}
    async with sim_fleet(1, max_model_len=64) as sims, \
            _keyed(sims, tmp_path) as (app, client, keys):
        for _ in range(5):
            resp = await client.post(path, json=long, headers=keys.auth("user"))
            assert resp.status_code == 400, resp.text
        assert app.pool.breaker_states() == {"sim-0": 0.0}
        served = await client.post(path, json=body, headers=keys.auth("admin"))
        assert served.status_code == 200, served.text
    answer = resp.json()
    if shape == OPENAI:
        assert set(answer) == {"error"} and answer["error"]["type"] == "invalid_request_error"
        assert answer["error"]["code"] is None
        error = answer["error"]
    else:
        assert answer["type"] == "error" and set(answer["error"]) == {"type", "message"}
        error = answer["error"]
    assert error["message"].startswith("This model's maximum context length is 64 tokens")
