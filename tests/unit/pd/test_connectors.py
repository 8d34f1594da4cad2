"""Connector request shaping: what each protocol puts on the wire; vLLM Mooncake's engine-id
lookup against a bootstrap server (the simulator's, which answers as vLLM 0.32's does)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvgate.engines.connectors import (
    ConnectorParams,
    EngineIds,
    MooncakeParams,
    SglangConnector,
    VllmMooncakeConnector,
    VllmNixlConnector,
    bootstrap_address,
    bootstrap_url,
    engine_id_from_query,
    transfer_id,
)
from kvgate.engines.sim.bootstrap import BootstrapServer
from kvgate.engines.sim.core.pd import KvBoard
from kvgate.middleware.framework.composition.registry import Registry
from kvgate.middleware.framework.connector import Connector, HopContext, TransferUnavailable
from kvgate.middleware.framework.types import Api, Endpoint, InferenceRequest, Role
from tests.servers import free_port

PREFILL = Endpoint("p", "http://10.0.0.5:8100", "vllm", role=Role.PREFILL)
LABELLED = Endpoint("q", "http://10.0.0.6:8100", "vllm", role=Role.PREFILL,
                    labels={"bootstrap_host": "10.1.0.6", "bootstrap_port": "9001"})
DECODE = Endpoint("d", "http://10.0.0.7:8200", "vllm", role=Role.DECODE)
CTX = HopContext("req-1", PREFILL, DECODE, room=12345)
BODY: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                        "stream": True, "stream_options": {"include_usage": True},
                        "max_tokens": 50, "min_tokens": 3, "temperature": 0}


def _req(api: Api = Api.CHAT) -> InferenceRequest:
    return InferenceRequest("req-1", api, "m", dict(BODY), {}, True, True, 10, time.monotonic())


def test_registered_through_entry_points() -> None:
    reg = Registry.from_entry_points()
    assert {"vllm-nixl", "vllm-mooncake", "sglang"} <= set(reg.connectors)
    for cls in reg.connectors.values():
        params = cls.Params()  # type: ignore[attr-defined]
        assert isinstance(cls(params), Connector)


@pytest.mark.parametrize(("api", "has_mct"), [(Api.CHAT, True), (Api.COMPLETIONS, False)])
def test_nixl_prefill_hop(api: Api, has_mct: bool) -> None:
    conn = VllmNixlConnector(ConnectorParams())
    out = conn.prefill_body(_req(api), dict(BODY), CTX)
    assert out["stream"] is False and out["max_tokens"] == 1
    assert ("max_completion_tokens" in out) is has_mct
    assert "stream_options" not in out and "min_tokens" not in out
    assert out["kv_transfer_params"] == {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None}
    assert out["messages"] == BODY["messages"] and out["temperature"] == 0
    assert BODY["stream"] is True  # the client's body is not changed


def test_nixl_decode_hop_uses_returned_params() -> None:
    conn = VllmNixlConnector(ConnectorParams())
    ktp = {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_engine_id": "e",
           "remote_host": "h", "remote_port": 5600, "remote_prefill_cached_tokens": 16}
    out = conn.decode_body(_req(), dict(BODY), CTX, {"kv_transfer_params": ktp})
    assert out["kv_transfer_params"] == ktp
    assert out["stream"] is True and out["max_tokens"] == 50 and out["min_tokens"] == 3
    with pytest.raises(TransferUnavailable):
        conn.decode_body(_req(), dict(BODY), CTX, {"kv_transfer_params": None})
    assert not conn.concurrent


@pytest.mark.parametrize(("answer", "hit"), [
    ({"usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 32}}}, 32),
    ({"usage": {"prompt_tokens": 9}, "kv_transfer_params": {"remote_prefill_cached_tokens": 16}},
     16),
    ({"usage": {"prompt_tokens": 9, "prompt_tokens_details": None}}, None),
    ({}, None),
])
def test_prefill_hit(answer: dict[str, Any], hit: int | None) -> None:
    assert VllmNixlConnector(ConnectorParams()).prefill_hit(answer) == hit


@pytest.mark.parametrize(("prefill", "url"), [
    (PREFILL, "http://10.0.0.5:8998"), (LABELLED, "http://10.1.0.6:9001"),
    (Endpoint("v6", "http://[fd00::5]:8100", "vllm"), "http://[fd00::5]:8998"),
])
def test_mooncake_hops_carry_exactly_what_vllm_032_parses(prefill: Endpoint, url: str) -> None:
    """Prefill: ``do_remote_decode`` + ``transfer_id``; decode: ``do_remote_prefill``, the same
    ``transfer_id``, the engine id ``prepare`` learned and the bootstrap URL (no path)."""
    conn = VllmMooncakeConnector(MooncakeParams())
    ctx = dataclasses.replace(CTX, prefill=prefill, prefill_engine_id="0b7c-engine")
    tid = "req-1-0000000000003039"  # request id + the attempt's room (12345) in hex
    pre = conn.prefill_body(_req(), dict(BODY, stop_token_ids=[7]), ctx)
    assert pre["kv_transfer_params"] == {"do_remote_decode": True, "transfer_id": tid}
    assert pre["max_tokens"] == 1 and pre["stream"] is False and "stream_options" not in pre
    # vLLM 0.32 offers the KV only on a length-capped finish: no EOS or stop-token stop
    assert pre["ignore_eos"] is True and "stop_token_ids" not in pre
    dec = conn.decode_body(_req(), dict(BODY), ctx, None)
    assert dec["kv_transfer_params"] == {
        "do_remote_prefill": True, "transfer_id": tid, "remote_engine_id": "0b7c-engine",
        "remote_bootstrap_addr": url}
    assert dec["stream"] is True and dec["max_tokens"] == 50
    assert conn.concurrent


def test_mooncake_transfer_id_is_new_per_attempt() -> None:
    """A retried request (new room) never reuses an attempt's transfer id."""
    first, retry = CTX, dataclasses.replace(CTX, room=CTX.room + 1)
    assert transfer_id(first) != transfer_id(retry)
    assert transfer_id(first).startswith("req-1-")


