"""KV-cache events: vLLM's ZMQ wire format, decoded (no sockets here).

Wire (vLLM ``vllm/distributed/kv_events.py``): ZMQ PUB multipart ``(topic, seq, payload)``;
``seq`` is an 8-byte big-endian counter per publisher (engine and data-parallel rank) from 0;
``payload`` is msgpack of ``[ts, events, dp_rank]`` (a map with those names is accepted too).
Events are tagged maps ``{"type": "BlockStored", ...}`` (newer engines) or positional arrays
``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
lora_name, extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window, locality]``
(older engines); ``BlockRemoved`` is ``[tag, block_hashes, medium, group_idx, locality]``,
``AllBlocksCleared`` has no fields. Only the first four ``BlockStored`` fields and the first
``BlockRemoved`` field are required; ``token_ids`` may be empty (vLLM 0.32's Mooncake store
worker, ``mooncake/store/worker.py``, publishes one ``BlockStored`` per stored block with
``medium: "cpu"``, the engine's block hash, its predecessor's hash as parent, and ``[]`` as
token ids when the request's tokens for that block are not at hand); ``medium`` absent means
GPU, ``group_idx`` absent means 0, ``locality`` absent means unspecified (``REMOTE``: a store
shared by the fleet, plugins/prefix/shared_tier.py); unknown keys, trailing fields and event
types are ignored (forward compatible).

Replay (vLLM's optional ``replay_endpoint``, a ZMQ ROUTER the engine binds): a client (DEALER)
sends ``(b"", start_seq)`` with ``start_seq`` 8 bytes big-endian; the engine answers every
buffered batch with ``seq >= start_seq`` as ``(b"", topic, seq, payload)``, then the end marker
``(b"", b"", END_SEQ, b"")`` with ``END_SEQ`` = -1 as 8 signed big-endian bytes. Its buffer
keeps the last ``buffer_steps`` (10,000 by default) batches.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import msgpack

log = logging.getLogger("kvgate.kv_events")

#: The replay end marker's sequence frame (vLLM ``ZmqEventPublisher.END_SEQ``).
END_SEQ = (-1).to_bytes(8, "big", signed=True)

#: Largest data-parallel rank accepted (bounds the per-engine sequence state).
MAX_DP_RANK = 255


class MalformedFrame(ValueError):
    """A message or event that does not follow the wire format."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[int | bytes, ...]
    parent_block_hash: int | bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    group_idx: int = 0
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    #: vLLM 0.32: ``LOCAL`` / ``REMOTE`` relative to the publisher (``REMOTE``: a shared store).
    locality: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int | bytes, ...]
    medium: str | None = None
    group_idx: int = 0
    locality: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared

