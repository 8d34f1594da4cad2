"""A real ZMQ PUB socket over TCP loopback feeding the subscriber (both connection directions)."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from kvgate.plugins.prefix.events.subscriber import KvEventsSubscriber
from tests.unit.routing.helpers import NoLookup, blocks, cleared, endpoint, frames, removed, stored

TIMEOUT_S = 5.0


async def _until(cond: object, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + TIMEOUT_S
    while not cond():  # type: ignore[operator]
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def _publish_session(sub: KvEventsSubscriber, pub: zmq.asyncio.Socket) -> None:
    """Warm up (ZMQ drops what is published before the subscription arrives), then a real
    sequence: store 3 blocks, remove the tail, a malformed message, clear."""
    seq = 0
    while sub.stats.messages == 0:
        await pub.send_multipart(frames("kv@e0@m", seq, []))
        seq += 1
        await asyncio.sleep(0.01)
    toks = blocks(1, 3, 16)
    await pub.send_multipart(frames("kv@e0@m", seq, [stored([1, 2, 3], None, toks, 16)]))
    await pub.send_multipart(frames("kv@e0@m", seq + 1, [removed([3], encoding="positional")]))
    await pub.send_multipart([b"kv@e0@m", b"bad"])
    await _until(lambda: sub.stats.malformed_messages == 1, "the malformed message")
    assert sub.index.blocks_of("e0") == 2
    assert sub.stats.events_applied["BlockStored"] == 1
    assert sub.stats.events_applied["BlockRemoved"] == 1
    await pub.send_multipart(frames("kv@e0@m", seq + 2, [cleared()]))
    await _until(lambda: sub.stats.events_applied["AllBlocksCleared"] == 1, "the clear")
    assert len(sub.index) == 0
    assert sub.stats.sequence_gaps == sub.stats.sequence_restarts == 0


@pytest.mark.parametrize("direction", ["gateway binds", "engine binds"])
async def test_pub_to_subscriber_over_tcp(direction: str) -> None:
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    if direction == "gateway binds":
        params = KvEventsSubscriber.Params(bind="tcp://127.0.0.1:*")
        eps = [endpoint("e0")]
    else:
        pub.bind("tcp://127.0.0.1:*")
        port = pub.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
        params = KvEventsSubscriber.Params()
        eps = [endpoint("e0", kv_events=f"tcp://*:{port}")]  # "*": the engine URL's host
    sub = KvEventsSubscriber("kv-events", params, NoLookup())
    sub.on_endpoints_changed(eps, [])
    await sub.start()
    try:
        if direction == "gateway binds":
            assert sub.bound_address is not None
            pub.connect(sub.bound_address)
        await _publish_session(sub, pub)
    finally:
        await sub.stop()
        pub.close(linger=0)
        ctx.term()


async def test_stop_is_idempotent_and_bad_bind_is_a_config_error() -> None:
    from kvgate.middleware.framework.errors import ConfigError

    sub = KvEventsSubscriber("kv-events", KvEventsSubscriber.Params(bind="tcp://256.1.1.1:1"),
                             NoLookup())
    with pytest.raises(ConfigError):
        await sub.start()
    await sub.stop()
    await sub.stop()
