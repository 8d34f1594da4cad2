"""Runs an agentic workload (:mod:`bench.agentic`) against one base URL and records every request.

Closed loop per slot: ``workload.slots`` coroutines each take the next agent from the queue and
play it turn by turn (think, send, read the streamed answer, append it); a sub-agent runs inside
its parent's slot while the parent waits. Every request is a streaming chat completion with
``temperature: 0``, ``ignore_eos``, the run's ``cache_salt``, ``stream_options.include_usage``
and ``return_token_ids`` (vLLM): the first chunk carries the prompt's token ids as the engine
tokenized them and every chunk its generated ids, the reference for the ideal cache
(:mod:`bench.agentic_ideal`). With ``sessions`` each request sends ``x-session-affinity`` (and a
sub-agent ``x-parent-session-id``); without, no session header at all.

A failed request (HTTP error, broken stream) is recorded with its error and the conversation goes
on with an empty answer, so every system sees the same workload shape.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.agentic import Agent, SubAgent, Turn, Workload

SESSION_HEADER = "x-session-affinity"
#: The same session id under the name vllm-router's ``consistent_hash`` reads (kvgate reads it
#: too, as an alternative to ``x-session-affinity``: same value, same session).
PEER_SESSION_HEADER = "x-session-id"
PARENT_HEADER = "x-parent-session-id"
#: Response header in which kvgate names the engine that served a request.
ENGINE_HEADER = "x-kvgate-engine"


@dataclass(slots=True)
class Record:
    """One request: who sent it, when (seconds since the run started), what came back."""

    index: int
    sid: str
    parent: str | None
    turn: int
    sent_s: float
    done_s: float | None = None
    status: int = 0
    error: str | None = None
    ttft_s: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    prompt_ids: tuple[int, ...] = ()
    output_ids: tuple[int, ...] = ()
    engine: str | None = None
    answer: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.done_s is not None

    @property
    def latency_s(self) -> float | None:
        return None if self.done_s is None else self.done_s - self.sent_s


@dataclass(slots=True)
class _Stream:
    """What a streamed answer carried so far."""

    content: list[str] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    usage: dict[str, Any] | None = None


def read_event(data: dict[str, Any], into: _Stream) -> None:
    """Fold one SSE ``data`` object (a chunk or the usage chunk) into ``into``."""
    if isinstance(data.get("prompt_token_ids"), list):
        into.prompt_ids = [int(t) for t in data["prompt_token_ids"]]
    for choice in data.get("choices") or []:
        delta = choice.get("delta") or {}
        if delta.get("content"):
            into.content.append(str(delta["content"]))
        if isinstance(choice.get("token_ids"), list):
            into.output_ids.extend(int(t) for t in choice["token_ids"])
    if isinstance(data.get("usage"), dict):
        into.usage = data["usage"]


def finish(record: Record, stream: _Stream) -> None:
    """Copy the stream's ids, answer and usage into ``record``."""
    record.prompt_ids = tuple(stream.prompt_ids)
    record.output_ids = tuple(stream.output_ids)
    record.answer = "".join(stream.content)
    usage = stream.usage or {}
    record.prompt_tokens = usage.get("prompt_tokens")
    details = usage.get("prompt_tokens_details")
    record.cached_tokens = details.get("cached_tokens") if isinstance(details, dict) else None
    if stream.usage is None:
        record.error = "stream ended without a usage chunk"


@dataclass
class Runner:
    """One run of a workload against ``base_url``."""

    base_url: str
    workload: Workload
    model: str
    salt: str
    sessions: bool
    timeout_s: float = 300.0
    records: list[Record] = field(default_factory=list)
    _t0: float = 0.0
    _http: aiohttp.ClientSession | None = None

    def body(self, messages: Sequence[dict[str, str]], turn: Turn) -> bytes:
        return json.dumps({
            "model": self.model, "messages": list(messages), "max_tokens": turn.max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "cache_salt": self.salt,
            "return_token_ids": True,
        }).encode()

    def headers(self, sid: str, parent: str | None) -> dict[str, str]:
        out = {"content-type": "application/json"}
        if self.sessions:
            out[SESSION_HEADER] = sid
            out[PEER_SESSION_HEADER] = sid  # vllm-router's consistent_hash keys on it
            if parent is not None:
                out[PARENT_HEADER] = parent
        return out

    def url_for(self, sid: str, parent: str | None) -> str:
        """Where a request of session ``sid`` goes: the base URL (a client-side router, such
        as bench/kv_steady.py's pinning by index, overrides it)."""
        return self.base_url

    async def send(self, messages: Sequence[dict[str, str]], turn: Turn, sid: str,
                   parent: str | None, index: int) -> Record:
        assert self._http is not None
        rec = Record(len(self.records), sid, parent, index, time.perf_counter() - self._t0)
        self.records.append(rec)
        stream = _Stream()
        try:
            async with self._http.post(self.url_for(sid, parent) + "/v1/chat/completions",
                                       data=self.body(messages, turn),
                                       headers=self.headers(sid, parent)) as resp:
                rec.status, rec.engine = resp.status, resp.headers.get(ENGINE_HEADER)
                if resp.status != 200:
                    rec.error = (await resp.text())[:300]
                    return rec
                await self._consume(resp, rec, stream)
            finish(rec, stream)
            rec.done_s = time.perf_counter() - self._t0
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            rec.error = f"{type(exc).__name__}: {exc}"[:300]
        return rec

    async def _consume(self, resp: aiohttp.ClientResponse, rec: Record, stream: _Stream) -> None:
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            if rec.ttft_s is None:
                rec.ttft_s = time.perf_counter() - self._t0 - rec.sent_s
            data = json.loads(line[5:])
            if "error" in data:
                raise ValueError(f"error event: {str(data['error'])[:200]}")
            read_event(data, stream)

    async def conversation(self, system: str, turns: Sequence[Turn], sid: str,
                           parent: str | None, opening: str = "") -> str:
        """Play ``turns`` after ``system``; returns the last answer. ``opening`` (a sub-agent's
        report) prefixes the first user message."""
        messages = [{"role": "system", "content": system}]
        answer, report = "", opening
        for i, turn in enumerate(turns):
            await asyncio.sleep(turn.think_s)
            prefix = f"[sub-agent report] {report}\n" if report else ""
            messages.append({"role": "user", "content": prefix + turn.user})
            rec = await self.send(messages, turn, sid, parent, i)
            answer, report = rec.answer, ""
            messages.append({"role": "assistant", "content": answer})
            if turn.spawn is not None:
                report = await self.sub_agent(turn.spawn, sid)
        return answer

    async def sub_agent(self, sub: SubAgent, parent: str) -> str:
        return await self.conversation(self.workload.sub_prompts[sub.kind], sub.turns, sub.sid,
                                       parent)

    async def _slot(self, queue: deque[Agent]) -> None:
        while queue:
            agent = queue.popleft()
            await asyncio.sleep(agent.start_s)
            await self.conversation(self.workload.shared_prompt, agent.turns, agent.sid, None)

    async def run(self) -> list[Record]:
        """Play the whole workload; one record per request, in send order."""
        queue = deque(self.workload.agents)
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        connector = aiohttp.TCPConnector(limit=self.workload.slots * 2)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
            self._http, self._t0 = http, time.perf_counter()
            await asyncio.gather(*(self._slot(queue) for _ in range(self.workload.slots)))
        self._http = None
        return self.records
