"""The client side of :mod:`bench.reliability`: one streaming request classified by how it
ended, the gateway's resident memory sampled while the load runs, and the summaries.

A stream is *complete* when its last SSE event is ``data: [DONE]``; it *ended clean with an
error* when its last event is the API's error event (``{"error": {...}}``) and nothing follows;
anything else (a non-200 status, a cut connection, a missing end) is an *error*.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

CHAT_PATH = "/v1/chat/completions"


@dataclass(frozen=True, slots=True)
class StreamResult:
    status: int
    engine: str | None
    ttft_s: float | None
    total_s: float
    complete: bool
    error_event: bool
    error: str | None


def chat_body(max_tokens: int, seed: int, stream: bool = True) -> dict[str, Any]:
    """A chat request whose prompt differs per client (no prefix shared past the first words)."""
    return {"model": "sim-model", "max_tokens": max_tokens, "ignore_eos": True, "stream": stream,
            "messages": [{"role": "user", "content": f"client {seed}: tell me a story"}]}


def _classify(raw: bytes) -> tuple[bool, bool]:
    """(complete, ended with the API's error event) from a stream's bytes."""
    events = [e.strip() for e in raw.split(b"\n\n") if e.strip()]
    if not events:
        return False, False
    last = events[-1].removeprefix(b"data: ")
    if last == b"[DONE]":
        return True, False
    try:
        payload = orjson.loads(last)
    except orjson.JSONDecodeError:
        return False, False
    return False, isinstance(payload, dict) and isinstance(payload.get("error"), dict)


async def stream_once(session: aiohttp.ClientSession, url: str,
                      body: Mapping[str, Any]) -> StreamResult:
    """POST one streaming chat request to ``url`` and read it to its end."""
    started = time.perf_counter()
    ttft: float | None = None
    try:
        async with session.post(url + CHAT_PATH, json=body) as resp:
            engine = resp.headers.get("x-kvgate-engine")
            if resp.status != 200:
                await resp.read()
                return StreamResult(resp.status, engine, None, time.perf_counter() - started,
                                    False, False, f"status {resp.status}")
            parts: list[bytes] = []
            async for chunk in resp.content.iter_any():
                if ttft is None:
                    ttft = time.perf_counter() - started
                parts.append(chunk)
    except (aiohttp.ClientError, TimeoutError) as exc:
        return StreamResult(0, None, ttft, time.perf_counter() - started, False, False,
                            f"{type(exc).__name__}: {exc}")
    complete, error_event = _classify(b"".join(parts))
    error = None if complete or error_event else "stream ended without [DONE] or error event"
    return StreamResult(200, engine, ttft, time.perf_counter() - started, complete,
                        error_event, error)


def rss_kib(pid: int) -> int:
    """Resident memory of ``pid`` and its live descendants (KiB); 0 once gone."""
    total, pending = 0, [pid]
    while pending:
        current = pending.pop()
        with contextlib.suppress(OSError, ValueError):
            for line in Path(f"/proc/{current}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
            for task in Path(f"/proc/{current}/task").iterdir():
                with contextlib.suppress(OSError):
                    pending.extend(int(x) for x in (task / "children").read_text().split())
    return total


class RssSampler:
    """Samples :func:`rss_kib` every ``interval_s`` (0.1 s: a 1,000-stream burst lasts
    seconds, so its peak is caught within a tenth of it) while the block runs."""

    def __init__(self, pid: int, interval_s: float = 0.1) -> None:
        self.pid, self.interval_s, self.peak_kib = pid, interval_s, 0

    async def _run(self) -> None:
        while True:
            self.peak_kib = max(self.peak_kib, rss_kib(self.pid))
            await asyncio.sleep(self.interval_s)

    @contextlib.asynccontextmanager
    async def running(self) -> Any:
        task = asyncio.create_task(self._run())
        try:
            yield self
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) by linear interpolation; None without values."""
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    cuts = statistics.quantiles(values, n=1000, method="inclusive")
    return cuts[min(998, max(0, round(q * 1000) - 1))]


def summarize(results: Sequence[StreamResult]) -> dict[str, Any]:
    """Counts and latency percentiles (ms) of a set of streams."""
    ttfts = [r.ttft_s * 1000 for r in results if r.ttft_s is not None]
    totals = [r.total_s * 1000 for r in results]
    by_engine: dict[str, int] = {}
    for r in results:
        by_engine[r.engine or "none"] = by_engine.get(r.engine or "none", 0) + 1
    errors = sorted({r.error for r in results if r.error is not None})
    return {
        "streams": len(results),
        "complete": sum(r.complete for r in results),
        "ended_with_error_event": sum(r.error_event for r in results),
        "errors": sum(r.error is not None for r in results),
        "error_kinds": errors[:10],
        "by_engine": by_engine,
        "ttft_ms": {"p50": _round(percentile(ttfts, 0.5)), "p99": _round(percentile(ttfts, 0.99))},
        "total_ms": {"p50": _round(percentile(totals, 0.5)),
                     "p99": _round(percentile(totals, 0.99))},
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


@contextlib.contextmanager
def raised_fd_limit() -> Iterator[None]:
    """The soft open-files limit raised to the hard one (1,000 client sockets need it)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
