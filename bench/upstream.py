"""A fast fake OpenAI-compatible engine for overhead benchmarks.

It answers instantly with precomputed bytes so that, on a shared core, it costs the load generator
as little CPU as possible. Raw asyncio + httptools on uvloop (no framework) for the same reason.

Routes:
  POST /v1/chat/completions, POST /v1/completions
      a fixed small JSON (``usage`` with ``prompt_tokens_details.cached_tokens``), or, when the body
      has ``"stream": true``, an SSE stream of K content chunks, one usage chunk (``choices: []``)
      and ``data: [DONE]``, each SSE event in its own HTTP chunk;
  GET /v1/models   one model (``bench-model`` by default);
  GET /health      200, empty body;
  GET /metrics     200, empty Prometheus text.

Run: ``python -m bench.upstream --port 8100 [--stream-chunks 10] [--chunk-interval-ms 0]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import httptools
import uvloop

CREATED = 1_700_000_000
PROMPT_TOKENS = 256
CACHED_TOKENS = 128


@dataclass(frozen=True)
class Replies:
    """Every reply the fake engine can send, fully encoded (status line, headers, body)."""

    chat: bytes
    completion: bytes
    chat_stream: tuple[bytes, ...]
    completion_stream: tuple[bytes, ...]
    models: bytes
    health: bytes
    metrics: bytes
    not_found: bytes
    stream_head: bytes


def _usage(completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": PROMPT_TOKENS,
        "completion_tokens": completion_tokens,
        "total_tokens": PROMPT_TOKENS + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": CACHED_TOKENS},
    }


def _dumps(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _full_reply(status: str, content_type: str, body: bytes) -> bytes:
    head = (
        f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def _http_chunk(payload: bytes) -> bytes:
    return f"{len(payload):x}\r\n".encode() + payload + b"\r\n"


def _sse(obj: object) -> bytes:
    return _http_chunk(b"data: " + _dumps(obj) + b"\n\n")


def _chat_body(model: str, chunks: int) -> dict[str, Any]:
    return {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": CREATED,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "tok " * chunks},
                "finish_reason": "stop",
            }
        ],
        "usage": _usage(chunks),
    }


def _completion_body(model: str, chunks: int) -> dict[str, Any]:
    return {
        "id": "cmpl-bench",
        "object": "text_completion",
        "created": CREATED,
        "model": model,
        "choices": [{"index": 0, "text": "tok " * chunks, "finish_reason": "stop"}],
        "usage": _usage(chunks),
    }


def _chat_stream(model: str, chunks: int) -> tuple[bytes, ...]:
    base = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": CREATED,
            "model": model}
    events = []
    for i in range(chunks):
        delta: dict[str, str] = {"content": "tok "}
        if i == 0:
            delta["role"] = "assistant"
        finish = "stop" if i == chunks - 1 else None
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        events.append(_sse({**base, "choices": [choice]}))
    events.append(_sse({**base, "choices": [], "usage": _usage(chunks)}))
    events.append(_http_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    return tuple(events)


def _completion_stream(model: str, chunks: int) -> tuple[bytes, ...]:
    base = {"id": "cmpl-bench", "object": "text_completion", "created": CREATED, "model": model}
    events = []
    for i in range(chunks):
        finish = "stop" if i == chunks - 1 else None
        choice = {"index": 0, "text": "tok ", "finish_reason": finish}
        events.append(_sse({**base, "choices": [choice]}))
    events.append(_sse({**base, "choices": [], "usage": _usage(chunks)}))
    events.append(_http_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    return tuple(events)


def build_replies(model: str, chunks: int) -> Replies:
    """Precompute every reply for ``model`` with ``chunks`` content chunks per stream."""
    models = {"object": "list", "data": [{"id": model, "object": "model", "created": CREATED,
                                          "owned_by": "bench"}]}
    not_found = {"error": {"message": "not found", "type": "not_found_error", "param": None,
                           "code": 404}}
    return Replies(
        chat=_full_reply("200 OK", "application/json", _dumps(_chat_body(model, chunks))),
        completion=_full_reply(
            "200 OK", "application/json", _dumps(_completion_body(model, chunks))
        ),
        chat_stream=_chat_stream(model, chunks),
        completion_stream=_completion_stream(model, chunks),
        models=_full_reply("200 OK", "application/json", _dumps(models)),
        health=_full_reply("200 OK", "text/plain", b""),
        metrics=_full_reply("200 OK", "text/plain; version=0.0.4", b""),
        not_found=_full_reply("404 Not Found", "application/json", _dumps(not_found)),
        stream_head=(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n"
        ),
    )


def wants_stream(body: bytes) -> bool:
    """True when the JSON body has a top-level-looking ``"stream": true`` (no full JSON parse).

    A quote inside a JSON string is escaped, so ``"stream"`` followed by ``:`` only matches a key.
    """
    start = body.find(b'"stream"')
    while start >= 0:
        rest = body[start + 8 : start + 40].lstrip()
        if rest.startswith(b":"):
            return rest[1:].lstrip().startswith(b"true")
        start = body.find(b'"stream"', start + 1)
    return False


class EngineProtocol(asyncio.Protocol):
    """One client connection: parse HTTP/1.1 requests, answer from :class:`Replies`."""

    def __init__(self, replies: Replies, chunk_interval_s: float) -> None:
        self._replies = replies
        self._interval = chunk_interval_s
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._url = b""
        self._body: list[bytes] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._routes = {
            b"/v1/chat/completions": replies.chat,
            b"/v1/completions": replies.completion,
            b"/v1/models": replies.models,
            b"/health": replies.health,
            b"/metrics": replies.metrics,
        }

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's TCPTransport does not subclass asyncio.Transport but implements it.
        self._transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            if self._transport is not None:
                self._transport.close()

    # httptools callbacks
    def on_message_begin(self) -> None:
        self._url = b""
        self._body = []

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"expect" and value.lower() == b"100-continue" and self._transport:
            self._transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        transport = self._transport
        if transport is None:
            return
        keep_alive = self._parser.should_keep_alive()
        stream = self._pick_stream()
        if stream is None:
            transport.write(self._pick_reply())
        elif self._interval <= 0:
            transport.write(self._replies.stream_head + b"".join(stream))
        else:
            task = asyncio.get_running_loop().create_task(self._drip(transport, stream, keep_alive))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        if not keep_alive:
            transport.close()

    def _path(self) -> bytes:
        return self._url.split(b"?", 1)[0]

    def _pick_stream(self) -> tuple[bytes, ...] | None:
        path = self._path()
        if path not in (b"/v1/chat/completions", b"/v1/completions"):
            return None
        if not wants_stream(b"".join(self._body)):
            return None
        if path == b"/v1/chat/completions":
            return self._replies.chat_stream
        return self._replies.completion_stream

    def _pick_reply(self) -> bytes:
        return self._routes.get(self._path(), self._replies.not_found)

    async def _drip(
        self, transport: asyncio.Transport, stream: Sequence[bytes], keep_alive: bool
    ) -> None:
        transport.write(self._replies.stream_head + stream[0])
        for event in stream[1:]:
            await asyncio.sleep(self._interval)
            if transport.is_closing():
                return
            transport.write(event)
        if not keep_alive:
            transport.close()


async def serve(host: str, port: int, replies: Replies, chunk_interval_s: float) -> None:
    """Serve until cancelled."""
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: EngineProtocol(replies, chunk_interval_s), host, port, backlog=4096
    )
    async with server:
        await server.serve_forever()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line flags."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--model", default="bench-model")
    parser.add_argument("--stream-chunks", type=int, default=10, help="content chunks per stream")
    parser.add_argument(
        "--chunk-interval-ms", type=float, default=0.0,
        help="pause between SSE events (0: the whole stream in one write)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point."""
    args = parse_args(argv)
    replies = build_replies(args.model, max(1, args.stream_chunks))
    uvloop.run(serve(args.host, args.port, replies, args.chunk_interval_ms / 1000.0))


if __name__ == "__main__":
    main()
