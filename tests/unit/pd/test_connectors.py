"""Connector request shaping: what each protocol puts on the wire."""

from __future__ import annotations

import time
from typing import Any

import pytest

from engines.connectors import (
    ConnectorParams,
    MooncakeParams,
    SglangConnector,
    VllmMooncakeConnector,
    VllmNixlConnector,
    bootstrap_address,
)
from middleware.connector import Connector, HopContext, TransferUnavailable
from middleware.registry import Registry
from middleware.types import Api, Endpoint, InferenceRequest, Role

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


def test_mooncake_hops() -> None:
    conn = VllmMooncakeConnector(MooncakeParams())
    pre = conn.prefill_body(_req(), dict(BODY), CTX)
    assert pre["kv_transfer_params"]["do_remote_decode"] is True
    assert pre["kv_transfer_params"]["transfer_id"] == "req-1"
    assert pre["max_tokens"] == 1 and pre["stream"] is False
    dec = conn.decode_body(_req(), dict(BODY), CTX, None)
    assert dec["kv_transfer_params"] == {
        "do_remote_prefill": True, "do_remote_decode": False, "transfer_id": "req-1",
        "bootstrap_server_host": "10.0.0.5", "bootstrap_server_port": 8998}
    assert conn.concurrent


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
