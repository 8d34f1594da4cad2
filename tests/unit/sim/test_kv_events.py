"""KV events: both wire encodings (decoded with msgpack), field order, bind/connect rule."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from kvgate.engines.sim.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Encoding,
    KvEvent,
    binds,
    encode_batch,
)

H1, H2, H0 = 2**64 - 1, 12345, 2**63  # unsigned 64-bit hashes, including the extremes
STORED = BlockStored(block_hashes=[H1, H2], parent_block_hash=H0, token_ids=[1, 2, 3, 4],
                     block_size=2)
SALTED = BlockStored(block_hashes=[H1], parent_block_hash=None, token_ids=[5, 6], block_size=2,
                     extra_keys=[("salt",)])


@pytest.mark.parametrize(("event", "encoding", "wire"), [
    (STORED, "tagged", {
        "type": "BlockStored", "block_hashes": [H1, H2], "parent_block_hash": H0,
        "token_ids": [1, 2, 3, 4], "block_size": 2, "lora_id": None, "medium": "GPU",
        "lora_name": None, "group_idx": 0, "kv_cache_spec_kind": "full_attention"}),
    # vLLM's msgspec array_like order; the defaulted None extra_keys stays (a later field is
    # set), the trailing defaulted kv_cache_spec_sliding_window is left out.
    (STORED, "positional", ["BlockStored", [H1, H2], H0, [1, 2, 3, 4], 2, None, "GPU", None,
                            None, 0, "full_attention"]),
    (SALTED, "tagged", {
        "type": "BlockStored", "block_hashes": [H1], "parent_block_hash": None,
        "token_ids": [5, 6], "block_size": 2, "lora_id": None, "medium": "GPU",
        "lora_name": None, "extra_keys": [["salt"]], "group_idx": 0,
        "kv_cache_spec_kind": "full_attention"}),
    (SALTED, "positional", ["BlockStored", [H1], None, [5, 6], 2, None, "GPU", None,
                            [["salt"]], 0, "full_attention"]),
    (BlockRemoved([H2]), "tagged",
     {"type": "BlockRemoved", "block_hashes": [H2], "medium": "GPU", "group_idx": 0}),
    (BlockRemoved([H2]), "positional", ["BlockRemoved", [H2], "GPU", 0]),
    (BlockRemoved([H2], group_idx=None), "positional", ["BlockRemoved", [H2], "GPU"]),
    (AllBlocksCleared(), "tagged", {"type": "AllBlocksCleared"}),
    (AllBlocksCleared(), "positional", ["AllBlocksCleared"]),
])
def test_event_wire_layout(event: KvEvent, encoding: Encoding, wire: Any) -> None:
    ts, events, rank = msgpack.unpackb(encode_batch([event], encoding, ts=12.5), raw=False)
    assert (ts, rank) == (12.5, 0)
    assert events == [wire]
    if isinstance(wire, dict):
        assert list(wire) == list(events[0])  # field order as declared in vLLM


@pytest.mark.parametrize("encoding", ["tagged", "positional"])
def test_batch_carries_events_in_order_and_rank(encoding: Encoding) -> None:
    batch: list[KvEvent] = [STORED, BlockRemoved([H1]), AllBlocksCleared()]
    _ts, events, rank = msgpack.unpackb(
        encode_batch(batch, encoding, ts=1.0, data_parallel_rank=3), raw=False)
    tags = [e["type"] if isinstance(e, dict) else e[0] for e in events]
    assert tags == ["BlockStored", "BlockRemoved", "AllBlocksCleared"] and rank == 3


@pytest.mark.parametrize(("endpoint", "bind"), [
    ("tcp://*:5557", True), ("tcp://127.0.0.1:*", True), ("tcp://[::]:5557", True),
    ("ipc:///tmp/kv", True), ("inproc://kv", True), ("tcp://127.0.0.1:5557", False),
    ("tcp://gateway:5557", False),
])
def test_bind_or_connect(endpoint: str, bind: bool) -> None:
    assert binds(endpoint) is bind
