"""Every id a client sends is checked against its owner before anything reaches an engine.

Two tenants (acme, globex) behind one gateway with API keys, in front of simulated engines
whose Responses store, like vLLM's, serves any id to anyone. acme's stored response must be
invisible to globex on every route that takes it (404 in the Responses API's shape) and must
never reach an engine on globex's behalf: before the fix, globex's ``previous_response_id``
set to acme's id was served with acme's conversation in globex's prompt.

Then every route that takes an id (listed from the app's route tables, so a new one without a
case fails the test) plus the ids sent in bodies and cursors, walked with globex's key over
acme's objects of every kind (stored and background responses, a queued request, a file, a
batch, an API key, a tenant): 404 in the API's shape (403 on the admin API, for any key
without ``admin``), nothing reaches an engine, and acme's objects are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from kvgate.engines.sim.testing import RunningSim
from kvgate.middleware.app import KvgateApp
from tests.asyncq_helpers import until
from tests.integration.billing_helpers import Keys, billing_config, write_keys
from tests.integration.conftest import gateway
from tests.integration.test_batches_api import jsonl

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


# -- every route that takes an id, with a second tenant's key ------------------------------
#: The owner's objects, by placeholder: a stored response, a background response, a queued
#: request, an uploaded file, a batch, an API key id and a tenant name.
Ids = dict[str, str]


@dataclass(frozen=True)
class Case:
    """One way to send an id: ``route`` as the route table spells it (None: an id in a body
    or query of a route without one), the request, and what a stranger must get."""

    name: str
    route: tuple[str, str] | None
    method: str
    path: str
    body: dict[str, Any] | None = None
    status: int = 404
    key: str = "user"


CASES = [
    Case("previous_response_id", None, "POST", "/v1/responses", {
        "model": MODEL, "input": "x", "previous_response_id": "{resp}", "max_output_tokens": 2}),
    Case("previous_response_id, background", None, "POST", "/v1/responses", {
        "model": MODEL, "input": "x", "previous_response_id": "{bg}", "max_output_tokens": 2}),
    Case("previous_response_id, queued with background", None, "POST", "/v1/responses", {
        "model": MODEL, "input": "x", "previous_response_id": "{resp}", "background": True}),
    Case("retrieve response", ("GET", "/v1/responses/{id}"), "GET", "/v1/responses/{resp}"),
    Case("retrieve background response", ("GET", "/v1/responses/{id}"), "GET",
         "/v1/responses/{bg}"),
    Case("cancel response", ("POST", "/v1/responses/{id}/cancel"), "POST",
         "/v1/responses/{resp}/cancel"),
    Case("cancel background response", ("POST", "/v1/responses/{id}/cancel"), "POST",
         "/v1/responses/{bg}/cancel"),
    Case("queued request", ("GET", "/v1/queue/requests/{job_id}"), "GET",
         "/v1/queue/requests/{qreq}"),
    Case("cancel queued request", ("DELETE", "/v1/queue/requests/{job_id}"), "DELETE",
         "/v1/queue/requests/{qreq}"),
    Case("file", ("GET", "/v1/files/{file_id}"), "GET", "/v1/files/{file}"),
    Case("file content", ("GET", "/v1/files/{file_id}/content"), "GET",
         "/v1/files/{file}/content"),
    Case("delete file", ("DELETE", "/v1/files/{file_id}"), "DELETE", "/v1/files/{file}"),
    Case("batch from another's file", None, "POST", "/v1/batches", {
        "input_file_id": "{file}", "endpoint": "/v1/chat/completions",
        "completion_window": "24h"}),
    Case("batch", ("GET", "/v1/batches/{batch_id}"), "GET", "/v1/batches/{batch}"),
    Case("cancel batch", ("POST", "/v1/batches/{batch_id}/cancel"), "POST",
         "/v1/batches/{batch}/cancel"),
    Case("files after another's cursor", None, "GET", "/v1/files?after={file}", status=200),
    Case("batches after another's cursor", None, "GET", "/v1/batches?after={batch}",
         status=200),
    *(Case(f"admin {what}, {role}", (m, route), m, path, body, 403, role)
      for role in ("user", "narrow")  # globex's key, and a non-admin key of acme itself
      for what, m, route, path, body in (
          ("key", "GET", "/v1/admin/keys/{key_id}", "/v1/admin/keys/{key}", None),
          ("update key", "PATCH", "/v1/admin/keys/{key_id}", "/v1/admin/keys/{key}",
           {"admin": True}),
          ("revoke", "POST", "/v1/admin/keys/{key_id}/revoke", "/v1/admin/keys/{key}/revoke",
           None),
          ("rotate", "POST", "/v1/admin/keys/{key_id}/rotate", "/v1/admin/keys/{key}/rotate",
           None),
          ("tenant", "PUT", "/v1/admin/tenants/{tenant}", "/v1/admin/tenants/{tenant}",
           {"budget_usd": "0"}),
      )),
]


def queue_config(urls: list[str], tmp: Path, keys: Keys) -> dict[str, Any]:
    """API keys, billing, and the async queue with background responses, queued requests and
    the Files / Batch APIs."""
    data = billing_config(urls, tmp, keys)
    data["plugins"].append({"type": "async-queue", "params": {
        "backend": f"sqlite://{tmp}/jobs.sqlite", "poll_interval_s": 0.02,
        "management": {"data_dir": str(tmp / "async"), "finalize_interval_s": 0.1}}})
    data["apis"] = {"responses": {"allow_background": True}}
    return data


def id_routes(app: KvgateApp) -> set[tuple[str, str]]:
    """Every (method, path) that takes an id, from the app's route tables: the API adapters'
    by-id routes, the mounted sub-applications' (FastAPI: their OpenAPI paths), the plugins'
    routes."""
    out = {(m, p) for m, p, _ in app.apis.by_id}
    out |= {(m, p) for m, p in app.pipeline.routes if "{" in p}
    for _, mounted in app.mounts:
        assert isinstance(mounted, FastAPI), mounted  # its route table: its OpenAPI paths
        for path, methods in mounted.openapi()["paths"].items():
            out |= {(m.upper(), path) for m in methods if "{" in path}
    return out


async def _until_done(client: httpx.AsyncClient, path: str, keys: Keys, field: str,
                      done: tuple[str, ...]) -> dict[str, Any]:
    async def probe() -> dict[str, Any] | None:
        doc: dict[str, Any] = (await client.get(path, headers=keys.auth("admin"))).json()
        return doc if doc.get(field) in done else None
    return await until(probe, 20)


async def _acme_objects(client: httpx.AsyncClient, keys: Keys) -> Ids:
    """Every kind of object acme can own, each finished (no engine work left to count)."""
    ids = {"resp": await _acme_response(client, keys), "key": "acme-admin", "tenant": "acme"}
    auth = keys.auth("admin")
    bg = await client.post("/v1/responses", headers=auth, json={
        "model": MODEL, "input": "acme's background plan", "background": True,
        "max_output_tokens": 2})
    queued = await client.post("/v1/chat/completions", headers={**auth, "x-kvgate-queue": "true"},
                               json={"model": MODEL, "max_tokens": 2,
                                     "messages": [{"role": "user", "content": "acme queued"}]})
    rows = [{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": MODEL, "max_tokens": 2,
                      "messages": [{"role": "user", "content": "acme batch"}]}}]
    file = await client.post("/v1/files", headers=auth, data={"purpose": "batch"},
                             files={"file": ("in.jsonl", jsonl(rows))})
    ids.update(bg=bg.json()["id"], qreq=queued.json()["id"], file=file.json()["id"])
    batch = await client.post("/v1/batches", headers=auth, json={
        "input_file_id": ids["file"], "endpoint": "/v1/chat/completions",
        "completion_window": "24h"})
    ids["batch"] = batch.json()["id"]
    ids["bg_status"] = (await _until_done(client, f"/v1/responses/{ids['bg']}", keys,
                                          "status", ("completed", "incomplete")))["status"]
    await _until_done(client, f"/v1/queue/requests/{ids['qreq']}", keys, "status",
                      ("succeeded",))
    await _until_done(client, f"/v1/batches/{ids['batch']}", keys, "status", ("completed",))
    return ids


def _filled(value: Any, ids: Ids) -> Any:
    if isinstance(value, str):
        return value.format(**ids)
    if isinstance(value, dict):
        return {k: _filled(v, ids) for k, v in value.items()}
    return value


async def _walk(client: httpx.AsyncClient, keys: Keys, ids: Ids,
                fleet: list[RunningSim]) -> list[str]:
    """Every case with a stranger's key; the problems found."""
    problems = []
    for case in CASES:
        before = await _finished(fleet)
        resp = await client.request(case.method, _filled(case.path, ids),
                                    json=_filled(case.body, ids), headers=keys.auth(case.key))
        leaked = [name for name, value in ids.items()
                  if name in ("resp", "bg", "qreq", "file", "batch") and value in resp.text]
        if resp.status_code != case.status:
            problems.append(f"{case.name}: {resp.status_code} {resp.text[:200]}")
        elif case.status != 200:
            error = resp.json().get("error") or {}
            if set(error) != {"message", "type", "param", "code"}:
                problems.append(f"{case.name}: not the API's error shape: {resp.text[:200]}")
        if case.status == 200 and leaked:  # a list: only the caller's own objects
            problems.append(f"{case.name}: lists {leaked}")
        if "acme's" in resp.text or "acme batch" in resp.text:
            problems.append(f"{case.name}: acme's content in the answer")
        if await _finished(fleet) != before:
            problems.append(f"{case.name}: reached an engine")
    return problems


