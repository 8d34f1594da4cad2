"""KV-cache events in vLLM's ZMQ wire format, and their publisher.

Wire (``vllm/distributed/kv_events.py``): ZMQ PUB multipart ``(topic, seq, payload)`` where
``seq`` is an 8-byte big-endian counter from 0 and ``payload`` is msgpack of the ``EventBatch``
array ``[ts, events, data_parallel_rank]`` (``ts`` in Unix seconds). Events are msgspec structs
with ``tag=True`` and ``omit_defaults=True``, field order as declared in vLLM:

* ``BlockStored``: block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name, then defaulted extra_keys, group_idx, kv_cache_spec_kind,
  kv_cache_spec_sliding_window, locality (vLLM 0.32; ``REMOTE`` for a shared store's blocks);
* ``BlockRemoved``: block_hashes, medium, then defaulted group_idx, locality;
* ``AllBlocksCleared``: no fields.

Two encodings exist: ``tagged`` maps ``{"type": "BlockStored", field: value, ...}`` (newer vLLM;
defaulted fields equal to their default are left out) and ``positional`` arrays (older vLLM,
``array_like=True``): ``["BlockStored", value, ...]`` in field order, trailing defaulted fields
equal to their default left out. Hashes are unsigned 64-bit ints; ``token_ids`` concatenates
the stored blocks' tokens.

Replay (vLLM's ``replay_endpoint``, ``ZmqEventPublisher._service_replay``): a ROUTER socket,
always bound. A client sends ``(b"", start_seq)`` (8 bytes big-endian; the ROUTER sees its
identity first); the publisher answers ``(b"", topic, seq, payload)`` for every buffered batch
with ``seq >= start_seq``, then ``(b"", b"", END_SEQ, b"")`` with ``END_SEQ`` = -1 as 8 signed
big-endian bytes. The buffer keeps the last ``buffer_steps`` numbered batches.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgpack
import zmq
import zmq.asyncio

from kvgate.engines.sim.core.config import KvEventsConfig

log = logging.getLogger(__name__)

Encoding = Literal["tagged", "positional"]
MEDIUM_GPU = "GPU"
#: vLLM's ``KVCacheSpecKind`` value for ordinary (full) attention layers.
FULL_ATTENTION = "full_attention"

_DEFAULT = object()  # marks "no default" in field tables
#: The replay end marker's sequence frame (vLLM ``ZmqEventPublisher.END_SEQ``).
END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks newly cached, consecutive in one chain (``parent_block_hash`` precedes them)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = 0
    kv_cache_spec_kind: str | None = FULL_ATTENTION
    kv_cache_spec_sliding_window: int | None = None
    #: vLLM 0.32: ``LOCAL`` or ``REMOTE`` relative to the publisher (a shared store's blocks
    #: are ``REMOTE``); ``None`` (left off the wire): unspecified.
    locality: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks evicted from the cache."""

    block_hashes: list[int]
    medium: str | None = MEDIUM_GPU
    group_idx: int | None = 0
    locality: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole cache was reset."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared

# (field, vLLM's default or _DEFAULT when the field is required) in wire order.
_FIELDS: dict[type, tuple[tuple[str, object], ...]] = {
    BlockStored: (
        ("block_hashes", _DEFAULT),
        ("parent_block_hash", _DEFAULT),
        ("token_ids", _DEFAULT),
        ("block_size", _DEFAULT),
        ("lora_id", _DEFAULT),
        ("medium", _DEFAULT),
        ("lora_name", _DEFAULT),
        ("extra_keys", None),
        ("group_idx", None),
        ("kv_cache_spec_kind", None),
        ("kv_cache_spec_sliding_window", None),
        ("locality", None),
    ),
    BlockRemoved: (("block_hashes", _DEFAULT), ("medium", _DEFAULT), ("group_idx", None),
                   ("locality", None)),
    AllBlocksCleared: (),
}


def encode_event(event: KvEvent, encoding: Encoding) -> dict[str, Any] | list[Any]:
    """One event as msgpack-ready data (see the module docstring for both layouts)."""
    spec = _FIELDS[type(event)]
    tag = type(event).__name__
    if encoding == "tagged":
        out: dict[str, Any] = {"type": tag}
        for name, default in spec:
            value = getattr(event, name)
            if default is _DEFAULT or value != default:
                out[name] = value
        return out
    values = [getattr(event, name) for name, _ in spec]
    keep = len(values)
    while keep and spec[keep - 1][1] is not _DEFAULT and values[keep - 1] == spec[keep - 1][1]:
        keep -= 1
    return [tag, *values[:keep]]


def encode_batch(
    events: Sequence[KvEvent], encoding: Encoding, ts: float, data_parallel_rank: int = 0
) -> bytes:
    """msgpack of ``[ts, [event, ...], data_parallel_rank]``."""
    body = [encode_event(e, encoding) for e in events]
    packed: bytes = msgpack.packb([ts, body, data_parallel_rank], use_bin_type=True)
    return packed


