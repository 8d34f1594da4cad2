"""The core's extension points for deferred work, through a real app in front of simulated
engines: ASGI mounts (and their overlap checks), the in-process loopback (principal, request id
and tier honoured; a header cannot imitate it), request deferral and by-id state resolvers."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from typing import Any, ClassVar

import httpx
import pytest
from pydantic import BaseModel

from kvgate.middleware.app import KvgateApp, create_app
from kvgate.middleware.framework.composition.config import parse_config
from kvgate.middleware.framework.composition.registry import Registry
from kvgate.middleware.framework.errors import ConfigError
from kvgate.middleware.framework.plugin import (
    AsgiApp,
    AsgiMount,
    Deferred,
    HttpResponse,
    LoopbackCaller,
    NeedsLoopback,
    Plugin,
    PluginLookup,
    RequestDeferral,
    StateResolver,
    UsageHook,
)
from kvgate.middleware.framework.types import (
    CycleState,
    Endpoint,
    InferenceRequest,
    Principal,
    Receive,
    Scope,
    Send,
    Usage,
)
from kvgate.middleware.transport.asgi import send_json
from tests.integration.conftest import gateway_config, sim_fleet

CHAT: dict[str, Any] = {"model": "sim-model", "max_tokens": 3,
                        "messages": [{"role": "user", "content": "hello"}]}


class _Who:
    tenant = "acme"
    key_id = "k1"


async def _echo_app(scope: Scope, receive: Receive, send: Send) -> None:
    await send_json(send, 200, {"mounted": scope["path"], "method": scope["method"]})


class Probe(Plugin, AsgiMount, NeedsLoopback, RequestDeferral, StateResolver, UsageHook):
    """Implements every new extension point and records what the gateway told it."""

    type_name: ClassVar[str] = "probe"

    class Params(BaseModel):
        prefixes: tuple[str, ...] = ("/v1/probe",)

    def __init__(self, name: str, params: BaseModel, plugins: PluginLookup) -> None:
        super().__init__(name, params, plugins)
        assert isinstance(params, Probe.Params)
        self.prefixes = params.prefixes
        self.loopback: LoopbackCaller | None = None
        self.seen: list[tuple[str, str | None, str | None, str | None]] = []

    def mounts(self) -> Sequence[tuple[str, AsgiApp]]:
        return [(p, _echo_app) for p in self.prefixes]

    def bind_loopback(self, loopback: LoopbackCaller) -> None:
        self.loopback = loopback

    async def defer(self, req: InferenceRequest, adapter_name: str,
                    path: str) -> Deferred | None:
        if req.headers.get("x-defer") != "yes" or req.service_tier is not None:
            return None
        return Deferred(202, json.dumps({"deferred": adapter_name, "path": path}).encode(),
                        {"x-why": "probe"})

    async def resolve(self, adapter_name: str, method: str, state_id: str,
                      principal: Principal | None) -> HttpResponse | None:
        if not state_id.startswith("probe_"):
            return None
        body = {"id": state_id, "api": adapter_name, "method": method,
                "tenant": None if principal is None else principal.tenant}
        return HttpResponse(200, json.dumps(body).encode())

    async def on_usage(self, req: InferenceRequest, state: CycleState, target: Endpoint,
                       usage: Usage) -> None:
        self.seen.append((req.request_id, req.tenant, req.key_id, req.service_tier))


def _app(urls: list[str], prefixes: Sequence[str] = ("/v1/probe",)) -> KvgateApp:
    base = Registry.from_entry_points()
    registry = Registry({**base.plugins, "probe": Probe}, base.engines, base.connectors)
    cfg = gateway_config(urls)
    cfg["plugins"] = [*cfg["plugins"], {"type": "probe", "params": {"prefixes": list(prefixes)}}]
    return create_app(parse_config(cfg, "test"), registry)


@pytest.fixture
async def probe_gw() -> AsyncIterator[tuple[KvgateApp, Probe, httpx.AsyncClient]]:
    async with sim_fleet(1) as sims:
        app = _app([sims[0].url])
        probe = app.pipeline.plugins["probe"]
        assert isinstance(probe, Probe)
        async with app.running():
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
                yield app, probe, client


@pytest.mark.parametrize(("path", "served"), [
    ("/v1/probe", True), ("/v1/probe/x/y", True), ("/v1/probex", False), ("/v1/prob", False)])
async def test_mount_prefix_matching(probe_gw: Any, path: str, served: bool) -> None:
    _, _, client = probe_gw
    resp = await client.post(path, content=b"{}")
    if served:
        assert resp.json() == {"mounted": path, "method": "POST"}
    else:
        assert resp.status_code == 404
        assert resp.json()["error"]["code"] == "not_found"


@pytest.mark.parametrize("prefix", [
    "/v1/chat", "/v1/chat/completions", "/v1/models", "/v1/models/x", "/health", "/v1",
    "/v1/responses", "/v1/probe/", "probe"])
async def test_overlapping_mounts_refused(prefix: str) -> None:
    with pytest.raises(ConfigError):
        _app(["http://127.0.0.1:9"], [prefix])


async def test_two_mounts_that_overlap_refused() -> None:
    with pytest.raises(ConfigError, match="overlaps"):
        _app(["http://127.0.0.1:9"], ["/v1/q", "/v1/q/r"])


async def test_loopback_runs_the_request_path_with_its_context(probe_gw: Any) -> None:
    _, probe, _ = probe_gw
    assert probe.loopback is not None
    resp = await probe.loopback.call("POST", "/v1/chat/completions", json.dumps(CHAT).encode(),
                                     principal=_Who(), request_id="job_1", tier="batch")
    assert resp.status == 200, resp.body
    assert json.loads(resp.body)["usage"]["completion_tokens"] == 3
    assert resp.headers["x-request-id"] == "job_1"
    assert resp.headers["x-kvgate-engine"] == "sim-0"
    assert probe.seen == [("job_1", "acme", "k1", "batch")]


async def test_loopback_relays_errors_in_the_api_shape(probe_gw: Any) -> None:
    _, probe, _ = probe_gw
    resp = await probe.loopback.call("POST", "/v1/chat/completions", b'{"model": 1}',
                                     request_id="job_bad")
    assert resp.status == 400
    assert json.loads(resp.body)["error"]["type"] == "invalid_request_error"


async def test_a_header_cannot_imitate_the_loopback(probe_gw: Any) -> None:
    _, probe, client = probe_gw
    headers = {"kvgate": "tier=batch", "x-kvgate-tier": "batch", "x-request-id": "job_2"}
    resp = await client.post("/v1/chat/completions", json=CHAT, headers=headers)
    assert resp.status_code == 200
    (rid, _, _, tier), = probe.seen
    assert tier is None
    assert rid != "job_2"  # the client's id is echoed, never kvgate's request id
    assert resp.headers["x-request-id"] == "job_2"


async def test_deferral_answers_instead_of_dispatching(probe_gw: Any) -> None:
    app, probe, client = probe_gw
    resp = await client.post("/v1/chat/completions", json=CHAT, headers={"x-defer": "yes"})
    assert resp.status_code == 202
    assert resp.json() == {"deferred": "chat", "path": "/v1/chat/completions"}
    assert resp.headers["x-why"] == "probe"
    assert probe.seen == []
    assert [ep.in_flight_requests for ep in app.pool.snapshot()] == [0]


async def test_state_resolver_answers_its_ids_and_leaves_others(probe_gw: Any) -> None:
    _, _, client = probe_gw
    mine = await client.get("/v1/responses/probe_7")
    assert mine.json() == {"id": "probe_7", "api": "responses", "method": "GET",
                           "tenant": None}
    other = await client.get("/v1/responses/resp_unknown")
    assert other.status_code == 404
