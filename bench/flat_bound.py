"""A lower bound for a Python gateway: the cache-aware default's essential work per request in
one flat function, on kvgate's own HTTP server, engine client and primitives.

What ``kvgate serve --engine URL`` must do for a non-streaming chat request to one engine,
with no plugin framework around it: the body parsed and checked (apis/openai.py's checks),
the prompt rendered and pseudo-tokenized (plugins/prefix/approx_tokens.py), its record chain hashed
through the chain memo (plugins/prefix/record_chains.py), matched in and recorded into a
prefix-closed index (plugins/prefix/index/index.py), one placement cost per engine (uncached tokens,
insertion pressure, queued work), the token load charged and released, the request forwarded, the
usage read from the answer, token counters, and an access-log line (batched per event-loop
iteration into a file, as kvgate's). Not done: auth, session affinity, metrics histograms,
tracing, the circuit breaker, retries, streaming. It is a measuring stick, not a gateway:
``bench.overhead --systems kvgate,flat-bound,passthrough-h1`` shows how much of kvgate's CPU
per request is this work and how much the request path around it (contexts, hooks, the
scheduler, per-request objects).

Run: ``python -m bench.flat_bound --upstream http://127.0.0.1:8100 --port 8000``;
``python -m bench.flat_bound --routing-only 1024`` times the routing work alone (tokenize, hash,
match, place, charge, record) in a tight loop on a 1 KiB chat body, with no server.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import aiohttp
import orjson
import uvicorn

from bench.loadgen import make_body
from kvgate.apis.openai import check_common
from kvgate.middleware.process import tune_gc
from kvgate.middleware.transport.h1client import H1Client
from kvgate.plugins.prefix import record_hash
from kvgate.plugins.prefix.approx_tokens import render_chat, tokenize
from kvgate.plugins.prefix.index.index import KvIndex
from kvgate.plugins.prefix.record_chains import ChainMemo

Message = dict[str, Any]
Send = Callable[[Message], Awaitable[None]]
Receive = Callable[[], Awaitable[Message]]
ENGINE = "engine-0"
BLOCK = 16  # the record's block size [tokens], the producer's default
DEFAULT_OUTPUT = 256  # expected output [tokens] when the body sets no limit
CAPACITY = 1_000_000  # KV capacity [tokens] the placement divides insertions by
RECORD_TTL_S = 600.0


class FlatGateway:
    """The ASGI app: ``GET`` answers the model list, ``POST`` is the flat request path."""

    def __init__(self, upstream: str, log: IO[bytes]) -> None:
        self.url = upstream.rstrip("/") + "/v1/chat/completions"
        self.client: H1Client | None = None
        self.timeout = aiohttp.ClientTimeout(total=60.0, connect=5.0)
        self.memo = ChainMemo()
        self.index = KvIndex(CAPACITY // BLOCK, prefix_closed=True)
        self.scope = record_hash.scope_of(None, None, None)
        self.queued = {ENGINE: 0.0}
        self.inserted = {ENGINE: 0.0}
        self.tokens: dict[tuple[str, str], int] = {}
        self.served = 0
        self.log = log
        self.pending: list[bytes] = []

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                kind = (await receive())["type"]
                if kind == "lifespan.startup":
                    self.client = H1Client(1024)
                await send({"type": kind + ".complete"})
                if kind == "lifespan.shutdown":
                    return
        elif scope["method"] == "GET":
            await _answer(send, 200, orjson.dumps({"data": [{"id": "bench-model"}]}), [])
        else:
            await self.chat(receive, send)

    async def chat(self, receive: Receive, send: Send) -> None:
        started = time.monotonic()
        body = (await receive())["body"]  # one message: the server buffers small bodies
        data = orjson.loads(body)
        model = check_common(data)[0]
        target, work = self.route(data, started)
        self.served += 1
        rid = f"{self.served:032x}"
        assert self.client is not None
        try:
            resp = await self.client.request(
                "POST", self.url, data=body, timeout=self.timeout,
                headers={"content-type": "application/json", "x-request-id": rid})
            raw = await resp.read()
        finally:
            self.queued[target] -= work
        usage = orjson.loads(raw).get("usage") or {}
        counts = (("prompt", usage.get("prompt_tokens")),
                  ("completion", usage.get("completion_tokens")),
                  ("cached", (usage.get("prompt_tokens_details") or {}).get("cached_tokens")))
        for kind, n in counts:
            if isinstance(n, int):
                self.tokens[model, kind] = self.tokens.get((model, kind), 0) + n
        await _answer(send, resp.status, raw, [(b"x-request-id", rid.encode()),
                                               (b"x-kvgate-engine", target.encode())])
        self._log({"ts": time.time(), "request_id": rid, "api": "chat", "status": resp.status,
                   "model": model, "engines": [target], "prompt_tokens": counts[0][1],
                   "cached_tokens": counts[2][1], "output_tokens": counts[1][1],
                   "total_s": time.monotonic() - started})

    def route(self, data: Mapping[str, Any], now: float) -> tuple[str, int]:
        """The routing work: tokenize, hash, match, place, charge (released by the caller:
        ``queued[target] -= work``), record. The target and the work charged [tokens]."""
        ids = tokenize(render_chat(data["messages"]))
        hashes = self.memo.chain(ids, BLOCK, scope=self.scope)
        held = self.index.match({BLOCK: hashes}, now, 0, [ENGINE]).get(ENGINE, (0, 0))[0]
        prompt, output = len(ids), data.get("max_tokens") or DEFAULT_OUTPUT
        costs = {e: (prompt - held) * (1.0 + self.inserted[e] / CAPACITY) + q
                 for e, q in self.queued.items()}
        target = min(costs, key=costs.__getitem__)
        work = prompt - held + output
        self.queued[target] += work
        self.inserted[target] += work
        self.index.record(target, hashes, now + RECORD_TTL_S, block_size=BLOCK)
        return target, work

    def _log(self, entry: dict[str, object]) -> None:
        if not self.pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self.pending.append(orjson.dumps(entry))

    def _flush(self) -> None:
        lines, self.pending = self.pending, []
        self.log.write(b"\n".join(lines) + b"\n")
        self.log.flush()


async def _answer(send: Send, status: int, body: bytes,
                  headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
        *headers]})
    await send({"type": "http.response.body", "body": body})


def routing_us(body_size: int, rounds: int, trials: int = 5) -> list[float]:
    """CPU µs of :meth:`FlatGateway.route` (and the release) per request, on one chat body
    of ``body_size`` bytes repeated, in a tight loop: ``trials`` figures, sorted."""
    gateway = FlatGateway("http://127.0.0.1:1", io.BytesIO())
    data = orjson.loads(make_body(body_size, False, "bench-model"))
    out = []
    for trial in range(trials + 1):  # the first warms the memo and the index
        start = time.process_time()
        for _ in range(rounds):
            target, work = gateway.route(data, time.monotonic())
            gateway.queued[target] -= work
        if trial:
            out.append((time.process_time() - start) / rounds * 1e6)
    return sorted(out)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--routing-only", type=int, default=0, metavar="BYTES",
                        help="no server: time the routing work alone on a chat body of BYTES, "
                             "print the figures and exit")
    parser.add_argument("--upstream")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--access-log", type=Path, default=None,
                        help="file the lines are appended to (default: a temporary file)")
    args = parser.parse_args(argv)
    if args.routing_only:
        print(json.dumps({"routing_us_per_request": routing_us(args.routing_only, 50_000)}))
        return
    if not args.upstream:
        parser.error("--upstream is required")
    with (open(args.access_log, "ab") if args.access_log
          else tempfile.TemporaryFile()) as log:
        tune_gc()  # as kvgate serve
        uvicorn.run(FlatGateway(args.upstream, log), host=args.host, port=args.port,
                    loop="uvloop", http="kvgate.middleware.transport.h1server:H1Protocol",
                    lifespan="on",
                    access_log=False, log_level="warning")


if __name__ == "__main__":
    main()
