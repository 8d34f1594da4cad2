"""OpenTelemetry tracing end to end: the gateway (in-process ASGI) over simulated engines that
trace like vLLM's ``--otlp-traces-endpoint``, both exporting OTLP/HTTP protobuf to an
in-process collector (a Starlette app on a free loopback port)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from kvgate.engines.sim.cli import child_argv, config_from_args, register
from kvgate.engines.sim.core.config import PdSimConfig, SimConfig
from kvgate.engines.sim.http.app import sim_handles
from kvgate.engines.sim.testing import RunningSim, serve_sim
from kvgate.middleware.app import KvgateApp, create_app
from kvgate.middleware.framework.composition.config import parse_config
from kvgate.middleware.framework.composition.quickstart import pd_config_data
from kvgate.middleware.framework.errors import ConfigError
from tests.integration.billing_helpers import billing_config, write_keys
from tests.integration.conftest import FAST_POOL, gateway, gateway_config, sim_fleet
from tests.integration.otlp_collector import Collector
from tests.servers import serve_asgi

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
CLIENT_TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4}


@contextlib.asynccontextmanager
async def traced(gateway_tracing: bool) -> AsyncIterator[tuple[Collector, RunningSim, Any]]:
    """A collector, one traced simulated engine and the gateway (traced or not) over it."""
    collector = Collector()
    async with serve_asgi(collector.app, lifespan="off") as url, \
            sim_fleet(1, otlp_traces_endpoint=url) as sims:
        data = gateway_config([sims[0].url])
        if gateway_tracing:
            data["tracing"] = {"otlp_endpoint": url}
        async with gateway(data) as (app, client):
            yield collector, sims[0], client
            await flush(app, sims[0])


async def flush(app: KvgateApp, sim: RunningSim) -> None:
    tracer = sim_handles(sim.app).tracer
    assert tracer is not None
    await asyncio.to_thread(tracer.flush)
    await asyncio.to_thread(app.tracing.flush)


@pytest.mark.parametrize("stream", [False, True])
async def test_gateway_and_engine_spans_share_one_trace(stream: bool) -> None:
    async with traced(True) as (collector, _sim, client):
        resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
        assert resp.status_code == 200
        rid = resp.headers["x-request-id"]
    (root,) = collector.named("kvgate.request")
    (engine,) = collector.named("llm_request")
    (hop,) = collector.named("kvgate.upstream")
    (route,) = collector.named("kvgate.route")
    (auth,) = collector.named("kvgate.auth")
    assert {s.trace_id for s in collector.spans} == {root.trace_id}
    assert root.parent_id == ""  # no client traceparent: a new trace
    assert root.service == "kvgate" and engine.service == "sim-0"
    assert root.attributes == {"kvgate.api": "chat", "kvgate.request_id": rid,
                               "http.response.status_code": 200,
                               "gen_ai.request.model": "sim-model"}
    assert auth.parent_id == route.parent_id == hop.parent_id == root.span_id
    assert route.attributes["kvgate.engine"] == "sim-0"
    assert route.attributes["kvgate.profiles"] == ["default"]
    (score,) = route.attributes["kvgate.scores.default"]  # one engine: one total
    assert score.startswith("sim-0=") and 0 <= float(score.split("=")[1]) <= 1
    assert hop.attributes["kvgate.engine"] == "sim-0"
    assert hop.attributes["kvgate.role"] == "both"
    assert hop.attributes["http.response.status_code"] == 200
    assert hop.attributes["kvgate.ttft_s"] >= 0
    assert engine.parent_id == hop.span_id  # the engine joined under the hop
    assert engine.attributes["gen_ai.request.id"] == rid


async def test_client_traceparent_is_continued() -> None:
    async with traced(True) as (collector, _sim, client):
        resp = await client.post("/v1/chat/completions", json=CHAT,
                                 headers={"traceparent": CLIENT_TRACEPARENT,
                                          "tracestate": "vendor=opaque"})
        assert resp.status_code == 200
    (root,) = collector.named("kvgate.request")
    (hop,) = collector.named("kvgate.upstream")
    (engine,) = collector.named("llm_request")
    assert {s.trace_id for s in collector.spans} == {CLIENT_TRACE}
    assert root.parent_id == CLIENT_SPAN
    assert engine.parent_id == hop.span_id
    assert {s.trace_state for s in collector.spans} == {"vendor=opaque"}  # carried along


@pytest.mark.parametrize(("headers", "parent"), [
    ({"traceparent": CLIENT_TRACEPARENT, "tracestate": "v=1"}, CLIENT_SPAN),  # passed through
    ({}, ""),  # nothing added: the engine starts its own trace
])
async def test_tracing_off_passes_the_client_traceparent_through(
        headers: dict[str, str], parent: str) -> None:
    async with traced(False) as (collector, _sim, client):
        resp = await client.post("/v1/chat/completions", json=CHAT, headers=headers)
        assert resp.status_code == 200
    (engine,) = collector.spans  # the gateway exports nothing
    assert engine.name == "llm_request"
    assert engine.parent_id == parent
    assert (engine.trace_id == CLIENT_TRACE) == bool(headers)
    assert engine.trace_state == headers.get("tracestate", "")


async def test_billed_request_traces_tenant_and_ledger_write(tmp_path: Path) -> None:
    """With api-keys and billing: the tenant on the request span, the usage hooks (the ledger
    write) in their own span; a refused key ends at auth (401, no upstream span)."""
    collector = Collector()
    keys = write_keys(tmp_path)
    async with serve_asgi(collector.app, lifespan="off") as url, \
            sim_fleet(1, otlp_traces_endpoint=url) as sims:
        data = billing_config([sims[0].url], tmp_path, keys)
        data["tracing"] = {"otlp_endpoint": url}
        async with gateway(data) as (app, client):
            ok = await client.post("/v1/chat/completions", json=CHAT, headers=keys.auth("user"))
            refused = await client.post("/v1/chat/completions", json=CHAT,
                                        headers={"authorization": "Bearer sk-wrong"})
            assert (ok.status_code, refused.status_code) == (200, 401)
            await flush(app, sims[0])
    roots = {s.attributes["http.response.status_code"]: s for s in collector.named("kvgate.request")}
    assert set(roots) == {200, 401}
    assert roots[200].attributes["kvgate.tenant"] == "globex"
    assert "kvgate.tenant" not in roots[401].attributes
    (usage,) = collector.named("kvgate.usage")
    (hop,) = collector.named("kvgate.upstream")
    assert usage.trace_id == roots[200].trace_id
    assert usage.parent_id in {hop.span_id, roots[200].span_id}
    assert len(collector.named("kvgate.auth")) == 2
    assert {s.trace_id for s in collector.named("llm_request")} == {roots[200].trace_id}


@pytest.mark.parametrize("protocol", ["nixl", "sglang"])
async def test_each_pd_hop_has_its_span_and_engine_child(protocol: str) -> None:
    """Prefill and decode hops: one upstream span each (role), each engine's span under its
    own hop, all in the request's trace."""
    collector = Collector()
    async with serve_asgi(collector.app, lifespan="off") as url, \
            contextlib.AsyncExitStack() as stack:
        sims = [await stack.enter_async_context(serve_sim(SimConfig(
            engine_id=name, role=role, time_scale=0.0, pd=PdSimConfig(bootstrap_port=0),
            otlp_traces_endpoint=url))) for name, role in (("p0", "prefill"), ("d0", "decode"))]
        data = pd_config_data([sims[0].url], [sims[1].url], protocol)
        for plugin in data["plugins"]:
            if plugin["type"] == "pd-profile-handler":
                plugin["params"]["min_uncached_tokens"] = 0  # always take the prefill hop
        for eng, sim in zip(data["engines"], sims, strict=True):
            eng["labels"] = {"bootstrap_port": str(sim.port)}
        data["pool"], data["tracing"] = FAST_POOL, {"otlp_endpoint": url}
        async with gateway(data) as (app, client):
            resp = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2})
            assert resp.status_code == 200
            for sim in sims:
                await flush(app, sim)
    (root,) = collector.named("kvgate.request")
    (route,) = collector.named("kvgate.route")
    hops = {s.attributes["kvgate.role"]: s for s in collector.named("kvgate.upstream")}
    engines = {s.service: s for s in collector.named("llm_request")}
    assert {s.trace_id for s in collector.spans} == {root.trace_id}
    assert route.attributes["kvgate.prefill"] == "prefill-0"  # the gateway's engine names
    assert set(hops) == {"prefill", "decode"}
    assert hops["prefill"].attributes["kvgate.engine"] == "prefill-0"
    assert hops["decode"].attributes["kvgate.engine"] == "decode-0"
    assert {h.attributes["http.response.status_code"] for h in hops.values()} == {200}
    assert engines["p0"].parent_id == hops["prefill"].span_id
    assert engines["d0"].parent_id == hops["decode"].span_id


