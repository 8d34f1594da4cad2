"""KV-event wire decoding (both encodings), malformed input, and the subscriber's bookkeeping."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from kvgate.plugins.prefix.events.subscriber import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    MalformedFrame,
    connect_address,
    decode_event,
    decode_frames,
    topic_engine,
)
from tests.unit.routing.helpers import (
    blocks,
    cleared,
    endpoint,
    frames,
    removed,
    stored,
    subscriber,
)

ENCODINGS = ["tagged", "positional"]

DECODE_CASES: list[tuple[str, Any, Any]] = [
    ("stored minimal positional", ["BlockStored", [1, 2], None, [5, 6, 7, 8], 2],
     BlockStored((1, 2), None, (5, 6, 7, 8), 2)),
    ("stored with medium and lora", ["BlockStored", [3], 9, [1, 2], 2, 7, "CPU", "ad"],
     BlockStored((3,), 9, (1, 2), 2, lora_id=7, medium="CPU", lora_name="ad")),
    ("stored all fields positional",
     ["BlockStored", [3], None, [1, 2], 2, None, "GPU", None, [["salt"]], 1, "full_attention", None],
     BlockStored((3,), None, (1, 2), 2, medium="GPU", extra_keys=(("salt",),), group_idx=1,
                 kv_cache_spec_kind="full_attention")),
    ("stored trailing unknown positional field ignored",
     ["BlockStored", [3], None, [1, 2], 2, None, "GPU", None, None, 0, None, None, None, "future"],
     BlockStored((3,), None, (1, 2), 2, medium="GPU")),
    ("stored shared tier positional (vLLM 0.32 locality)",
     ["BlockStored", [3], None, [1, 2], 2, None, "CPU", None, None, 0, None, None, "REMOTE"],
     BlockStored((3,), None, (1, 2), 2, medium="CPU", locality="REMOTE")),
    ("removed shared tier tagged", {"type": "BlockRemoved", "block_hashes": [5],
                                    "medium": "CPU", "locality": "REMOTE"},
     BlockRemoved((5,), "CPU", locality="REMOTE")),
    ("stored tagged", {"type": "BlockStored", "block_hashes": [4], "parent_block_hash": 3,
                       "token_ids": [1, 2], "block_size": 2, "lora_id": None, "medium": "GPU",
                       "extra_keys": [None], "group_idx": 0},
     BlockStored((4,), 3, (1, 2), 2, medium="GPU", extra_keys=(None,))),
    ("stored tagged unknown key ignored", {"type": "BlockStored", "block_hashes": [4],
                                           "parent_block_hash": None, "token_ids": [1],
                                           "block_size": 1, "new_field": 1},
     BlockStored((4,), None, (1,), 1)),
    ("stored bytes hashes", ["BlockStored", [b"\x01\x02"], b"\x00", [1], 1],
     BlockStored((b"\x01\x02",), b"\x00", (1,), 1)),
    ("removed positional", ["BlockRemoved", [5], "GPU"], BlockRemoved((5,), "GPU")),
    ("removed positional hashes only", ["BlockRemoved", [5]], BlockRemoved((5,))),
    ("removed tagged with group", {"type": "BlockRemoved", "block_hashes": [5, 6],
                                   "medium": "CPU", "group_idx": 2},
     BlockRemoved((5, 6), "CPU", 2)),
    ("cleared positional", ["AllBlocksCleared"], AllBlocksCleared()),
    ("cleared tagged", {"type": "AllBlocksCleared"}, AllBlocksCleared()),
    ("unknown type tagged", {"type": "BlockPinned", "x": 1}, None),
    ("unknown type positional", ["BlockPinned", 1, 2], None),
]


@pytest.mark.parametrize(("case", "raw", "expected"), DECODE_CASES, ids=[c[0] for c in DECODE_CASES])
def test_decode_event(case: str, raw: Any, expected: Any) -> None:
    assert decode_event(raw) == expected


BAD_EVENTS: list[tuple[str, Any]] = [
    ("not a container", 5),
    ("empty array", []),
    ("array without tag", [1, 2]),
    ("map without type", {"block_hashes": [1]}),
    ("stored missing block_size", ["BlockStored", [1], None, [1]]),
    ("stored tokens not ints", ["BlockStored", [1], None, ["a"], 1]),
    ("stored token count mismatch", ["BlockStored", [1, 2], None, [1, 2, 3], 2]),
    ("stored zero block size", ["BlockStored", [], None, [], 0]),
    ("stored hash is a string", ["BlockStored", ["x"], None, [1], 1]),
    ("stored bool block size", ["BlockStored", [1], None, [1], True]),
    ("stored medium not a string", ["BlockStored", [1], None, [1], 1, None, 5]),
    ("stored bad extra keys", ["BlockStored", [1], None, [1], 1, None, "GPU", None, "salt"]),
    ("removed hashes not array", {"type": "BlockRemoved", "block_hashes": 5}),
    ("removed missing hashes", {"type": "BlockRemoved"}),
]


@pytest.mark.parametrize(("case", "raw"), BAD_EVENTS, ids=[c[0] for c in BAD_EVENTS])
def test_decode_event_rejects(case: str, raw: Any) -> None:
    with pytest.raises((MalformedFrame, KeyError, TypeError)):
        decode_event(raw)


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_decode_frames_batch(encoding: str) -> None:
    events = [stored([1], None, [1, 2], 2, encoding=encoding), removed([1], encoding=encoding),
              cleared(encoding=encoding), {"type": "Nope"}, ["BlockStored", "bad"]]
    batch = decode_frames(frames("kv@e0@m", 41, events, rank=2))
    assert (batch.topic, batch.seq, batch.dp_rank) == ("kv@e0@m", 41, 2)
    assert [type(e).__name__ for e in batch.events] == [
        "BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert (batch.unknown_events, batch.malformed_events) == (1, 1)


def test_decode_frames_map_batch() -> None:
    payload = msgpack.packb({"ts": 1.5, "events": [cleared()]}, use_bin_type=True)
    batch = decode_frames([b"kv@e0", (0).to_bytes(8, "big"), payload])
    assert (batch.ts, batch.dp_rank, batch.events) == (1.5, 0, (AllBlocksCleared(),))


def _payload(obj: Any) -> bytes:
    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return packed


BAD_FRAMES: list[tuple[str, list[bytes]]] = [
    ("two frames", [b"kv@e0", (0).to_bytes(8, "big")]),
    ("four frames", [b"kv@e0", (0).to_bytes(8, "big"), _payload([0, [], 0]), b""]),
    ("short seq", [b"kv@e0", b"\x00\x01", _payload([0, [], 0])]),
    ("not msgpack", [b"kv@e0", (0).to_bytes(8, "big"), b"\xc1\xc1\xc1"]),
    ("truncated msgpack", [b"kv@e0", (0).to_bytes(8, "big"), _payload([0, [1, 2, 3], 0])[:-2]]),
    ("trailing bytes", [b"kv@e0", (0).to_bytes(8, "big"), _payload([0, [], 0]) + b"\x00"]),
    ("payload not a batch", [b"kv@e0", (0).to_bytes(8, "big"), _payload("hello")]),
    ("events not a list", [b"kv@e0", (0).to_bytes(8, "big"), _payload([0, 5, 0])]),
    ("ts not a number", [b"kv@e0", (0).to_bytes(8, "big"), _payload(["x", [], 0])]),
    ("negative dp rank", [b"kv@e0", (0).to_bytes(8, "big"), _payload([0, [], -1])]),
    ("topic not utf-8", [b"\xff\xfe", (0).to_bytes(8, "big"), _payload([0, [], 0])]),
]


@pytest.mark.parametrize(("case", "msg"), BAD_FRAMES, ids=[c[0] for c in BAD_FRAMES])
def test_decode_frames_rejects(case: str, msg: list[bytes]) -> None:
    with pytest.raises(MalformedFrame):
        decode_frames(msg)


@pytest.mark.parametrize(("case", "msg"), BAD_FRAMES, ids=[c[0] for c in BAD_FRAMES])
def test_subscriber_counts_and_survives_malformed(case: str, msg: list[bytes]) -> None:
    sub = subscriber(["e0"])
    sub.handle_frames(msg)
    sub.handle_frames(frames("kv@e0", 0, [stored([1], None, [1, 2], 2)]))
    assert sub.stats.malformed_messages == 1
    assert sub.stats.events_applied["BlockStored"] == 1
    assert len(sub.index) == 1


TOPICS = [("kv@e0", "e0"), ("kv@e0@model-a", "e0"), ("kv@e0@org/model@x", "e0"), ("kv", None),
          ("kv@", None), ("other@e0", None), ("", None)]


@pytest.mark.parametrize(("topic", "engine"), TOPICS)
def test_topic_engine(topic: str, engine: str | None) -> None:
    assert topic_engine(topic, "kv") == engine


@pytest.mark.parametrize(("address", "url", "expected"), [
    ("tcp://*:5557", "http://10.0.0.2:8000", "tcp://10.0.0.2:5557"),
    ("tcp://*:5557", "http://[::1]:8000", "tcp://[::1]:5557"),
    ("tcp://10.0.0.9:5557", "http://10.0.0.2:8000", "tcp://10.0.0.9:5557"),
    ("ipc:///tmp/kv", "http://h:1", "ipc:///tmp/kv"),
])
def test_connect_address(address: str, url: str, expected: str) -> None:
    assert connect_address(address, url) == expected


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_subscriber_applies_store_and_tail_to_root_removals(encoding: str) -> None:
    sub = subscriber(["e0", "e1"])
    toks = blocks(1, 3, 4)
    sub.handle_frames(frames("kv@e0@m", 0, [stored([11, 12, 13], None, toks, 4,
                                                   encoding=encoding)]))
    assert sub.index.blocks_of("e0") == 3
    for seq, h in enumerate([13, 12, 11], start=1):  # vLLM: one hash per event, tail first
        sub.handle_frames(frames("kv@e0@m", seq, [removed([h], encoding=encoding)]))
        assert sub.index.blocks_of("e0") == 3 - seq
    assert sub.stats.events_applied == {"BlockStored": 1, "BlockRemoved": 3, "AllBlocksCleared": 0}
    assert sub.stats.sequence_gaps == sub.stats.sequence_restarts == 0


SEQ_CASES = [
    ("in order", [0, 1, 2], 0, 0, 3),
    ("first seen mid-stream", [57, 58], 0, 0, 2),
    ("gap resets", [0, 1, 5], 1, 0, 1),
    ("restart from zero resets", [0, 1, 2, 0], 0, 1, 1),
    ("repeat resets", [0, 1, 1], 0, 1, 1),
]


@pytest.mark.parametrize(("case", "seqs", "gaps", "restarts", "left"), SEQ_CASES,
                         ids=[c[0] for c in SEQ_CASES])
def test_sequence_tracking(case: str, seqs: list[int], gaps: int, restarts: int,
                           left: int) -> None:
    """Each message stores one new root block on e0; a reset drops the earlier ones."""
    sub = subscriber(["e0", "e1"])
    sub.handle_frames(frames("kv@e1", 0, [stored([99], None, [9, 9], 2)]))
    for i, seq in enumerate(seqs):
        sub.handle_frames(frames("kv@e0", seq, [stored([100 + i], None, blocks(i, 1, 2), 2)]))
    assert (sub.stats.sequence_gaps, sub.stats.sequence_restarts) == (gaps, restarts)
    assert sub.index.blocks_of("e0") == left
    assert sub.index.blocks_of("e1") == 1  # other engines untouched


def test_dp_ranks_are_separate_holders_with_their_own_sequence() -> None:
    sub = subscriber(["e0"])
    sub.handle_frames(frames("kv@e0", 0, [stored([1], None, [1, 2], 2)], rank=0))
    sub.handle_frames(frames("kv@e0", 0, [stored([1], None, [1, 2], 2)], rank=1))
    sub.handle_frames(frames("kv@e0", 1, [removed([1])], rank=1))
    assert sub.stats.sequence_restarts == 0
    assert (sub.index.blocks_of("e0"), sub.index.blocks_of("e0#dp1")) == (1, 0)


def test_unknown_topics_are_counted_not_indexed() -> None:
    sub = subscriber(["e0"])
    sub.handle_frames(frames("kv@stranger", 0, [stored([1], None, [1], 1)]))
    sub.handle_frames(frames("nokv", 0, [stored([1], None, [1], 1)]))
    assert sub.stats.unknown_topics == 2
    assert len(sub.index) == 0


def test_all_blocks_cleared_and_endpoint_removal() -> None:
    sub = subscriber(["e0", "e1"])
    sub.handle_frames(frames("kv@e0", 0, [stored([1, 2], None, [1, 2, 3, 4], 2)]))
    sub.handle_frames(frames("kv@e1", 0, [stored([1, 2], None, [1, 2, 3, 4], 2)]))
    sub.handle_frames(frames("kv@e0", 1, [cleared()]))
    assert (sub.index.blocks_of("e0"), sub.index.blocks_of("e1")) == (0, 2)
    sub.on_endpoints_changed([], [endpoint("e1")])
    assert len(sub.index) == 0
    sub.handle_frames(frames("kv@e1", 1, [stored([3], None, [1, 2], 2)]))
    assert sub.stats.unknown_topics == 1


def test_unhashable_tokens_count_as_malformed() -> None:
    sub = subscriber(["e0"])
    sub.handle_frames(frames("kv@e0", 0, [stored([1], None, [-3, 2], 2)]))
    assert sub.stats.malformed_events == 1
    assert sub.stats.events_applied["BlockStored"] == 0


def test_collector_exports_counters() -> None:
    sub = subscriber(["e0"])
    sub.handle_frames(frames("kv@e0", 0, [stored([1], None, [1, 2], 2)]))
    names = {m.name: m for m in sub.collector().collect()}
    applied = names["kvgate_kv_events_applied"]
    assert {s.labels["type"]: s.value for s in applied.samples}["BlockStored"] == 1
    assert names["kvgate_kv_index_blocks"].samples[0].value == 1
