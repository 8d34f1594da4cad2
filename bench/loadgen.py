"""HTTP load generator (aiohttp client on uvloop, keep-alive), run as its own process.

Two modes:
  open    requests start on a fixed schedule (``--rate`` per second) whatever the responses do,
          so queueing in the system under test shows up as latency (no coordinated omission);
  closed  ``--concurrency`` workers, each sending its next request as soon as the last one ends:
          the maximum request rate the system sustains.

For streams it records time to first body byte (the first SSE event) and total time.
Requests started during ``--warmup`` are sent but not counted. Prints one JSON object
(:class:`LoadResult`) on stdout.

Run: ``python -m bench.loadgen --url http://127.0.0.1:8000 --mode open --rate 1000 --duration 5``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Literal

import aiohttp
import uvloop

Mode = Literal["open", "closed"]
CHAT_PATH = "/v1/chat/completions"
FILLER = "The quick brown fox jumps over the lazy dog while the cache stays warm. "


@dataclass(frozen=True)
class LoadSpec:
    """What to send and how."""

    base_url: str
    mode: Mode
    duration_s: float
    warmup_s: float = 1.0
    rate: float = 1000.0
    concurrency: int = 64
    body_bytes: int = 1024
    stream: bool = False
    model: str = "bench-model"
    timeout_s: float = 30.0


@dataclass(frozen=True)
class Sample:
    """One request: when it started, how long it took, time to first body byte, success."""

    start: float
    end: float
    ttfb: float
    ok: bool


@dataclass(frozen=True)
class Percentiles:
    """Latency summary in milliseconds."""

    p50: float
    p90: float
    p99: float
    max: float
    mean: float

    @classmethod
    def of(cls, seconds: Sequence[float]) -> Percentiles:
        """Summarise a list of durations given in seconds (nearest-rank percentiles)."""
        if not seconds:
            nan = math.nan
            return cls(nan, nan, nan, nan, nan)
        ordered = sorted(seconds)
        return cls(
            p50=_rank(ordered, 0.50) * 1e3,
            p90=_rank(ordered, 0.90) * 1e3,
            p99=_rank(ordered, 0.99) * 1e3,
            max=ordered[-1] * 1e3,
            mean=sum(ordered) / len(ordered) * 1e3,
        )


@dataclass(frozen=True)
class LoadResult:
    """What one run measured (the loadgen's stdout, as JSON)."""

    mode: Mode
    tool: str
    sent: int
    requests: int
    errors: int
    rps: float
    latency_ms: Percentiles
    ttfb_ms: Percentiles | None
    client_cpu_s: float
    window_s: float
    extra: dict[str, float] = field(default_factory=dict)


def _rank(ordered: Sequence[float], q: float) -> float:
    index = max(0, math.ceil(q * len(ordered)) - 1)
    return ordered[index]


def make_body(size: int, stream: bool, model: str) -> bytes:
    """A chat-completions request body of about ``size`` bytes (padding in the user message)."""
    envelope: dict[str, object] = {
        "model": model,
        "messages": [{"role": "user", "content": ""}],
        "max_tokens": 16,
        "temperature": 0,
        "stream": stream,
    }
    if stream:
        envelope["stream_options"] = {"include_usage": True}
    empty = len(json.dumps(envelope))
    need = max(0, size - empty)
    text = (FILLER * (need // len(FILLER) + 1))[:need]
    envelope["messages"] = [{"role": "user", "content": text}]
    return json.dumps(envelope).encode()


async def _drain_stream(resp: aiohttp.ClientResponse, started: float) -> tuple[float, bool]:
    """Read an SSE body; return (time to first byte, saw ``[DONE]``)."""
    first = await resp.content.readany()
    ttfb = time.perf_counter() - started
    tail = first[-64:]
    while True:
        chunk = await resp.content.readany()
        if not chunk:
            break
        tail = (tail + chunk)[-64:]
    return ttfb, b"[DONE]" in tail


async def one_request(
    session: aiohttp.ClientSession, url: str, body: bytes, stream: bool
) -> Sample:
    """Send one POST and time it."""
    started = time.perf_counter()
    ttfb = math.nan
    ok = False
    try:
        async with session.post(url, data=body) as resp:
            if stream:
                ttfb, done = await _drain_stream(resp, started)
                ok = resp.status == 200 and done
            else:
                await resp.read()
                ok = resp.status == 200
    except (aiohttp.ClientError, TimeoutError):
        ok = False
    return Sample(started, time.perf_counter(), ttfb, ok)


async def run_open(session: aiohttp.ClientSession, spec: LoadSpec, body: bytes) -> list[Sample]:
    """Start requests on a fixed schedule; gather them all."""
    url = spec.base_url + CHAT_PATH
    interval = 1.0 / spec.rate
    t0 = time.perf_counter()
    end = t0 + spec.warmup_s + spec.duration_s
    tasks: list[asyncio.Task[Sample]] = []
    index = 0
    while (due := t0 + index * interval) < end:
        wait = due - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
            continue
        tasks.append(asyncio.create_task(one_request(session, url, body, spec.stream)))
        index += 1
    return list(await asyncio.gather(*tasks))


async def run_closed(session: aiohttp.ClientSession, spec: LoadSpec, body: bytes) -> list[Sample]:
    """``concurrency`` workers back to back until the window ends."""
    url = spec.base_url + CHAT_PATH
    end = time.perf_counter() + spec.warmup_s + spec.duration_s

    async def worker() -> list[Sample]:
        done: list[Sample] = []
        while time.perf_counter() < end:
            done.append(await one_request(session, url, body, spec.stream))
        return done

    per_worker = await asyncio.gather(*(worker() for _ in range(spec.concurrency)))
    return [sample for samples in per_worker for sample in samples]


def summarise(spec: LoadSpec, samples: Sequence[Sample], t0: float, cpu_s: float) -> LoadResult:
    """Keep requests started after the warm-up; rate counts those that ended inside the window."""
    window_start = t0 + spec.warmup_s
    window_end = window_start + spec.duration_s
    counted = [s for s in samples if s.start >= window_start]
    good = [s for s in counted if s.ok]
    finished_in_window = sum(1 for s in good if s.end <= window_end)
    ttfb = Percentiles.of([s.ttfb for s in good]) if spec.stream else None
    return LoadResult(
        mode=spec.mode,
        tool="aiohttp",
        sent=len(samples),
        requests=len(counted),
        errors=len(counted) - len(good),
        rps=finished_in_window / spec.duration_s,
        latency_ms=Percentiles.of([s.end - s.start for s in good]),
        ttfb_ms=ttfb,
        client_cpu_s=cpu_s,
        window_s=spec.duration_s,
    )


async def run(spec: LoadSpec) -> LoadResult:
    """Run one load and summarise it."""
    body = make_body(spec.body_bytes, spec.stream, spec.model)
    limit = spec.concurrency if spec.mode == "closed" else 0
    connector = aiohttp.TCPConnector(limit=limit, enable_cleanup_closed=False)
    timeout = aiohttp.ClientTimeout(total=spec.timeout_s)
    headers = {"content-type": "application/json"}
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, headers=headers, auto_decompress=False
    ) as session:
        t0 = time.perf_counter()
        cpu0 = time.process_time()
        runner = run_open if spec.mode == "open" else run_closed
        samples = await runner(session, spec, body)
        cpu_s = time.process_time() - cpu0
    return summarise(spec, samples, t0, cpu_s)


def parse_args(argv: Sequence[str] | None = None) -> LoadSpec:
    """Command-line flags to a :class:`LoadSpec`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--mode", choices=["open", "closed"], default="open")
    parser.add_argument("--rate", type=float, default=1000.0, help="open loop: requests/s")
    parser.add_argument("--concurrency", type=int, default=64, help="closed loop: connections")
    parser.add_argument("--duration", type=float, default=5.0, help="measured seconds")
    parser.add_argument("--warmup", type=float, default=1.0, help="uncounted seconds first")
    parser.add_argument("--body-bytes", type=int, default=1024)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--model", default="bench-model")
    args = parser.parse_args(argv)
    return LoadSpec(
        base_url=args.url.rstrip("/"),
        mode=args.mode,
        duration_s=args.duration,
        warmup_s=args.warmup,
        rate=args.rate,
        concurrency=args.concurrency,
        body_bytes=args.body_bytes,
        stream=args.stream,
        model=args.model,
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point: run the load, print the result as JSON."""
    spec = parse_args(argv)
    result = uvloop.run(run(spec))
    json.dump(asdict(result), sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