@pytest.mark.parametrize(("tracing", "message"), [
    ({"otlp_endpoint": "ftp://collector"}, "otlp_endpoint"),
    ({"otlp_endpoint": "http://c:4318", "sample_ratio": 2}, "sample_ratio"),
    ({"otlp_endpoint": "http://c:4318", "sampler": "always"}, "sampler"),
    ({}, "OTEL_EXPORTER_OTLP_ENDPOINT"),
])
def test_tracing_config_is_validated_at_startup(
        tracing: dict[str, Any], message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    with pytest.raises(ConfigError, match=message):
        create_app(parse_config(gateway_config(["http://127.0.0.1:1"], tracing=tracing), "t"))


def test_tracing_without_the_packages_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # import fails
    data = gateway_config(["http://127.0.0.1:1"], tracing={"otlp_endpoint": "http://c:4318"})
    with pytest.raises(ConfigError, match=r"kvgate\[tracing\]"):
        create_app(parse_config(data, "t"))


def test_sim_cli_flag_reaches_config_and_children() -> None:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["sim", "--count", "2", "--otlp-traces-endpoint", "http://c:4318"])
    assert config_from_args(args).otlp_traces_endpoint == "http://c:4318"
    argv = child_argv(args, 1)
    assert argv[argv.index("--otlp-traces-endpoint") + 1] == "http://c:4318"
    assert config_from_args(parser.parse_args(["sim"])).otlp_traces_endpoint is None
