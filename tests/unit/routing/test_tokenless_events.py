"""Store events without token ids (issue 32): vLLM 0.32's Mooncake store worker
(``kv_connector/v1/mooncake/store/worker.py``) publishes one ``BlockStored`` per stored block,
``medium: "cpu"``, the engine's block hash, its predecessor's hash as parent, and ``[]`` as token
ids when it lacks the block's tokens. Such an event is well-formed: the block is in the store,
known by its hash; kvgate files it under the shared tier when it already knows that hash (from the
publishing engine's own GPU events, which carried the tokens), and counts it apart otherwise —
never as malformed."""

from __future__ import annotations

from typing import Any

import pytest

from kvgate.plugins.prefix.events.wire import BlockStored, decode_event, decode_frames
from kvgate.plugins.prefix.shared_tier import SHARED_HOLDER
from tests.unit.routing.helpers import blocks, frames, stored, subscriber
from tests.unit.routing.test_shared_tier_events import _match

BS = 16


def _store_event(h: int, parent: int | None, *, encoding: str = "tagged", **more: Any) -> Any:
    """What vLLM 0.32's Mooncake store worker publishes for one block whose tokens it lacks."""
    fields = {"block_hashes": [h], "parent_block_hash": parent, "token_ids": [],
              "block_size": BS, "lora_id": None, "medium": "cpu", "lora_name": None,
              "extra_keys": None, "group_idx": 0, **more}
    if encoding == "tagged":
        return {"type": "BlockStored", **fields}
    return ["BlockStored", *fields.values()]


@pytest.mark.parametrize("encoding", ["tagged", "positional"])
def test_an_empty_token_list_decodes_as_a_store_event(encoding: str) -> None:
    event = decode_event(_store_event(7, 6, encoding=encoding))
    assert event == BlockStored(block_hashes=(7,), parent_block_hash=6, token_ids=(),
                                block_size=BS, medium="cpu", group_idx=0)
    batch = decode_frames(frames("kv@e0@m", 0, [_store_event(7, None), _store_event(8, 7)]))
    assert (len(batch.events), batch.malformed_events) == (2, 0)


TOKS = blocks(11, 3, BS)
GPU = stored([1, 2, 3], None, TOKS, BS)  # e0's own GPU events carry the tokens

#: (case, [(publisher, events)], kv-events params, shared-tier blocks, tokenless_blocks,
#:  tokenless_unknown)
CASES: list[tuple[str, list[tuple[str, list[Any]]], dict[str, Any], int, int, int]] = [
    ("Mooncake store events after the engine's GPU events",
     [("e0", [GPU, _store_event(1, None), _store_event(2, 1)])], {"shared_media": ["cpu"]},
     2, 2, 0),
    ("a hash nobody has seen is counted, not indexed",
     [("e0", [_store_event(99, None)])], {"shared_media": ["cpu"]}, 0, 0, 1),
    ("the simulator's evicted write: CPU, REMOTE, no parent",
     [("e0", [GPU, stored([3], None, [], BS, medium="CPU", locality="REMOTE")])], {}, 1, 1, 0),
    ("another engine's store event for a block already in the tier",
     [("e0", [GPU, _store_event(1, None)]), ("e1", [_store_event(1, None)])],
     {"shared_media": ["cpu"]}, 1, 2, 0),
    ("another engine's store event for a hash only e0 knows",
     [("e0", [GPU]), ("e1", [_store_event(2, 1)])], {"shared_media": ["cpu"]}, 0, 0, 1),
    ("a token-less parent lets a later event with tokens chain on it",
     [("e0", [GPU, _store_event(1, None),
              stored([2], 1, TOKS[BS:2 * BS], BS, medium="cpu")])], {"shared_media": ["cpu"]},
     2, 1, 0),
    ("without shared_media the engine's own CPU tier is refreshed",
     [("e0", [GPU, _store_event(1, None)])], {}, 0, 1, 0),
]


@pytest.mark.parametrize(("case", "sent", "params", "shared", "filed", "unknown"), CASES,
                         ids=[c[0] for c in CASES])
def test_tokenless_store_events(case: str, sent: list[tuple[str, list[Any]]],
                                params: dict[str, Any], shared: int, filed: int,
                                unknown: int) -> None:
    sub = subscriber(["e0", "e1"], **params)
    seqs: dict[str, int] = {}
    for engine, events in sent:
        seq = seqs.get(engine, 0)
        sub.handle_frames(frames(f"kv@{engine}@m", seq, events))
        seqs[engine] = seq + 1
    stats = sub.index.stats
    assert sub.index.blocks_of(SHARED_HOLDER) == shared
    assert (stats.tokenless_blocks, stats.tokenless_unknown) == (filed, unknown)
    assert (sub.stats.malformed_events, sub.stats.malformed_messages) == (0, 0)
    assert sub.stats.events_applied["BlockStored"] == sum(
        1 for _, events in sent for e in events if e["type"] == "BlockStored")


async def test_a_tokenless_tier_prefix_is_credited_to_every_engine() -> None:
    sub = subscriber(["e0", "e1", "e2"], shared_media=["cpu"])
    sub.handle_frames(frames("kv@e0@m", 0, [GPU, _store_event(1, None), _store_event(2, 1)]))
    match = await _match(sub, [*TOKS, 7])
    assert dict(match.device) == {"e0": 3 * BS}
    assert dict(match.other) == {"e0": 0, "e1": 2 * BS, "e2": 2 * BS}


def test_tokenless_counters_reach_metrics() -> None:
    sub = subscriber(["e0"], shared_media=["cpu"])
    sub.handle_frames(frames("kv@e0@m", 0, [GPU, _store_event(1, None), _store_event(42, 1)]))
    names = {m.name: m.samples[0].value for m in sub.collector().collect() if m.samples}
    assert names["kvgate_kv_index_tokenless_blocks"] == 1
    assert names["kvgate_kv_index_tokenless_unknown"] == 1
