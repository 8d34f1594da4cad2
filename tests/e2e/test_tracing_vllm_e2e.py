"""Tracing with a real vLLM CPU engine: the gateway's spans and vLLM's own ``llm_request`` span
(``--otlp-traces-endpoint``, OTLP/HTTP) arrive at one in-process collector under one trace id,
vLLM's span a child of the gateway's upstream-hop span (the ``traceparent`` the gateway sent)."""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from kvgate.engines.local.launcher import LocalEngine, engine_args, engine_env, stop, wait_healthy
from kvgate.engines.local.model import SERVED_NAME
from kvgate.engines.local.paths import kvgate_home
from kvgate.engines.ports import free_port
from kvgate.middleware.app import create_app
from kvgate.middleware.framework.composition.config import parse_config
from tests.integration.conftest import gateway_config
from tests.integration.otlp_collector import Collector
from tests.servers import serve_asgi

pytestmark = pytest.mark.e2e
#: vLLM's BatchSpanProcessor exports every 5 s (the SDK's default): wait a few rounds.
SPAN_WAIT_S = 30.0


def _spawn_traced(model: Path, collector_url: str) -> LocalEngine:
    port = free_port()
    logs = kvgate_home() / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"traced-{port}.log"
    env = {**engine_env(0, None), "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}
    argv = [*engine_args(model, "traced", port, None, None),
            "--otlp-traces-endpoint", f"{collector_url}/v1/traces"]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    return LocalEngine("traced", port, proc.pid, str(log), time.monotonic())


async def test_vllm_span_joins_the_gateway_trace(tiny_model: Path) -> None:
    collector = Collector()
    async with serve_asgi(collector.app, lifespan="off") as url:
        engine = _spawn_traced(tiny_model, url)
        try:
            await asyncio.to_thread(wait_healthy, [engine])
            data = gateway_config([f"http://127.0.0.1:{engine.port}"])
            data["tracing"] = {"otlp_endpoint": url}
            app = create_app(parse_config(data, "test"))
            async with app.running():
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(transport=transport, base_url="http://gw",
                                             timeout=120) as client:
                    resp = await client.post("/v1/chat/completions", json={
                        "model": SERVED_NAME, "max_tokens": 4,
                        "messages": [{"role": "user", "content": "hello"}]})
                    assert resp.status_code == 200
                await asyncio.to_thread(app.tracing.flush)
            for _ in range(int(SPAN_WAIT_S / 0.5)):  # bounded: its export is periodic
                if collector.named("llm_request"):
                    break
                await asyncio.sleep(0.5)
        finally:
            await asyncio.to_thread(stop, engine)
    (hop,) = collector.named("kvgate.upstream")
    (engine_span,) = collector.named("llm_request")
    (root,) = collector.named("kvgate.request")
    assert engine_span.trace_id == hop.trace_id == root.trace_id
    assert engine_span.parent_id == hop.span_id
