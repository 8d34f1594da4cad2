"""Shared builders for the routing tests: wire frames, requests, a manual clock."""

from __future__ import annotations

import time
from typing import Any

import msgpack

from kvgate.middleware.framework.types import Api, Endpoint, InferenceRequest
from kvgate.plugins.prefix.events.subscriber import KvEventsSubscriber
from tests.plugin_helpers import NoLookup, prompt_of

__all__ = ["NoLookup"]


class Lookup:
    """A plugin lookup over a dict."""

    def __init__(self, plugins: dict[str, object]) -> None:
        self.plugins = plugins

    def lookup(self, name: str) -> object:
        return self.plugins[name]


class Clock:
    """A manual monotonic clock."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def stored(hashes: list[int], parent: int | None, tokens: list[int], block_size: int,
           *, encoding: str = "tagged", **more: Any) -> Any:
    """A BlockStored event in either encoding (positional keeps field order)."""
    fields: dict[str, Any] = {
        "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
        "block_size": block_size, "lora_id": None, "medium": "GPU", **more,
    }
    if encoding == "tagged":
        return {"type": "BlockStored", **fields}
    order = ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
             "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
             "kv_cache_spec_sliding_window"]
    values = [fields.get(name) for name in order]
    last = max(i for i, name in enumerate(order) if name in fields)
    return ["BlockStored", *values[: last + 1]]


def removed(hashes: list[int], *, encoding: str = "tagged", medium: str | None = "GPU") -> Any:
    if encoding == "tagged":
        return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}
    return ["BlockRemoved", hashes, medium]


def cleared(*, encoding: str = "tagged") -> Any:
    return {"type": "AllBlocksCleared"} if encoding == "tagged" else ["AllBlocksCleared"]


def frames(topic: str, seq: int, events: list[Any], rank: int = 0) -> list[bytes]:
    payload = msgpack.packb([time.time(), events, rank], use_bin_type=True)
    return [topic.encode(), seq.to_bytes(8, "big"), payload]


def endpoint(name: str, kv_events: str | None = None) -> Endpoint:
    return Endpoint(id=name, url=f"http://127.0.0.1:9/{name}", kind="vllm", kv_events=kv_events)


def subscriber(engines: list[str], **params: Any) -> KvEventsSubscriber:
    sub = KvEventsSubscriber("kv-events", KvEventsSubscriber.Params(**params), NoLookup())
    sub.on_endpoints_changed([endpoint(e) for e in engines], [])
    return sub


def request(api: Api = Api.CHAT, body: dict[str, Any] | None = None, *, model: str = "m",
            tenant: str | None = None) -> InferenceRequest:
    return InferenceRequest(
        request_id="r", api=api, model=model, body=body or {}, headers={}, stream=False,
        client_wants_usage=False, prompt_token_estimate=1, received_at=time.monotonic(),
        tenant=tenant, prompt=prompt_of(api, body),
    )


def blocks(seed: int, n_blocks: int, block_size: int) -> list[int]:
    """Deterministic token ids (distinct per seed)."""
    return [(seed * 7919 + i * 31) % 50_000 for i in range(n_blocks * block_size)]