def test_old_mooncake_params_are_refused() -> None:
    """``host_key`` / ``port_key`` named the wrong fields (``bootstrap_server_host/port``)."""
    with pytest.raises(ValueError, match="host_key"):
        MooncakeParams.model_validate({"host_key": "bootstrap_server_host"})


@pytest.mark.parametrize(("answer", "expected"), [
    ({"0": {"engine_id": "e-1", "worker_addr": {"0": {"0": "tcp://10.0.0.5:41000"}}}}, "e-1"),
    ({}, "registered"),
    ({"0": {"engine_id": "a", "worker_addr": {}}, "1": {"engine_id": "b", "worker_addr": {}}},
     "2 data-parallel ranks"),
    ({"0": {"worker_addr": {}}}, "no engine_id"),
    ({"0": {"engine_id": ""}}, "no engine_id"),
    ({"0": "e-1"}, "no engine_id"),
    (["e-1"], "not a JSON object"),
])
def test_engine_id_from_query(answer: object, expected: str) -> None:
    if expected == "e-1":
        assert engine_id_from_query(answer) == "e-1"
        return
    with pytest.raises(TransferUnavailable, match=expected):
        engine_id_from_query(answer)


@pytest.mark.parametrize(("host", "url"), [
    ("10.0.0.5", "http://10.0.0.5:8998"), ("fd00::5", "http://[fd00::5]:8998"),
    ("[fd00::5]", "http://[fd00::5]:8998"), ("prefill-a.svc", "http://prefill-a.svc:8998"),
])
def test_bootstrap_url(host: str, url: str) -> None:
    assert bootstrap_url(host, 8998) == url


@contextlib.asynccontextmanager
async def _bootstrap(engine_id: str = "e-1") -> AsyncIterator[tuple[BootstrapServer, str]]:
    server = BootstrapServer(engine_id, KvBoard(4), "127.0.0.1", 0)
    await server.start()
    try:
        yield server, f"http://127.0.0.1:{server.port}"
    finally:
        await server.stop()


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_engine_ids_cache_share_refresh_and_forget() -> None:
    clock = _Clock()
    ids = EngineIds(ttl_s=30.0, timeout_s=2.0, clock=clock)
    async with _bootstrap() as (server, url), aiohttp.ClientSession() as session:
        got = await asyncio.gather(*(ids.get(session, url) for _ in range(5)))
        assert got == ["e-1"] * 5 and server.queries == 1  # concurrent lookups share one query
        clock.now = 29.0
        assert await ids.get(session, url) == "e-1" and server.queries == 1  # cached
        server.engine_id = "e-2"  # the engine restarted with a new id
        clock.now = 30.0
        assert await ids.get(session, url) == "e-2" and server.queries == 2  # expired: asked
        server.engine_id = "e-3"
        ids.forget(url)  # a hop failed
        assert await ids.get(session, url) == "e-3" and server.queries == 3


