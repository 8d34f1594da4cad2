"""The replay's load generator: sends trace requests on their (compressed) schedule, streaming.

Open loop: request *i* is sent at ``offsets[i]`` seconds after the start whatever the answers do,
except that at most ``concurrency`` requests are in flight (a request that has to wait for a free
slot is sent late; its lateness is recorded). TTFT runs from the moment the request is sent to
the first SSE ``data:`` event; the usage chunk (``stream_options.include_usage``) gives the
prompt and cached tokens the engine reported.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp
from tqdm import tqdm

#: Response header in which kvgate names the engine that served a request.
ENGINE_HEADER = "x-kvgate-engine"


@dataclass(slots=True)
class Outcome:
    """What happened to one request (times in wall-clock seconds)."""

    index: int
    status: int = 0  # HTTP status; 0 when no response arrived
    error: str | None = None
    late_s: float = 0.0
    ttft_s: float | None = None
    latency_s: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    engine: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.ttft_s is not None


@dataclass(frozen=True, slots=True)
class Job:
    """One request to send: body, session id (or None) and when (seconds after the start)."""

    index: int
    offset_s: float
    session: str | None


BodyFor = Callable[[int], bytes]


def session_headers(session: str | None) -> dict[str, str]:
    """Headers of a session: kvgate reads ``x-session-affinity``; vllm-router's consistent
    hash keys on ``x-session-id``; sglang-router reads neither."""
    headers = {"content-type": "application/json"}
    if session is not None:
        headers["x-session-affinity"] = session
        headers["x-session-id"] = session
    return headers


def read_usage(line: bytes, out: Outcome) -> None:
    """Take ``usage`` from an SSE data line that has it (the final usage chunk)."""
    if b'"prompt_tokens"' not in line:
        return
    usage = json.loads(line[5:]).get("usage") or {}
    out.prompt_tokens = usage.get("prompt_tokens")
    details = usage.get("prompt_tokens_details")
    out.cached_tokens = details.get("cached_tokens") if isinstance(details, dict) else None


async def _consume(resp: aiohttp.ClientResponse, out: Outcome, sent: float) -> None:
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        if out.ttft_s is None:
            out.ttft_s = time.perf_counter() - sent
        if line != b"data: [DONE]":
            read_usage(line, out)


async def send_one(
    session: aiohttp.ClientSession, url: str, job: Job, body: bytes, out: Outcome
) -> None:
    """POST one streaming request and fill ``out``."""
    sent = time.perf_counter()
    try:
        async with session.post(url, data=body, headers=session_headers(job.session)) as resp:
            out.status = resp.status
            out.engine = resp.headers.get(ENGINE_HEADER)
            if resp.status != 200:
                out.error = (await resp.text())[:200]
                return
            await _consume(resp, out, sent)
        out.latency_s = time.perf_counter() - sent
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:200]


async def replay(
    base_url: str | Sequence[str], jobs: Sequence[Job], body_for: BodyFor, concurrency: int,
    timeout_s: float = 600.0, label: str = "", progress: bool = True,
) -> list[Outcome]:
    """Send ``jobs`` to ``base_url``/v1/completions on their schedule; one outcome per job.
    Several base URLs (gateway replicas): job *i* goes to the *i mod N*-th (round robin)."""
    outcomes = [Outcome(job.index) for job in jobs]
    slots = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(jobs), desc=label, unit="req", disable=not progress, leave=True)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    bases = [base_url] if isinstance(base_url, str) else list(base_url)
    urls = [b + "/v1/completions" for b in bases]

    async def run(job: Job, out: Outcome) -> None:
        try:
            url = urls[job.index % len(urls)]
            await send_one(client, url, job, body_for(job.index), out)
        finally:
            slots.release()
            bar.update(1)

    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as client:
        tasks: list[asyncio.Task[None]] = []
        start = time.perf_counter()
        for job, out in zip(jobs, outcomes, strict=True):
            delay = start + job.offset_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            await slots.acquire()
            out.late_s = max(0.0, time.perf_counter() - start - job.offset_s)
            tasks.append(asyncio.create_task(run(job, out)))
        await asyncio.gather(*tasks)
    bar.close()
    return outcomes