async def test_every_id_route_refuses_another_tenant_and_reaches_no_engine(
        fleet: list[RunningSim], tmp_path: Path) -> None:
    keys = write_keys(tmp_path)
    async with gateway(queue_config([s.url for s in fleet], tmp_path, keys)) as (app, client):
        assert id_routes(app) == {c.route for c in CASES if c.route}, "a route without a case"
        ids = await _acme_objects(client, keys)
        assert await _walk(client, keys, ids, fleet) == []
        # acme's objects are as they were
        auth = keys.auth("admin")
        for path, field, value in (
                (f"/v1/responses/{ids['resp']}", "id", ids["resp"]),
                (f"/v1/responses/{ids['bg']}", "status", ids["bg_status"]),
                (f"/v1/queue/requests/{ids['qreq']}", "status", "succeeded"),
                (f"/v1/files/{ids['file']}", "id", ids["file"]),
                (f"/v1/batches/{ids['batch']}", "status", "completed"),
                ("/v1/admin/keys/acme-admin", "status", "active")):
            resp = await client.get(path, headers=auth)
            assert resp.status_code == 200 and resp.json()[field] == value, (path, resp.text)
        tenants = (await client.get("/v1/admin/tenants", headers=auth)).json()["data"]
        assert all(t["budget_usd"] is None for t in tenants), tenants
