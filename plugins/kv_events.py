"""KV-cache events from vLLM-compatible engines: wire decoding and the ZMQ subscriber plugin.

Wire (vLLM ``vllm/distributed/kv_events.py``): ZMQ PUB multipart ``(topic, seq, payload)``;
``seq`` is an 8-byte big-endian counter per publisher (engine and data-parallel rank) from 0;
``payload`` is msgpack of ``[ts, events, dp_rank]`` (a map with those names is accepted too).
Events are tagged maps ``{"type": "BlockStored", ...}`` (newer engines) or positional arrays
``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
lora_name, extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window]`` (older
engines); ``BlockRemoved`` is ``[tag, block_hashes, medium, group_idx]``, ``AllBlocksCleared``
has no fields. Only the first four ``BlockStored`` fields and the first ``BlockRemoved`` field
are required; ``medium`` absent means GPU, ``group_idx`` absent means 0; unknown keys, trailing
fields and event types are ignored (forward compatible).

The subscriber (plugin ``kv-events``) owns one ``zmq.asyncio`` SUB socket subscribed to every
topic: it binds ``bind`` (engines with a plain endpoint connect to it) and/or connects to each
engine's configured ``kv_events`` address (engines started with ``tcp://*:port`` bind; the ``*``
becomes the engine URL's host). Topic ``kv@<engine>[@model]`` names the engine. Per (engine,
rank) a sequence jump (lost batches) or step back (restart) resets that rank's entries before the
batch is applied. Malformed frames and events are counted and skipped. Counters live in
:attr:`KvEventsSubscriber.stats`; :meth:`KvEventsSubscriber.collector` exports them to the app's
Prometheus registry (one per app: the plugin registers nothing itself).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar
from urllib.parse import urlsplit

import msgpack
import zmq
import zmq.asyncio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from pydantic import BaseModel, ConfigDict, Field

from middleware.errors import ConfigError
from middleware.plugin import EndpointSetListener, Lifecycle, Plugin, PluginLookup
from middleware.types import Endpoint
from plugins.kv_index import HashingError, KvIndex, holder_id

log = logging.getLogger("kvgate.kv_events")

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


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int | bytes, ...]
    medium: str | None = None
    group_idx: int = 0


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared

_STORED_FIELDS = (
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
    "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
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
    if not isinstance(tokens, list) or not all(_is_int(t) for t in tokens):
        raise MalformedFrame("token_ids must be an array of ints")
    size = f["block_size"]
    if not _is_int(size) or size <= 0:
        raise MalformedFrame("block_size must be a positive int")
    hashes = _hashes(f["block_hashes"])
    if len(tokens) != len(hashes) * size:
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
    )


def _removed(f: Mapping[str, Any]) -> BlockRemoved:
    return BlockRemoved(
        block_hashes=_hashes(f["block_hashes"]),
        medium=_opt(f.get("medium"), str, "medium"),
        group_idx=_opt(f.get("group_idx"), int, "group_idx") or 0,
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


@dataclass(slots=True)
class KvEventsStats:
    """Monotonic counters of the subscriber (messages are ZMQ multipart messages = batches)."""

    messages: int = 0
    malformed_messages: int = 0
    malformed_events: int = 0
    unknown_events: int = 0
    unknown_topics: int = 0
    sequence_gaps: int = 0
    sequence_restarts: int = 0
    events_applied: dict[str, int] = field(
        default_factory=lambda: {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}
    )

    @property
    def total_applied(self) -> int:
        return sum(self.events_applied.values())


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


class KvEventsSubscriber(Plugin, Lifecycle, EndpointSetListener):
    """Plugin ``kv-events``: subscribes to the engines' KV events and keeps the block index.

    Owns a :class:`~plugins.kv_index.KvIndex` (read by ``prefix-cache-producer`` in precise mode
    through :attr:`index`). See the module docstring for the wire format, sequence handling and
    counters, and docs/plugins/kv-events.md for the parameters.
    """

    type_name: ClassVar[str] = "kv-events"

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)
        #: ZMQ address the SUB socket binds; engines with a plain ``endpoint`` connect here.
        bind: str | None = None
        #: Also connect to every engine's configured ``kv_events`` address (engines that bind).
        connect: bool = True
        #: First part of the topic: ``<topic_prefix>@<engine>[@model]``.
        topic_prefix: str = Field("kv", min_length=1)
        #: Index bound, in (engine, block) pairs. 262,144 x ~360 bytes ~= 90 MiB; a fleet of 8
        #: engines x 25k GPU blocks (16 tokens each, an 8B model on one H100) fits with room.
        capacity_blocks: int = Field(262_144, ge=1)
        #: Tokens per block assumed for an engine before its first event (vLLM's GPU default).
        default_block_size: int = Field(16, ge=1)
        #: Messages queued in the socket before ZMQ drops (then the sequence check resets).
        receive_hwm: int = Field(100_000, ge=1)
        #: Packed token ids (4 bytes each) of recently routed prompts kept to re-key events
        #: whose parent the index lost (after a gateway restart or a reset; see
        #: plugins/kv_recent.py). 16 MiB = 4M tokens: the last few hundred long prompts, which
        #: covers the engines' first events after any reset. 0 disables it.
        recent_prompt_bytes: int = Field(16 << 20, ge=0)

    example_params: ClassVar[Mapping[str, object]] = {"bind": "tcp://127.0.0.1:5557"}

    def __init__(self, name: str, params: BaseModel, plugins: PluginLookup) -> None:
        super().__init__(name, params, plugins)
        assert isinstance(params, KvEventsSubscriber.Params)
        self.p = params
        self.index = KvIndex(params.capacity_blocks, default_block_size=params.default_block_size,
                             recent_prompt_bytes=params.recent_prompt_bytes)
        self.stats = KvEventsStats()
        self._engines: dict[str, str] = {}  # engine id -> address to connect ("" : none)
        self._seq: dict[tuple[str, int], int] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        #: The address actually bound (a ``:0`` / ``:*`` port resolved), once started.
        self.bound_address: str | None = None

    # -- endpoint set ---------------------------------------------------------------------
    def on_endpoints_changed(
        self, added: Sequence[Endpoint], removed: Sequence[Endpoint]
    ) -> None:
        for ep in removed:
            address = self._engines.pop(ep.id, "")
            self._forget(ep.id)
            if address and self._sock is not None:
                self._sock.disconnect(address)
        for ep in added:
            address = ""
            if self.p.connect and ep.kv_events and ep.kv_events != self.p.bind:
                address = connect_address(ep.kv_events, ep.url)
            self._engines[ep.id] = address
            if address and self._sock is not None:
                self._sock.connect(address)

    def _forget(self, engine: str) -> None:
        self.index.reset_engine(engine)
        for key in [k for k in self._seq if k[0] == engine]:
            del self._seq[key]

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is not None:
            return
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.RCVHWM, self.p.receive_hwm)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            if self.p.bind:
                sock.bind(self.p.bind)
                self.bound_address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            for address in self._engines.values():
                if address:
                    sock.connect(address)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            ctx.term()
            raise ConfigError(f"plugin {self.name!r}: cannot open KV-event socket: {exc}") from None
        self._ctx, self._sock = ctx, sock
        self._task = asyncio.create_task(self._receive_loop(sock), name=f"kvgate-{self.name}")
        log.info("kv events: bound %s, connected to %d engines", self.bound_address,
                 sum(1 for a in self._engines.values() if a))

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def _receive_loop(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            try:
                self.handle_frames(frames)
            except Exception:  # the loop must survive any bug in one message's handling
                self.stats.malformed_messages += 1
                log.exception("kv events: message handling failed; message dropped")

    # -- message handling (synchronous; also the entry point of tests) -----------------------
    def handle_frames(self, frames: Sequence[bytes]) -> None:
        """Decode one message and apply it to the index."""
        self.stats.messages += 1
        try:
            batch = decode_frames(frames)
        except MalformedFrame as exc:
            self.stats.malformed_messages += 1
            log.debug("kv events: malformed message skipped: %s", exc)
            return
        self.stats.malformed_events += batch.malformed_events
        self.stats.unknown_events += batch.unknown_events
        engine = topic_engine(batch.topic, self.p.topic_prefix)
        if engine is None or engine not in self._engines:
            self.stats.unknown_topics += 1
            return
        holder = holder_id(engine, batch.dp_rank)
        self._check_sequence(engine, batch.dp_rank, batch.seq, holder)
        for event in batch.events:
            self._apply(holder, event)

    def _check_sequence(self, engine: str, rank: int, seq: int, holder: str) -> None:
        last = self._seq.get((engine, rank))
        self._seq[(engine, rank)] = seq
        if last is None or seq == last + 1:
            return
        if seq > last + 1:
            self.stats.sequence_gaps += 1
            log.warning("kv events: %s lost batches %d..%d; its entries were reset",
                        holder, last + 1, seq - 1)
        else:
            self.stats.sequence_restarts += 1
            log.info("kv events: %s restarted (seq %d after %d); its entries were reset",
                     holder, seq, last)
        self.index.reset(holder)

    def _apply(self, holder: str, event: KvEvent) -> None:
        if isinstance(event, BlockStored):
            extra = event.extra_keys
            if extra is None and event.lora_name:
                extra = ((event.lora_name,),) * len(event.block_hashes)
            try:
                self.index.store(
                    holder, event.block_hashes, event.parent_block_hash, event.token_ids,
                    event.block_size, medium=event.medium, group_idx=event.group_idx,
                    extra_keys=extra,
                )
            except HashingError as exc:
                self.stats.malformed_events += 1
                log.debug("kv events: unhashable BlockStored from %s: %s", holder, exc)
                return
        elif isinstance(event, BlockRemoved):
            self.index.remove(
                holder, event.block_hashes, medium=event.medium, group_idx=event.group_idx
            )
        else:
            self.index.reset(holder)
        self.stats.events_applied[type(event).__name__] += 1

    def collector(self) -> Collector:
        """A Prometheus collector of :attr:`stats` and the index size, for the app's registry."""
        return _StatsCollector(self)


class _StatsCollector(Collector):
    def __init__(self, sub: KvEventsSubscriber) -> None:
        self._sub = sub

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        stats = self._sub.stats
        applied = CounterMetricFamily(
            "kvgate_kv_events_applied", "KV events applied to the index", labels=["type"]
        )
        for kind, count in stats.events_applied.items():
            applied.add_metric([kind], count)
        yield applied
        for name, value in asdict(stats).items():
            if isinstance(value, int):
                yield CounterMetricFamily(f"kvgate_kv_events_{name}", f"KV events: {name}",
                                          value=value)
        for name, value in asdict(self._sub.index.stats).items():
            yield CounterMetricFamily(f"kvgate_kv_index_{name}", f"KV index: {name}", value=value)
        yield GaugeMetricFamily("kvgate_kv_index_blocks", "(engine, block) pairs indexed",
                                value=len(self._sub.index))
