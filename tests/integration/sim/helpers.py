"""Shared helpers of the simulator's integration tests."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable
from typing import Any

import httpx

DONE = "[DONE]"


def token_prompt(n: int, seed: int = 0) -> list[int]:
    """A prompt of ``n`` token ids (a completions ``prompt``), reproducible by seed."""
    rng = random.Random(seed)
    return [rng.randrange(16, 32_000) for _ in range(n)]


def long_text(words: int, seed: int = 0) -> str:
    """English-looking text of ``words`` words, reproducible by seed."""
    rng = random.Random(seed)
    vocab = ["cache", "engine", "token", "prefix", "block", "request", "gateway", "decode",
             "prefill", "batch", "model", "stream", "the", "a", "of", "and", "to", "is"]
    return " ".join(rng.choice(vocab) for _ in range(words)) + "."


async def sse_events(resp: httpx.Response) -> list[Any]:
    """Every ``data:`` payload of an SSE response: parsed JSON, or the string ``[DONE]``."""
    out: list[Any] = []
    async for line in resp.aiter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            out.append(data if data == DONE else json.loads(data))
    return out


def stream_text(events: list[Any]) -> str:
    """The generated text carried by a stream's chunks (chat deltas or completion texts)."""
    parts: list[str] = []
    for ev in events:
        if ev == DONE:
            continue
        for choice in ev["choices"]:
            parts.append(choice["delta"].get("content", "") if "delta" in choice
                         else choice["text"])
    return "".join(parts)


async def eventually(predicate: Callable[[], bool], timeout_s: float = 2.0) -> None:
    """Poll ``predicate`` every 5 ms until true; AssertionError after ``timeout_s``."""
    for _ in range(int(timeout_s / 0.005)):
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"condition not met within {timeout_s} s")
