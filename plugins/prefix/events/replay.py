"""Filling a sequence gap from an engine's KV-event replay socket (vLLM's ``replay_endpoint``).

Protocol (``vllm/distributed/kv_events.py``, ``ZmqEventPublisher._service_replay``, vLLM 0.32):
the engine binds a ZMQ ROUTER; the client (here a DEALER) sends ``(b"", start_seq)`` with
``start_seq`` as 8 bytes big-endian; the engine answers each buffered batch with
``seq >= start_seq`` as ``(b"", topic, seq, payload)`` — the same three frames as on the PUB
socket after the empty delimiter — then ``(b"", b"", END_SEQ, b"")``. The buffer holds the last
``buffer_steps`` batches (10,000 by default), so a start older than the buffer is answered from
the oldest batch kept: the first replayed ``seq`` is then above ``start_seq`` and the gap cannot
be filled. The engine serves replay requests between publishing batches (every 0.1 s at worst).

:class:`PendingGap` is the bookkeeping while a replay runs (pure): the live batches that arrive
meanwhile are held (bounded), then merged with the replayed ones and released in order.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from kvgate.plugins.prefix.events.wire import END_SEQ, EventBatch, MalformedFrame, decode_frames


class ReplayFailed(Exception):
    """The replay socket gave no complete answer (timeout, broken frames)."""


async def fetch_replay(
    ctx: zmq.asyncio.Context, address: str, start_seq: int, timeout_s: float, limit: int
) -> list[EventBatch]:
    """Ask ``address`` for every buffered batch from ``start_seq``; at most ``limit`` batches
    are kept (the rest are read and dropped). Raises :class:`ReplayFailed`."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    out: list[EventBatch] = []
    try:
        sock.connect(address)
        await sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        async with asyncio.timeout(timeout_s):
            while True:
                frames = await sock.recv_multipart()
                if len(frames) != 4 or frames[0] != b"":
                    raise ReplayFailed(f"replay answer of {len(frames)} frames")
                if frames[2] == END_SEQ:
                    return out
                batch = decode_frames(frames[1:])
                if len(out) < limit:
                    out.append(batch)
    except TimeoutError:
        raise ReplayFailed(f"no complete answer within {timeout_s:g} s") from None
    except (zmq.ZMQError, MalformedFrame) as exc:
        raise ReplayFailed(str(exc)) from None
    finally:
        sock.close(linger=0)


@dataclass(slots=True)
class PendingGap:
    """One (engine, rank) whose batches from ``expected`` on are missing or held.

    ``held`` keeps the live batches received during the replay (at most ``limit``; past it the
    gap is abandoned, see :meth:`hold`).
    """

    expected: int
    limit: int
    #: A first contact's history (every buffered batch), not a gap: see :meth:`history_run`.
    history: bool = False
    held: list[EventBatch] = field(default_factory=list)
    overflow: bool = False

    def hold(self, batch: EventBatch) -> None:
        if len(self.held) >= self.limit:
            self.overflow = True
            return
        self.held.append(batch)

    def merge(self, replayed: Sequence[EventBatch]) -> tuple[list[EventBatch], str | None]:
        """The batches to apply, in order from ``expected``, and what still misses (None: the
        gap is filled). Replayed and held batches may overlap; each ``seq`` is applied once."""
        if self.overflow:
            return [], f"more than {self.limit} batches arrived during the replay"
        if any(b.seq < self.expected for b in self.held):
            return [], "the engine restarted during the replay"
        by_seq = {b.seq: b for b in replayed if b.seq >= self.expected}
        for b in self.held:
            by_seq.setdefault(b.seq, b)
        out: list[EventBatch] = []
        seq = self.expected
        while seq in by_seq:
            out.append(by_seq.pop(seq))
            seq += 1
        if by_seq:
            first = min(by_seq)
            return out, f"batches {seq}..{first - 1} are not in the replay buffer"
        return out, None

    def history_run(self, replayed: Sequence[EventBatch]) -> list[EventBatch]:
        """A first contact's history: the replayed batches from the oldest one buffered, in
        order, as far as they run without a gap, joined by the held live ones that continue
        the run (the engine's buffer rarely reaches back to ``seq`` 0; what it holds is
        still the most recent history). Empty when the engine restarted meanwhile (a held
        batch older than the history) or nothing was buffered."""
        if self.overflow or not replayed:
            return []
        self.expected = min(b.seq for b in replayed)
        if any(b.seq < self.expected for b in self.held):
            return []
        batches, _ = self.merge(replayed)
        return batches
