"""The gap filling of ``kv-events`` against vLLM's own replay socket: vLLM's
``ZmqEventPublisher`` (installed in the engine venv; no engine is started) publishes five batches
with a ``replay_endpoint``; the subscriber, shown batches 0 and 4, asks it for 1..3 and indexes
all five. A buffer shorter than the gap is reported and reset. Shown batch 4 first (a gateway
that started after the engine), it asks for the history and indexes what the buffer holds."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from kvgate.engines.local.venv import ensure_engine_venv
from kvgate.engines.ports import free_port
from kvgate.middleware.framework.types import Endpoint
from kvgate.plugins.prefix.events.subscriber import KvEventsSubscriber
from tests.unit.routing.helpers import NoLookup, frames, stored

pytestmark = pytest.mark.e2e

BS = 16
PUBLISHER = """
import sys, time
from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher
pub = ZmqEventPublisher(0, endpoint=sys.argv[1], replay_endpoint=sys.argv[2],
                        buffer_steps=int(sys.argv[3]), topic="")
for i in range(5):
    pub.publish(KVEventBatch(ts=time.time(), events=[BlockStored(
        block_hashes=[100 + i], parent_block_hash=None,
        token_ids=list(range(BS * i, BS * i + BS)), block_size=BS, lora_id=None,
        medium="GPU", lora_name=None)]))
time.sleep(0.5)
print("published", flush=True)
sys.stdin.read()
pub.shutdown()
""".replace("BS", str(BS))


def _event(i: int) -> list[object]:
    return [stored([100 + i], None, list(range(BS * i, BS * i + BS)), BS)]


@pytest.mark.parametrize(("buffer_steps", "filled"), [(10, True), (2, False)],
                         ids=["filled", "buffer too short"])
async def test_gap_filled_from_vllms_replay_socket(tmp_path: Path, buffer_steps: int,
                                                   filled: bool) -> None:
    async with _vllm_publisher(tmp_path, buffer_steps) as sub:
        sub.handle_frames(frames("", 0, _event(0)), via="e0")
        sub.handle_frames(frames("", 4, _event(4)), via="e0")  # batches 1..3 lost
        await _until(lambda: sum(sub.stats.replays.values()) > 0)
        assert sub.stats.replays == {"filled": int(filled), "failed": int(not filled)}
        assert sub.index.blocks_of("e0") == (5 if filled else 1)
        assert sub.stats.history == {"caught_up": 0, "failed": 0}  # batch 0 came first


@pytest.mark.parametrize(("buffer_steps", "blocks"), [(10, 5), (2, 2)],
                         ids=["whole history", "the buffer's latest two"])
async def test_history_from_vllms_replay_socket(tmp_path: Path, buffer_steps: int,
                                                blocks: int) -> None:
    async with _vllm_publisher(tmp_path, buffer_steps) as sub:
        sub.handle_frames(frames("", 4, _event(4)), via="e0")  # joined after batch 3
        await _until(lambda: sum(sub.stats.history.values()) > 0)
        assert sub.stats.history == {"caught_up": 1, "failed": 0}
        assert sub.index.blocks_of("e0") == blocks
        assert sub.stats.sequence_gaps == 0


async def _until(condition: Callable[[], bool], limit_s: float = 10.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, "no replay result"
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def _vllm_publisher(tmp_path: Path, buffer_steps: int) -> AsyncIterator[KvEventsSubscriber]:
    """vLLM's publisher (five batches published, ``buffer_steps`` kept for replay) and a
    started subscriber whose engine ``e0`` has its replay socket."""
    python = await asyncio.to_thread(ensure_engine_venv)
    script = tmp_path / "publisher.py"
    script.write_text(PUBLISHER)
    pub_port, replay_port = free_port(), free_port()
    proc = await asyncio.create_subprocess_exec(
        str(python), str(script), f"tcp://*:{pub_port}", f"tcp://*:{replay_port}",
        str(buffer_steps), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=sys.stderr)
    sub = KvEventsSubscriber("kv-events", KvEventsSubscriber.Params(replay_timeout_s=5),
                             NoLookup())
    sub.on_endpoints_changed([Endpoint(id="e0", url="http://127.0.0.1:9", kind="vllm",
                                       kv_events_replay=f"tcp://*:{replay_port}")], [])
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 300)  # importing vLLM: ~15 s
        assert line.strip() == b"published"
        await sub.start()
        yield sub
    finally:
        await sub.stop()
        if proc.stdin is not None:
            proc.stdin.close()
        await asyncio.wait_for(proc.wait(), 30)