def binds(endpoint: str) -> bool:
    """vLLM's rule: wildcard, IPv6-any, ``ipc://`` and ``inproc://`` bind; others connect."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


@dataclass(slots=True)
class PublisherStats:
    """Counters of the publisher (batches, not events)."""

    queued: int = 0
    sent: int = 0
    dropped: int = 0
    send_errors: int = 0
    #: Batches numbered and buffered but deliberately not sent (the :meth:`withhold` test hook).
    withheld: int = 0
    #: Replay requests served, and malformed ones ignored.
    replays: int = 0
    bad_replay_requests: int = 0
    last_error: str | None = field(default=None)


class KvEventPublisher:
    """Publishes event batches off the engine's step path.

    :meth:`publish` (called at the end of each engine step) only numbers the batch and appends
    it to a bounded queue of ``queue_limit`` batches — when full, the **oldest** queued batch is
    dropped and counted (its sequence number never appears on the wire). A sender task encodes
    and sends queued batches with non-blocking sends; a PUB socket itself drops messages for a
    subscriber past ``sndhwm``.

    With ``replay_endpoint`` each numbered batch is also kept (``buffer_steps`` of them, oldest
    dropped first) and a ROUTER task answers replay requests (see the module docstring).

    Parameters:
        config: endpoint, topic, encoding, bounds.
        topic: the first frame of every message.
    """

    def __init__(self, config: KvEventsConfig, topic: str) -> None:
        self.config = config
        self.topic = topic.encode()
        self.stats = PublisherStats()
        self._queue: deque[tuple[int, float, list[KvEvent]]] = deque()
        self._seq = 0
        self._wake = asyncio.Event()
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._sock: zmq.Socket[bytes] | None = None
        self._task: asyncio.Task[None] | None = None
        #: The endpoint actually bound or connected (a bound ``:*`` port resolved).
        self.endpoint: str = config.endpoint
        self._buffer: deque[tuple[int, float, list[KvEvent]]] = deque(maxlen=config.buffer_steps)
        self._withhold = 0
        self._rctx: zmq.asyncio.Context | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        #: The replay socket's bound address (``:*`` resolved); None without one.
        self.replay_endpoint: str | None = None

    def start(self) -> None:
        """Open the socket and start the sender; needs a running event loop."""
        if self._task is not None:
            return
        self._ctx = zmq.Context()
        sock = self._ctx.socket(zmq.PUB)
        sock.setsockopt(zmq.SNDHWM, self.config.sndhwm)
        sock.setsockopt(zmq.LINGER, 0)
        if binds(self.config.endpoint):
            sock.bind(self.config.endpoint)
            last = sock.getsockopt(zmq.LAST_ENDPOINT)
            self.endpoint = last.decode() if isinstance(last, bytes) else str(last)
        else:
            sock.connect(self.config.endpoint)
        self._sock = sock
        self._task = asyncio.get_running_loop().create_task(self._sender(), name="sim-kv-events")
        if self.config.replay_endpoint is not None:
            self._start_replay(self.config.replay_endpoint)

    def _start_replay(self, address: str) -> None:
        self._rctx = zmq.asyncio.Context()
        router = self._rctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(address)
        self.replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._router = router
        self._replay_task = asyncio.get_running_loop().create_task(
            self._serve_replay(router), name="sim-kv-replay")

    def withhold(self, batches: int) -> None:
        """Test hook: number and buffer the next ``batches`` batches but do not send them, as
        if the network lost them (a subscriber sees a sequence gap; the replay has them)."""
        self._withhold += batches

    def publish(self, events: Sequence[KvEvent]) -> None:
        """Queue one batch (no-op for an empty list). Never blocks, never raises."""
        if not events:
            return
        if len(self._queue) >= self.config.queue_limit:
            self._queue.popleft()
            self.stats.dropped += 1
        batch = (self._seq, time.time(), list(events))
        self._queue.append(batch)
        if self._router is not None:
            self._buffer.append(batch)
        self._seq += 1
        self.stats.queued += 1
        self._wake.set()

    async def aclose(self) -> None:
        """Stop the sender, send what is still queued (sends do not block), close the socket."""
        for task in (self._task, self._replay_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._task = self._replay_task = None
        if self._router is not None:
            self._router.close(linger=0)
            self._router = None
        if self._rctx is not None:
            self._rctx.term()
            self._rctx = None
        while self._queue and self._sock is not None:
            self._send(*self._queue.popleft())
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def _sender(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                seq, ts, events = self._queue.popleft()
                self._send(seq, ts, events)
                await asyncio.sleep(0)  # one batch at a time: steps keep running in between

    async def _serve_replay(self, router: zmq.asyncio.Socket) -> None:
        """vLLM's replay service: every buffered batch from the asked sequence, then END."""
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3:  # vLLM's only check
                self.stats.bad_replay_requests += 1
                log.warning("kv events: invalid replay request of %d frames", len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, ts, events in list(self._buffer):
                if seq >= first:
                    payload = encode_batch(events, self.config.encoding, ts,
                                           self.config.data_parallel_rank)
                    await router.send_multipart([client, b"", self.topic,
                                                 seq.to_bytes(8, "big"), payload])
            await router.send_multipart([client, b"", b"", END_SEQ, b""])
            self.stats.replays += 1

    def _send(self, seq: int, ts: float, events: list[KvEvent]) -> None:
        assert self._sock is not None
        if self._withhold > 0:
            self._withhold -= 1
            self.stats.withheld += 1
            return
        payload = encode_batch(
            events, self.config.encoding, ts, self.config.data_parallel_rank
        )
        try:
            self._sock.send_multipart([self.topic, seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # PUB does not block; this is a closed/broken socket
            self.stats.send_errors += 1
            self.stats.last_error = str(exc)
            log.warning("kv events: send of batch %d failed: %s", seq, exc)
            return
        self.stats.sent += 1