async def test_engine_ids_are_bounded_least_recently_used_first() -> None:
    ids = EngineIds(ttl_s=30.0, timeout_s=2.0, limit=2)
    async with _bootstrap("a") as (a, url_a), _bootstrap("b") as (_, url_b), \
            _bootstrap("c") as (_, url_c), aiohttp.ClientSession() as session:
        for url in (url_a, url_b, url_a, url_c):  # b is the least recently used when c comes
            await ids.get(session, url)
        assert len(ids) == 2
        await ids.get(session, url_a)
        assert a.queries == 1  # a stayed
        await ids.get(session, url_b)  # b was evicted: asked again
        assert len(ids) == 2


@contextlib.asynccontextmanager
async def _answering(status: int, body: str) -> AsyncIterator[str]:
    async def query(request: web.Request) -> web.Response:
        return web.Response(status=status, text=body, content_type="application/json")

    app = web.Application()
    app.router.add_get("/query", query)
    runner = web.AppRunner(app)
    await runner.setup()
    sock = socket.create_server(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(("status", "body", "why"), [
    (500, "{}", "answered 500"), (200, "not json", "no JSON"), (200, "{}", "registered"),
])
async def test_engine_ids_failures_are_transfer_unavailable(
        status: int, body: str, why: str) -> None:
    ids = EngineIds(ttl_s=30.0, timeout_s=2.0)
    async with _answering(status, body) as url, aiohttp.ClientSession() as session:
        with pytest.raises(TransferUnavailable, match=why):
            await ids.get(session, url)
        assert len(ids) == 0  # nothing cached: the next request asks again
    async with aiohttp.ClientSession() as session:
        with pytest.raises(TransferUnavailable, match="unreachable"):
            await ids.get(session, f"http://127.0.0.1:{free_port()}")  # nothing listens


async def test_mooncake_prepare_and_hop_failed() -> None:
    """``prepare`` puts the bootstrap server's engine id into the context; ``hop_failed``
    makes the next request ask again."""
    conn = VllmMooncakeConnector(MooncakeParams())
    async with _bootstrap("p-engine") as (server, url), aiohttp.ClientSession() as session:
        prefill = Endpoint("p", "http://127.0.0.1:1", "vllm", role=Role.PREFILL,
                           labels={"bootstrap_port": str(server.port)})
        ctx = dataclasses.replace(CTX, prefill=prefill)
        ready = await conn.prepare(session, ctx)
        assert ready.prefill_engine_id == "p-engine" and ctx.prefill_engine_id is None
        dec = conn.decode_body(_req(), dict(BODY), ready, None)
        assert dec["kv_transfer_params"]["remote_bootstrap_addr"] == url
        await conn.prepare(session, ctx)
        assert server.queries == 1
        conn.hop_failed(ctx)
        await conn.prepare(session, ctx)
        assert server.queries == 2


@pytest.mark.parametrize("conn", [VllmNixlConnector(ConnectorParams()),
                                  SglangConnector(ConnectorParams())])
async def test_other_connectors_prepare_nothing(conn: Connector) -> None:
    async with aiohttp.ClientSession() as session:
        assert await conn.prepare(session, CTX) is CTX
    conn.hop_failed(CTX)


def test_sglang_hops_share_room() -> None:
    conn = SglangConnector(ConnectorParams())
    ctx = HopContext("req-1", LABELLED, DECODE, room=2**63 - 1)
    pre = conn.prefill_body(_req(), dict(BODY), ctx)
    dec = conn.decode_body(_req(), dict(BODY), ctx, None)
    for out in (pre, dec):
        assert (out["bootstrap_host"], out["bootstrap_port"], out["bootstrap_room"]) == (
            "10.1.0.6", 9001, 2**63 - 1)
    assert pre["stream"] is False and "stream_options" not in pre
    assert dec["stream"] is True and dec["max_tokens"] == 50


@pytest.mark.parametrize(("ep", "expected"), [
    (PREFILL, ("10.0.0.5", 8998)), (LABELLED, ("10.1.0.6", 9001)),
    (Endpoint("x", "http://host:1", "vllm", labels={"bootstrap_port": "bad"}), ("host", 8998)),
])
def test_bootstrap_address(ep: Endpoint, expected: tuple[str, int]) -> None:
    assert bootstrap_address(ep, 8998) == expected
