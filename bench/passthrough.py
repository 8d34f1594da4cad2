"""A minimal pass-through proxy for choosing the gateway's upstream HTTP client by measurement,
and for the floor under kvgate's own cost per request.

Server: uvicorn (uvloop) with a raw ASGI app, identical for every variant. Upstream client:
``aiohttp.ClientSession``, ``httpx.AsyncClient`` (both on uvicorn's httptools protocol), or
``h1``: kvgate's own engine client (middleware/transport/h1client.py) on kvgate's own HTTP front end
(middleware/transport/h1server.py), the I/O layer ``kvgate serve`` runs, with none of the gateway's
work (no parsing, routing, accounting or logging): what kvgate costs above it is the gateway's own.
Each client has a pool larger than the load (so none reconnects) and no response decoding.
Bodies stream through chunk by chunk (``h1``: the answer is read whole, as kvgate reads a JSON
answer).

Run: ``python -m bench.passthrough --client aiohttp --upstream http://127.0.0.1:8100 --port 8000``.
"""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import aiohttp
import httpx
import uvicorn

from kvgate.middleware.transport.h1client import H1Client

Message = dict[str, Any]
Send = Callable[[Message], Awaitable[None]]
Receive = Callable[[], Awaitable[Message]]
POOL = 1024


class Upstream(Protocol):
    """Forwards one request and streams the answer to ``send``."""

    async def forward(self, path: str, ctype: bytes, body: bytes, send: Send) -> None: ...
    async def close(self) -> None: ...


def _start(status: int, ctype: str | None, length: str | None) -> Message:
    headers = [(b"content-type", (ctype or "application/json").encode())]
    if length is not None:
        headers.append((b"content-length", length.encode()))
    return {"type": "http.response.start", "status": status, "headers": headers}


class AiohttpUpstream:
    """aiohttp.ClientSession, keep-alive pool of :data:`POOL`."""

    def __init__(self, base: str) -> None:
        self._base = base
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=POOL), auto_decompress=False
        )

    async def forward(self, path: str, ctype: bytes, body: bytes, send: Send) -> None:
        headers = {"content-type": ctype.decode()}
        async with self._session.post(self._base + path, data=body, headers=headers) as resp:
            h = resp.headers
            await send(_start(resp.status, h.get("content-type"), h.get("content-length")))
            async for chunk in resp.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    async def close(self) -> None:
        await self._session.close()


class HttpxUpstream:
    """httpx.AsyncClient, keep-alive pool of :data:`POOL`."""

    def __init__(self, base: str) -> None:
        limits = httpx.Limits(max_connections=POOL, max_keepalive_connections=POOL)
        self._client = httpx.AsyncClient(base_url=base, limits=limits, timeout=30.0)

    async def forward(self, path: str, ctype: bytes, body: bytes, send: Send) -> None:
        request = self._client.build_request(
            "POST", path, content=body, headers={"content-type": ctype.decode()}
        )
        resp = await self._client.send(request, stream=True)
        try:
            h = resp.headers
            await send(_start(resp.status_code, h.get("content-type"), h.get("content-length")))
            async for chunk in resp.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:
            await resp.aclose()
        await send({"type": "http.response.body", "body": b""})

    async def close(self) -> None:
        await self._client.aclose()


class H1Upstream:
    """kvgate's engine client, ``limit_per_host`` :data:`POOL`; the answer read whole."""

    def __init__(self, base: str) -> None:
        self._base = base
        self._client = H1Client(POOL)
        self._timeout = aiohttp.ClientTimeout(total=30.0, connect=5.0)

    async def forward(self, path: str, ctype: bytes, body: bytes, send: Send) -> None:
        resp = await self._client.request("POST", self._base + path, data=body,
                                          headers={"content-type": ctype.decode()},
                                          timeout=self._timeout)
        raw = await resp.read()
        await send(_start(resp.status, resp.headers.get("content-type"), str(len(raw))))
        await send({"type": "http.response.body", "body": raw})

    async def close(self) -> None:
        await self._client.close()


#: The HTTP server each client runs behind: uvicorn's httptools protocol, or kvgate's own.
SERVERS = {"aiohttp": "httptools", "httpx": "httptools",
           "h1": "kvgate.middleware.transport.h1server:H1Protocol"}


class PassThrough:
    """Raw ASGI app: ``GET /health`` answers itself, every POST goes upstream unchanged."""

    def __init__(self, make_upstream: Callable[[], Upstream]) -> None:
        self._make = make_upstream
        self._upstream: Upstream | None = None

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["path"] == "/health":
            await send(_start(200, "text/plain", "0"))
            await send({"type": "http.response.body", "body": b""})
        elif self._upstream is not None:
            body, ctype = await _read_body(scope, receive)
            await self._upstream.forward(scope["path"], ctype, body, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._upstream = self._make()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._upstream is not None:
                    await self._upstream.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


async def _read_body(scope: Message, receive: Receive) -> tuple[bytes, bytes]:
    ctype = next((v for k, v in scope["headers"] if k == b"content-type"), b"application/json")
    parts: list[bytes] = []
    more = True
    while more:
        message = await receive()
        parts.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(parts), ctype


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--client", choices=sorted(SERVERS), required=True)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    base = args.upstream.rstrip("/")
    kinds: dict[str, Callable[[], Upstream]] = {
        "aiohttp": lambda: AiohttpUpstream(base), "httpx": lambda: HttpxUpstream(base),
        "h1": lambda: H1Upstream(base),
    }
    app = PassThrough(kinds[args.client])
    uvicorn.run(app, host=args.host, port=args.port, loop="uvloop", http=SERVERS[args.client],
                lifespan="on", access_log=False, log_level="warning")


if __name__ == "__main__":
    main()
