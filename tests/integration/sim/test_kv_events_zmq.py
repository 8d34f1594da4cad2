"""KV events received by a real ZMQ SUB socket, both encodings, engine binding or connecting."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgpack
import pytest
import zmq
import zmq.asyncio

from kvgate.engines.sim.core.config import KvEventsConfig, SimConfig
from kvgate.engines.sim.core.prefix_cache import block_hashes
from kvgate.engines.sim.testing import RunningSim, serve_sim

from .helpers import token_prompt

TOPIC = "kv@test"


def _event(ev: Any) -> dict[str, Any]:
    """Normalize either encoding to a dict with the fields this test reads."""
    if isinstance(ev, dict):
        return ev
    names = {"BlockStored": ["block_hashes", "parent_block_hash", "token_ids", "block_size",
                             "lora_id", "medium", "lora_name", "extra_keys", "group_idx",
                             "kv_cache_spec_kind"],
             "BlockRemoved": ["block_hashes", "medium", "group_idx"],
             "AllBlocksCleared": []}[ev[0]]
    return {"type": ev[0], **dict(zip(names, ev[1:], strict=False))}


class Subscriber:
    """A SUB socket collecting ``(seq, events)`` of one topic."""

    def __init__(self, ctx: zmq.asyncio.Context, bind: bool) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
        self.endpoint = ""
        if bind:
            port = self.sock.bind_to_random_port("tcp://127.0.0.1")
            self.endpoint = f"tcp://127.0.0.1:{port}"

    async def batch(self, timeout_s: float = 2.0) -> tuple[int, list[dict[str, Any]]]:
        async with asyncio.timeout(timeout_s):
            topic, seq, payload = await self.sock.recv_multipart()
        assert topic == TOPIC.encode()
        ts, events, rank = msgpack.unpackb(payload, raw=False)
        assert isinstance(ts, float) and rank == 0
        return int.from_bytes(seq, "big"), [_event(e) for e in events]


@contextlib.asynccontextmanager
async def _wired(encoding: str, sim_binds: bool, **cfg: Any) -> AsyncIterator[
        tuple[RunningSim, Subscriber, httpx.AsyncClient]]:
    ctx = zmq.asyncio.Context()
    sub = Subscriber(ctx, bind=not sim_binds)
    endpoint = "tcp://127.0.0.1:*" if sim_binds else sub.endpoint
    config = SimConfig(time_scale=0, kv_events=KvEventsConfig(
        endpoint=endpoint, topic=TOPIC, encoding=encoding), **cfg)
    try:
        async with serve_sim(config) as sim, httpx.AsyncClient(base_url=sim.url) as client:
            if sim_binds:
                assert sim.engine.kv_events_endpoint is not None
                sub.sock.connect(sim.engine.kv_events_endpoint)
            await _await_subscription(client, sub)
            yield sim, sub, client
    finally:
        sub.sock.close()
        ctx.term()


async def _await_subscription(client: httpx.AsyncClient, sub: Subscriber) -> None:
    """PUB drops messages until the subscription arrives: reset the cache until one shows up."""
    for _ in range(100):
        assert (await client.post("/reset_prefix_cache")).status_code == 200
        try:
            _, events = await sub.batch(timeout_s=0.05)
        except TimeoutError:
            continue
        assert events == [{"type": "AllBlocksCleared"}]
        with contextlib.suppress(TimeoutError):
            while True:  # drain resets published just before the subscription went live
                await sub.batch(timeout_s=0.05)
        return
    raise AssertionError("no KV events received")


@pytest.mark.parametrize("encoding", ["tagged", "positional"])
@pytest.mark.parametrize("sim_binds", [True, False])
async def test_stored_then_removed(encoding: str, sim_binds: bool) -> None:
    async with _wired(encoding, sim_binds, capacity_blocks=4, max_model_len=64) as (_, sub, c):
        prompt = token_prompt(40, seed=1)
        await c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        seq1, events = await sub.batch()
        (stored,) = events
        assert stored["type"] == "BlockStored"
        assert stored["block_hashes"] == block_hashes(prompt, 16)
        assert all(0 <= h < 2**64 for h in stored["block_hashes"])
        assert stored["parent_block_hash"] is None
        assert stored["token_ids"] == prompt[:32]
        assert (stored["block_size"], stored["medium"], stored["group_idx"]) == (16, "GPU", 0)
        assert stored["kv_cache_spec_kind"] == "full_attention"

        await c.post("/v1/completions", json={"prompt": token_prompt(60, seed=2),
                                              "max_tokens": 1})
        seq2, events = await sub.batch()
        removed = [e["block_hashes"] for e in events if e["type"] == "BlockRemoved"]
        assert removed == [[stored["block_hashes"][1]], [stored["block_hashes"][0]]]
        assert seq2 == seq1 + 1


@pytest.mark.parametrize("encoding", ["tagged", "positional"])
async def test_chunked_prefill_links_parents(encoding: str) -> None:
    async with _wired(encoding, True, max_num_batched_tokens=32) as (_, sub, c):
        prompt = token_prompt(100, seed=3)
        await c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1,
                                              "cache_salt": "t1"})
        chain: list[int] = []
        while len(chain) < 6:
            _, events = await sub.batch()
            for ev in events:
                assert ev["parent_block_hash"] == (chain[-1] if chain else None)
                if not chain:
                    assert ev["extra_keys"][0] == ["t1"]
                chain.extend(ev["block_hashes"])
        assert chain == block_hashes(prompt, 16, cache_salt="t1")