_STORED_FIELDS = (
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
    "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
    "locality",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality")
_FIELDS: Mapping[str, tuple[tuple[str, ...], int]] = {  # tag -> (field order, required count)
    "BlockStored": (_STORED_FIELDS, 4),
    "BlockRemoved": (_REMOVED_FIELDS, 1),
    "AllBlocksCleared": ((), 0),
}


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One decoded message. ``events`` holds the well-formed events of known types."""

    topic: str
    seq: int
    ts: float
    dp_rank: int
    events: tuple[KvEvent, ...]
    malformed_events: int = 0
    unknown_events: int = 0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _hash(value: object, what: str) -> int | bytes:
    if _is_int(value) or isinstance(value, bytes):
        return value  # type: ignore[return-value]
    raise MalformedFrame(f"{what}: expected an int or bytes hash, got {type(value).__name__}")


def _hashes(value: object) -> tuple[int | bytes, ...]:
    if not isinstance(value, list):
        raise MalformedFrame("block_hashes must be an array")
    return tuple(_hash(v, "block_hashes") for v in value)


def _opt(value: object, kind: type, what: str) -> Any:
    if value is None or (isinstance(value, kind) and not isinstance(value, bool)):
        return value
    raise MalformedFrame(f"{what} must be {kind.__name__} or nil")


def _extra_keys(value: object) -> tuple[tuple[Any, ...] | None, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(v is None or isinstance(v, list) for v in value):
        raise MalformedFrame("extra_keys must be an array of arrays or nils")
    return tuple(None if v is None else tuple(v) for v in value)


def _stored(f: Mapping[str, Any]) -> BlockStored:
    tokens = f["token_ids"]
    # the type test in C (set(map(type))): a 15k-token event in ~0.2 ms, not ~2 ms
    if not isinstance(tokens, list) or not set(map(type, tokens)) <= {int}:
        raise MalformedFrame("token_ids must be an array of ints")
    size = f["block_size"]
    if not _is_int(size) or size <= 0:
        raise MalformedFrame("block_size must be a positive int")
    hashes = _hashes(f["block_hashes"])
    # Empty token ids are well-formed: vLLM 0.32's Mooncake store worker sends [] when it
    # lacks a block's tokens (the block is then known by its hash only: KvIndex.store_known).
    if tokens and len(tokens) != len(hashes) * size:
        raise MalformedFrame(
            f"{len(tokens)} token ids for {len(hashes)} blocks of {size} tokens"
        )
    parent = f["parent_block_hash"]
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=None if parent is None else _hash(parent, "parent_block_hash"),
        token_ids=tuple(tokens), block_size=size,
        lora_id=_opt(f.get("lora_id"), int, "lora_id"),
        medium=_opt(f.get("medium"), str, "medium"),
        lora_name=_opt(f.get("lora_name"), str, "lora_name"),
        extra_keys=_extra_keys(f.get("extra_keys")),
        group_idx=_opt(f.get("group_idx"), int, "group_idx") or 0,
        kv_cache_spec_kind=_opt(f.get("kv_cache_spec_kind"), str, "kv_cache_spec_kind"),
        kv_cache_spec_sliding_window=_opt(
            f.get("kv_cache_spec_sliding_window"), int, "kv_cache_spec_sliding_window"
        ),
        locality=_opt(f.get("locality"), str, "locality"),
    )


def _removed(f: Mapping[str, Any]) -> BlockRemoved:
    return BlockRemoved(
        block_hashes=_hashes(f["block_hashes"]),
        medium=_opt(f.get("medium"), str, "medium"),
        group_idx=_opt(f.get("group_idx"), int, "group_idx") or 0,
        locality=_opt(f.get("locality"), str, "locality"),
    )


def _fields_of(raw: object) -> tuple[str, dict[str, Any]] | None:
    """``(tag, fields)`` of a tagged map or positional array; None for an unknown tag."""
    if isinstance(raw, dict):
        tag, fields = raw.get("type"), {k: v for k, v in raw.items() if k != "type"}
    elif isinstance(raw, list) and raw:
        tag, values = raw[0], raw[1:]
        if not isinstance(tag, str):
            raise MalformedFrame("an event array must start with its type name")
        # Trailing fields beyond the known ones (a newer engine) are ignored, like unknown keys.
        fields = dict(zip(_FIELDS.get(tag, ((), 0))[0], values, strict=False))
    else:
        raise MalformedFrame(f"an event must be a map or an array, got {type(raw).__name__}")
    if not isinstance(tag, str):
        raise MalformedFrame("event without a string type")
    if tag not in _FIELDS:
        return None
    order, required = _FIELDS[tag]
    missing = [name for name in order[:required] if name not in fields]
    if missing:
        raise MalformedFrame(f"{tag}: missing {', '.join(missing)}")
    return tag, fields


def decode_event(raw: object) -> KvEvent | None:
    """One event in either encoding; None for an event type this version does not know."""
    parsed = _fields_of(raw)
    if parsed is None:
        return None
    tag, fields = parsed
    if tag == "BlockStored":
        return _stored(fields)
    if tag == "BlockRemoved":
        return _removed(fields)
    return AllBlocksCleared()


def _batch_parts(payload: object) -> tuple[float, list[Any], int]:
    if isinstance(payload, dict):
        ts, events, rank = (
            payload.get("ts"), payload.get("events"), payload.get("data_parallel_rank")
        )
    elif isinstance(payload, list) and 2 <= len(payload) <= 3:
        ts, events = payload[0], payload[1]
        rank = payload[2] if len(payload) == 3 else None
    else:
        raise MalformedFrame("the payload must be [ts, events, dp_rank] or a map")
    if not isinstance(ts, int | float) or isinstance(ts, bool) or not isinstance(events, list):
        raise MalformedFrame("bad ts or events in the batch")
    rank = 0 if rank is None else rank
    if not _is_int(rank) or not 0 <= rank <= MAX_DP_RANK:
        raise MalformedFrame(f"bad data_parallel_rank {rank!r}")
    return float(ts), events, rank


def decode_frames(frames: Sequence[bytes]) -> EventBatch:
    """Decode one multipart message; raises :class:`MalformedFrame` if it is unusable.

    A bad event inside a good batch does not fail the batch: it is counted in
    ``malformed_events`` and left out.
    """
    if len(frames) != 3:
        raise MalformedFrame(f"expected 3 frames (topic, seq, payload), got {len(frames)}")
    topic_b, seq_b, payload_b = frames
    if len(seq_b) != 8:
        raise MalformedFrame(f"sequence frame of {len(seq_b)} bytes, expected 8")
    try:
        topic = bytes(topic_b).decode("utf-8")
        payload = msgpack.unpackb(payload_b, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise MalformedFrame(f"undecodable frame: {exc}") from None
    ts, raw_events, rank = _batch_parts(payload)
    events: list[KvEvent] = []
    bad = unknown = 0
    for raw in raw_events:
        try:
            event = decode_event(raw)
        except (MalformedFrame, KeyError, TypeError) as exc:
            log.debug("malformed kv event skipped: %s", exc)
            bad += 1
            continue
        if event is None:
            unknown += 1
        else:
            events.append(event)
    seq = int.from_bytes(seq_b, "big", signed=True)
    return EventBatch(topic, seq, ts, rank, tuple(events), bad, unknown)


def topic_engine(topic: str, prefix: str) -> str | None:
    """The engine name of a ``<prefix>@<engine>[@model]`` topic (None if it is not one)."""
    parts = topic.split("@", 2)
    if len(parts) < 2 or parts[0] != prefix or not parts[1]:
        return None
    return parts[1]


def connect_address(address: str, engine_url: str) -> str:
    """The address to connect to for an engine's ``kv_events`` (a ``*`` host -> the URL host)."""
    if "://*:" in address:
        host = urlsplit(engine_url).hostname or "127.0.0.1"
        host = f"[{host}]" if ":" in host else host
        return address.replace("://*:", f"://{host}:", 1)
    return address


def offset_port(address: str, rank: int) -> str:
    """vLLM's per-data-parallel-rank address: the TCP port plus ``rank`` (others unchanged)."""
    if rank == 0 or not address.startswith("tcp://"):
        return address
    head, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return address
    return f"{head}:{int(port) + rank}"
