"""Stand-ins for third-party providers, served on loopback for the LiteLLM backend tests.

Two small starlette apps, reached by the real ``litellm`` library through ``api_base``:

* :func:`openai_app`: OpenAI's ``POST /v1/chat/completions`` (JSON and SSE with
  ``stream_options.include_usage``), ``usage.prompt_tokens_details.cached_tokens`` unless
  ``report_cached`` is off, a ``tool_calls`` answer when the request has ``tools``.
* :func:`anthropic_app`: Anthropic's ``POST /v1/messages`` (JSON and its SSE event sequence),
  prompt caching as Anthropic does it: the prompt up to the last ``cache_control`` block is the
  cacheable prefix, written on first sight (``cache_creation_input_tokens``) and read after
  (``cache_read_input_tokens``); ``input_tokens`` is what is left.

Both count one token per whitespace-separated word, answer with deterministic text, record
every request (``FakeProvider.requests``: body and headers) and obey ``FakeProvider.fail`` (the
next N requests answer status S with the provider's own error body). ``serve`` runs one with
uvicorn on a free loopback port in the running event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.servers import serve_asgi

ANSWER = "the quick brown fox jumps"
#: Most request bodies (oldest dropped) and cached prefixes (all dropped) a fake remembers.
MAX_RECORDED = 256


@dataclass
class FakeProvider:
    """What a fake saw and what it should do next."""

    api_key: str = "sk-test"
    report_cached: bool = True
    fail_next: int = 0
    fail_status: int = 429
    #: Cut the next OpenAI stream after this many events (no ``[DONE]``); None: never.
    drop_after: int | None = None
    #: Pause between OpenAI stream events (seconds), and how many streams are being sent.
    chunk_delay_s: float = 0.0
    streams_open: int = 0
    requests: list[dict[str, Any]] = field(default_factory=list)
    seen_prefixes: set[str] = field(default_factory=set)

    def fail(self, count: int, status: int) -> None:
        self.fail_next, self.fail_status = count, status

    def record(self, body: dict[str, Any], headers: dict[str, str]) -> None:
        self.requests.append({"body": body, "headers": headers})
        del self.requests[:-MAX_RECORDED]

    def take_failure(self) -> int | None:
        if self.fail_next <= 0:
            return None
        self.fail_next -= 1
        return self.fail_status


def words(value: Any) -> int:
    """Tokens of a message content (a string or a list of text blocks): one per word."""
    if isinstance(value, str):
        return len(value.split())
    if isinstance(value, list):
        return sum(words(b.get("text", "")) for b in value if isinstance(b, dict))
    return 0


def _sse(payload: dict[str, Any], event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(payload)}\n\n".encode()


# -- OpenAI ------------------------------------------------------------------------------


def _openai_usage(fake: FakeProvider, prompt: int, completion: int) -> dict[str, Any]:
    usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                             "total_tokens": prompt + completion}
    if fake.report_cached:  # "cached": every prompt word but the last message's
        usage["prompt_tokens_details"] = {"cached_tokens": max(prompt - 2, 0)}
    return usage


def _openai_message(body: dict[str, Any]) -> tuple[dict[str, Any], str]:
    tools = body.get("tools")
    if tools:
        name = tools[0]["function"]["name"]
        call = {"id": "call_1", "type": "function",
                "function": {"name": name, "arguments": json.dumps({"city": "Paris"})}}
        return {"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls"
    fmt = body.get("response_format") or {}
    text = json.dumps({"answer": ANSWER}) if fmt.get("type") == "json_schema" else ANSWER
    return {"role": "assistant", "content": text}, "stop"


async def _openai_chat(request: Request) -> Response:
    fake: FakeProvider = request.app.state.fake
    body = await request.json()
    fake.record(body, dict(request.headers))
    if request.headers.get("authorization") != f"Bearer {fake.api_key}":
        return JSONResponse({"error": {"message": "bad key", "type": "invalid_request_error",
                                       "code": "invalid_api_key"}}, status_code=401)
    status = fake.take_failure()
    if status is not None:
        return JSONResponse({"error": {"message": f"injected {status}", "type": "server_error",
                                       "code": None}}, status_code=status)
    prompt = sum(words(m.get("content")) for m in body["messages"])
    message, finish = _openai_message(body)
    completion = words(message.get("content") or "x")
    base = {"id": "chatcmpl-fake", "created": 1, "model": body["model"]}
    usage = _openai_usage(fake, prompt, completion)
    if not body.get("stream"):
        return JSONResponse({**base, "object": "chat.completion", "usage": usage, "choices": [
            {"index": 0, "message": message, "finish_reason": finish}]})
    drop, fake.drop_after = fake.drop_after, None
    return StreamingResponse(_counted(fake, _openai_stream(body, base, message, finish, usage,
                                                           drop, fake.chunk_delay_s)),
                             media_type="text/event-stream")


async def _counted(fake: FakeProvider, stream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    fake.streams_open += 1
    try:
        async for part in stream:
            yield part
    finally:
        fake.streams_open -= 1


class StreamCut(Exception):
    """Raised inside a response body: the server drops the connection mid-stream."""


async def _openai_stream(body: dict[str, Any], base: dict[str, Any], message: dict[str, Any],
                         finish: str, usage: dict[str, Any], drop: int | None = None,
                         delay_s: float = 0.0) -> AsyncIterator[bytes]:
    chunk = {**base, "object": "chat.completion.chunk"}
    pieces: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
    if message.get("tool_calls"):
        pieces.append({"tool_calls": [{"index": 0, **message["tool_calls"][0]}]})
    else:
        pieces += [{"content": w + " "} for w in str(message["content"]).split()]
    for i, delta in enumerate(pieces):
        if drop is not None and i >= drop:
            raise StreamCut("injected mid-stream failure")
        if i and delay_s:
            await asyncio.sleep(delay_s)
        last = i == len(pieces) - 1
        yield _sse({**chunk, "choices": [{"index": 0, "delta": delta,
                                          "finish_reason": finish if last else None}]})
    if (body.get("stream_options") or {}).get("include_usage"):
        yield _sse({**chunk, "choices": [], "usage": usage})
    yield b"data: [DONE]\n\n"


def openai_app(fake: FakeProvider) -> Starlette:
    app = Starlette(routes=[Route("/v1/chat/completions", _openai_chat, methods=["POST"])])
    app.state.fake = fake
    return app


# -- Anthropic -----------------------------------------------------------------------------


def _blocks(body: dict[str, Any]) -> Iterator[tuple[int, bool]]:
    """(tokens, has cache_control) per content block, system first, in prompt order."""
    system = body.get("system")
    sources: list[Any] = [system] if system else []
    sources += [m.get("content") for m in body.get("messages", [])]
    for content in sources:
        if isinstance(content, str):
            yield words(content), False
        elif isinstance(content, list):
            for block in content:
                if isinstance(block, dict):
                    yield words(block.get("text", "")), "cache_control" in block


def _anthropic_usage(fake: FakeProvider, body: dict[str, Any]) -> dict[str, int]:
    blocks = list(_blocks(body))
    total = sum(n for n, _ in blocks)
    marks = [i for i, (_, cc) in enumerate(blocks) if cc]
    prefix = sum(n for n, _ in blocks[: marks[-1] + 1]) if marks else 0
    key = json.dumps([body.get("system"), body.get("messages")])[: 64 + prefix * 8]
    read = write = 0
    if prefix:
        if key in fake.seen_prefixes:
            read = prefix
        else:
            write = prefix
            if len(fake.seen_prefixes) >= MAX_RECORDED:  # a small cache: forget everything
                fake.seen_prefixes.clear()
            fake.seen_prefixes.add(key)
    return {"input_tokens": total - read - write, "output_tokens": len(ANSWER.split()),
            "cache_creation_input_tokens": write, "cache_read_input_tokens": read}


_ANTHROPIC_ERRORS = {400: "invalid_request_error", 401: "authentication_error",
                     404: "not_found_error", 429: "rate_limit_error", 500: "api_error",
                     529: "overloaded_error"}


def _anthropic_error(status: int, message: str) -> JSONResponse:
    kind = _ANTHROPIC_ERRORS.get(status, "api_error")
    return JSONResponse({"type": "error", "error": {"type": kind, "message": message}},
                        status_code=status)


def _anthropic_content(body: dict[str, Any]) -> tuple[dict[str, Any], str]:
    tools = body.get("tools")
    if tools:
        return {"type": "tool_use", "id": "toolu_1", "name": tools[0]["name"],
                "input": {"city": "Paris"}}, "tool_use"
    return {"type": "text", "text": ANSWER}, "end_turn"


async def _anthropic_messages(request: Request) -> Response:
    fake: FakeProvider = request.app.state.fake
    body = await request.json()
    fake.record(body, dict(request.headers))
    if request.headers.get("x-api-key") != fake.api_key:
        return _anthropic_error(401, "invalid x-api-key")
    status = fake.take_failure()
    if status is not None:
        return _anthropic_error(status, f"injected {status}")
    if body["model"].endswith("missing"):
        return _anthropic_error(404, f"model: {body['model']}")
    usage = _anthropic_usage(fake, body)
    block, stop = _anthropic_content(body)
    message = {"id": "msg_fake", "type": "message", "role": "assistant",
               "model": body["model"], "stop_sequence": None}
    if not body.get("stream"):
        return JSONResponse({**message, "content": [block], "stop_reason": stop, "usage": usage})
    return StreamingResponse(_anthropic_stream(message, block, stop, usage),
                             media_type="text/event-stream")


async def _anthropic_stream(message: dict[str, Any], block: dict[str, Any], stop: str,
                            usage: dict[str, int]) -> AsyncIterator[bytes]:
    start_usage = {**usage, "output_tokens": 1}
    yield _sse({"type": "message_start", "message": {
        **message, "content": [], "stop_reason": None, "usage": start_usage}}, "message_start")
    if block["type"] == "text":
        yield _sse({"type": "content_block_start", "index": 0,
                    "content_block": {"type": "text", "text": ""}}, "content_block_start")
        for word in ANSWER.split():
            yield _sse({"type": "content_block_delta", "index": 0,
                        "delta": {"type": "text_delta", "text": word + " "}},
                       "content_block_delta")
    else:
        yield _sse({"type": "content_block_start", "index": 0,
                    "content_block": {**block, "input": {}}}, "content_block_start")
        yield _sse({"type": "content_block_delta", "index": 0, "delta": {
            "type": "input_json_delta", "partial_json": json.dumps(block["input"])}},
            "content_block_delta")
    yield _sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
    yield _sse({"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
                "usage": {"output_tokens": usage["output_tokens"]}}, "message_delta")
    yield _sse({"type": "message_stop"}, "message_stop")


def anthropic_app(fake: FakeProvider) -> Starlette:
    app = Starlette(routes=[Route("/v1/messages", _anthropic_messages, methods=["POST"])])
    app.state.fake = fake
    return app


@contextlib.asynccontextmanager
async def serve(app: Starlette) -> AsyncIterator[str]:
    """Serve ``app`` with uvicorn on a free loopback port in this loop; yields its base URL."""
    async with serve_asgi(app, lifespan="off") as url:
        yield url
