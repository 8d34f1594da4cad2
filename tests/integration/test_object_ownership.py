"""Every id a client sends is checked against its owner before anything reaches an engine.

Two tenants (acme, globex) behind one gateway with API keys, in front of simulated engines
whose Responses store, like vLLM's, serves any id to anyone. acme's stored response must be
invisible to globex on every route that takes it (404 in the Responses API's shape) and must
never reach an engine on globex's behalf: before the fix, globex's ``previous_response_id``
set to acme's id was served with acme's conversation in globex's prompt.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from engines.sim.testing import RunningSim
from tests.integration.billing_helpers import Keys, billing_config, write_keys
from tests.integration.conftest import gateway

MODEL = "sim-model"


async def _finished(fleet: list[RunningSim]) -> float:
    """Requests the engines finished (all reasons), from their own /metrics."""
    total = 0.0
    for sim in fleet:
        async with httpx.AsyncClient(base_url=sim.url) as c:
            for line in (await c.get("/metrics")).text.splitlines():
                if line.startswith("vllm:request_success_total{"):
                    total += float(line.rsplit(" ", 1)[1])
    return total


def _routes(acme_id: str) -> list[tuple[str, str, str, dict[str, Any] | None]]:
    """(name, method, path, body) of every route that takes a Responses id."""
    return [
        ("previous_response_id", "POST", "/v1/responses",
         {"model": MODEL, "input": "what did I say?", "previous_response_id": acme_id,
          "max_output_tokens": 2}),
        ("previous_response_id streamed", "POST", "/v1/responses",
         {"model": MODEL, "input": "what did I say?", "previous_response_id": acme_id,
          "max_output_tokens": 2, "stream": True}),
        ("retrieve", "GET", f"/v1/responses/{acme_id}", None),
        ("retrieve streamed", "GET", f"/v1/responses/{acme_id}?stream=true", None),
        ("cancel", "POST", f"/v1/responses/{acme_id}/cancel", None),
    ]


async def _acme_response(client: httpx.AsyncClient, keys: Keys) -> str:
    resp = await client.post("/v1/responses", headers=keys.auth("admin"), json={
        "model": MODEL, "input": "acme's secret plan: buy globex", "store": True,
        "max_output_tokens": 2})
    assert resp.status_code == 200, resp.text
    return str(resp.json()["id"])


@pytest.mark.parametrize("route", range(5), ids=[r[0] for r in _routes("x")])
async def test_another_tenants_response_id_is_a_404_that_reaches_no_engine(
        fleet: list[RunningSim], tmp_path: Path, route: int) -> None:
    keys = write_keys(tmp_path)
    async with gateway(billing_config([s.url for s in fleet], tmp_path, keys)) as (_, client):
        acme_id = await _acme_response(client, keys)
        name, method, path, body = _routes(acme_id)[route]
        before = await _finished(fleet)
        resp = await client.request(method, path, json=body, headers=keys.auth("user"))
        assert resp.status_code == 404, (name, resp.text)
        error = resp.json()["error"]
        assert error["type"] == "invalid_request_error" and acme_id in error["message"]
        assert "buy globex" not in resp.text
        assert await _finished(fleet) == before, f"{name}: globex's request reached an engine"
        # the owner still continues its own conversation
        own = await client.post("/v1/responses", headers=keys.auth("admin"), json={
            "model": MODEL, "input": "and then?", "previous_response_id": acme_id,
            "max_output_tokens": 2})
        assert own.status_code == 200, own.text


async def test_an_unknown_response_id_is_a_404_with_keys_on(
        fleet: list[RunningSim], tmp_path: Path) -> None:
    """With API keys on, an id the gateway never handed out (or forgot) has no owner it can
    vouch for: refused, not left to an engine's store that serves anyone."""
    keys = write_keys(tmp_path)
    async with gateway(billing_config([s.url for s in fleet], tmp_path, keys)) as (_, client):
        before = await _finished(fleet)
        resp = await client.post("/v1/responses", headers=keys.auth("user"), json={
            "model": MODEL, "input": "x", "previous_response_id": "resp_unknown",
            "max_output_tokens": 2})
        assert resp.status_code == 404, resp.text
        assert resp.json()["error"]["param"] == "previous_response_id"
        assert await _finished(fleet) == before
