"""Engine faults and load through the gateway (docs/reliability.md): an engine hanging
(timeouts, the circuit breaker opens, no request is sent until a probe passes, a trial closes
it), an engine process killed mid-stream (its clients get the API's SSE error, the other engine
takes the rest), readiness (``/health`` is 503 until a probe has confirmed an engine), and 200
concurrent streams all complete with every lease released. The gateway is served on a loopback
port by the HTTP front end ``kvgate serve`` runs (middleware/transport/h1server.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import aiohttp
import orjson
import pytest

from kvgate.engines.ports import free_port
from kvgate.engines.sim.core.faults import FaultSpec
from kvgate.middleware.framework.types import Send
from kvgate.middleware.serving import sse
from tests.integration.conftest import (
    KVGATE_FRONT,
    gateway_config,
    serve_gateway,
    served,
    sim_fleet,
)
from tests.servers import serve_asgi, wait_ready

CHAT = {"model": "sim-model", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
#: No probe runs during a test unless it calls ``probe_all`` itself.
NO_PROBES = {"health_interval_s": 30, "metrics_interval_s": 30}


def _breaker(text: str, engine: str) -> str:
    line = next(ln for ln in text.splitlines()
                if ln.startswith(f'kvgate_engine_breaker_state{{engine="{engine}"}}'))
    return line.rsplit(" ", 1)[1]


async def test_hanging_engine_times_out_opens_breaker_then_closes(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "kvgate.pool")
    async with sim_fleet(2) as sims:
        data = gateway_config([s.url for s in sims], picker="round-robin-picker",
                              pool=NO_PROBES, server={"request_timeout_s": 0.3})
        async with served(data) as (app, client):
            sims[0].faults.apply(FaultSpec(delay_first_byte_s=30))  # /health still answers
            for _ in range(3):  # times out on sim-0 (504), retried on sim-1
                resp = await client.post("/v1/chat/completions", json=CHAT)
                assert resp.status_code == 200 and resp.headers["x-kvgate-engine"] == "sim-1"
            metrics = (await client.get("/metrics")).text
            assert _breaker(metrics, "sim-0") == "2.0"
            assert 'kvgate_upstream_retries_total{engine="sim-0"} 3.0' in metrics
            for _ in range(4):  # open: nothing is sent to sim-0, so nothing is retried
                resp = await client.post("/v1/chat/completions", json=CHAT)
                assert resp.headers["x-kvgate-engine"] == "sim-1"
            assert 'retries_total{engine="sim-0"} 3.0' in (await client.get("/metrics")).text
            health = (await client.get("/health")).json()
            assert [e["breaker"] for e in health["engines"]] == ["open", "closed"]
            assert health["status"] == "ok" and health["engines_healthy"] == 1

            await app.pool.probe_all()  # /health passes: half-open, one trial allowed
            assert _breaker((await client.get("/metrics")).text, "sim-0") == "1.0"
            sims[0].faults.clear()  # the trial succeeds and closes the breaker
            engines = set()
            for _ in range(2):
                resp = await client.post("/v1/chat/completions", json=CHAT)
                assert resp.status_code == 200
                engines.add(resp.headers["x-kvgate-engine"])
            assert "sim-0" in engines
            metrics = (await client.get("/metrics")).text
            assert _breaker(metrics, "sim-0") == "0.0"
            for state in ("open", "half_open", "closed"):
                assert (f'kvgate_engine_breaker_transitions_total{{engine="sim-0",state="{state}"}}'
                        " 1.0") in metrics
    changes = [r.getMessage() for r in caplog.records if "circuit breaker" in r.getMessage()]
    assert [m.split("circuit breaker ")[1].split(" ")[0] for m in changes] == [
        "open", "half_open", "closed"], changes


async def test_failed_trial_reopens_until_the_next_probe() -> None:
    async with sim_fleet(2) as sims:
        data = gateway_config([s.url for s in sims], picker="round-robin-picker",
                              pool=NO_PROBES, server={"request_timeout_s": 0.3})
        async with served(data) as (app, client):
            sims[0].faults.apply(FaultSpec(delay_first_byte_s=30))
            for _ in range(3):
                await client.post("/v1/chat/completions", json=CHAT)
            await app.pool.probe_all()
            for _ in range(2):  # one of them is the trial on sim-0: it times out again
                resp = await client.post("/v1/chat/completions", json=CHAT)
                assert resp.status_code == 200 and resp.headers["x-kvgate-engine"] == "sim-1"
            metrics = (await client.get("/metrics")).text
            assert _breaker(metrics, "sim-0") == "2.0"
            assert 'retries_total{engine="sim-0"} 4.0' in metrics


async def test_not_ready_until_a_probe_confirms_an_engine() -> None:
    async with sim_fleet(1) as sims:
        data = gateway_config([sims[0].url], pool={**NO_PROBES, "startup_probe_timeout_s": 0})
        async with served(data) as (app, client):
            resp = await client.get("/health")
            assert resp.status_code == 503 and resp.json()["status"] == "starting"
            assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
            await app.pool.probe_all()
            resp = await client.get("/health")
            assert resp.status_code == 200 and resp.json()["engines"][0]["confirmed"] is True


@contextlib.contextmanager
def _sim_process(name: str) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    port = free_port()
    proc = subprocess.Popen(  # time scale 1: 300 tokens take ~1.5 s on the simulated H100
        [sys.executable, "-m", "kvgate.engines.sim", "--port", str(port), "--engine-id", name,
         "--time-scale", "1", "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url + "/health", proc, 30)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


async def _stream(session: aiohttp.ClientSession, url: str, started: asyncio.Event,
                  counter: list[int], total: int) -> tuple[str, list[Any]]:
    body = {**CHAT, "max_tokens": 300, "ignore_eos": True, "stream": True}
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        engine = resp.headers["x-kvgate-engine"]
        raw = await resp.content.readany()
        counter[0] += 1
        if counter[0] == total:
            started.set()
        raw += await resp.read()
    events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e.strip()]
    return engine, [e if e == b"[DONE]" else orjson.loads(e) for e in events]


async def test_engine_killed_mid_stream() -> None:
    total = 8
    with _sim_process("sim-0") as (victim, url0), _sim_process("sim-1") as (_, url1):
        data = gateway_config([url0, url1], picker="round-robin-picker")
        async with serve_gateway(data, KVGATE_FRONT) as (app, gw), \
                aiohttp.ClientSession() as session:
            started, counter = asyncio.Event(), [0]
            tasks = [asyncio.create_task(_stream(session, gw, started, counter, total))
                     for _ in range(total)]
            await asyncio.wait_for(started.wait(), 20)
            victim.send_signal(signal.SIGKILL)
            results = await asyncio.gather(*tasks)
            for engine, events in results:
                if engine == "sim-1":
                    assert events[-1] == b"[DONE]" and "choices" in events[-2]
                    continue
                assert b"[DONE]" not in events  # ends with the API's error event, nothing after
                assert set(events[-1]) == {"error"} and events[-1]["error"]["message"]
            assert {e for e, _ in results} == {"sim-0", "sim-1"}
            for _ in range(4):  # later requests: the other engine (a retry, then the breaker)
                resp = await session.post(gw + "/v1/chat/completions", json=CHAT)
                assert resp.status == 200 and resp.headers["x-kvgate-engine"] == "sim-1"
            states = {e["name"]: e["breaker"] for e in app.pool.status()}
            assert states["sim-0"] == "open"


async def test_200_concurrent_streams_all_complete() -> None:
    # the suite's small case of bench/reliability.py's 1,000 (docs/reliability.md)
    body = {**CHAT, "max_tokens": 16, "stream": True}
    async with sim_fleet(2) as sims, \
            serve_gateway(gateway_config([s.url for s in sims]), KVGATE_FRONT) as (app, gw), \
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one() -> tuple[str, list[Any]]:
            async with session.post(gw + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                raw = await resp.read()
            events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e.strip()]
            return resp.headers["x-kvgate-engine"], events

        results = await asyncio.gather(*(one() for _ in range(200)))
        assert all(events[-1] == b"[DONE]" and len(events) > 2 for _, events in results)
        assert {engine for engine, _ in results} == {"sim-0", "sim-1"}
        assert [ep.in_flight_requests for ep in app.pool.snapshot()] == [0, 0]


def _first_event_then(rest: Callable[[Send], Awaitable[None]]) -> Any:
    """An engine (ASGI) that answers a GET with JSON and a POST with one chat SSE event, then
    does ``rest`` with the stream still open."""

    async def engine(scope: dict[str, Any], receive: Any, send: Send) -> None:
        while (await receive()).get("more_body"):
            pass
        stream = scope["method"] == "POST"
        ctype = b"text/event-stream" if stream else b"application/json"
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", ctype)]})
        if not stream:
            await send({"type": "http.response.body", "body": b'{"data": []}'})
            return
        await send({"type": "http.response.body", "more_body": True,
                    "body": b'data: {"choices": [{"index": 0, "delta": {"content": "a"}}]}\n\n'})
        await rest(send)

    return engine


async def test_an_engine_event_that_never_ends_breaks_the_stream(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sse, "MAX_EVENT_BYTES", 4096)  # 16 MiB in production

    async def endless(send: Send) -> None:
        for _ in range(4):
            await send({"type": "http.response.body", "body": b"x" * 2000, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    engine = _first_event_then(endless)

    async with serve_asgi(engine, "off") as url:
        data = gateway_config([url], pool={"startup_probe_timeout_s": 0})
        data["engines"][0]["models"] = ["sim-model"]
        async with served(data) as (_, client):
            resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert resp.status_code == 200
    events = resp.content.rstrip(b"\n").split(b"\n\n")
    assert len(events) == 2 and b"x" * 10 not in resp.content
    error = orjson.loads(events[-1].removeprefix(b"data: "))["error"]
    assert "EventTooLarge" in error["message"]


async def test_an_engine_silent_mid_stream_breaks_it_and_counts_against_its_breaker() -> None:
    """A wedged engine (first event sent, then silence) is cut off after
    ``stream_idle_timeout_s``, not the request's 600 s: the client gets the API's error event,
    and the engine's breaker a failure."""
    wedged = asyncio.Event()

    async def hang(_: Send) -> None:
        await wedged.wait()  # set only at the end: the engine hangs after its first event

    engine = _first_event_then(hang)

    async with serve_asgi(engine, "off") as url:
        data = gateway_config([url], pool={"startup_probe_timeout_s": 0, "breaker_failures": 1},
                              server={"stream_idle_timeout_s": 0.3})
        data["engines"][0]["models"] = ["sim-model"]
        async with served(data) as (_, client):
            resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
            metrics = (await client.get("/metrics")).text
            health = await client.get("/health")
        wedged.set()  # lets the engine's server shut down
    assert resp.status_code == 200
    events = resp.content.rstrip(b"\n").split(b"\n\n")
    assert len(events) == 2 and b'"content": "a"' in events[0]
    error = orjson.loads(events[-1].removeprefix(b"data: "))["error"]
    assert error["message"] == "engine stream stalled: no bytes for 0.3 s"
    assert 'kvgate_upstream_errors_total{engine="sim-0",stage="mid_stream"} 1.0' in metrics
    assert _breaker(metrics, "sim-0") == "2.0"  # open: one failure is the threshold here
    assert [e["breaker"] for e in health.json()["engines"]] == ["open"]
