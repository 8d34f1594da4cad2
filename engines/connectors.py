"""KV-transfer connectors for prefill/decode disaggregation (``kvgate.connectors`` entry points).

Each one shapes the two hops of a disaggregated request for one engine protocol; the gateway
(``middleware/serving/disagg.py``) sends them. A connector's own I/O, if any, is ``prepare`` (run
before the hops). Wire facts: ``../shared/design/PROTOCOLS.md`` and docs/disaggregation.md.

``vllm-nixl`` (sequential) — vLLM's NixlConnector
    Hop 1 to the prefill engine: the client's request with ``stream: false``, ``max_tokens: 1``
    (and ``max_completion_tokens: 1`` for chat), no ``stream_options``, no ``min_tokens``, and
    ``kv_transfer_params = {"do_remote_decode": true, "do_remote_prefill": false,
    "remote_engine_id": null, "remote_block_ids": null, "remote_host": null,
    "remote_port": null}``. Its JSON answer's ``kv_transfer_params`` (``do_remote_prefill``,
    ``remote_block_ids``, ``remote_engine_id``, ``remote_host``/``port``, ...) go verbatim into
    hop 2, the client's own request to the decode engine. A prefill answer without them means
    no transfer: the gateway decodes locally.

``vllm-mooncake`` (concurrent) — vLLM 0.32's MooncakeConnector
    First (``prepare``) the prefill engine's id: ``GET http://<bootstrap host>:<port>/query``
    on its bootstrap server answers ``{"<dp rank>": {"engine_id": ..., "worker_addr": ...}}``;
    kept per bootstrap address (:class:`EngineIds`). Then both hops at once with the same
    ``X-Request-Id`` and a ``transfer_id`` kvgate makes (:func:`transfer_id`). Prefill: as for
    NIXL, plus ``ignore_eos: true`` and without ``stop_token_ids`` (the KV is offered only on a
    length-capped finish), with ``kv_transfer_params = {"do_remote_decode": true,
    "transfer_id": ID}`` (its answer carries no ``kv_transfer_params``). Decode: the client's
    request with ``kv_transfer_params = {"do_remote_prefill": true, "transfer_id": ID,
    "remote_engine_id": <prefill engine id>,
    "remote_bootstrap_addr": "http://<bootstrap host>:<port>"}`` (the decode engine appends
    ``/query`` itself). A decode request lacking one of these fields is not an error for vLLM:
    it logs "Got invalid KVTransferParams" and the request waits for KV that never comes.

``sglang`` (concurrent) — SGLang's PD disaggregation
    Both hops get the client's request plus ``bootstrap_host``, ``bootstrap_port`` and
    ``bootstrap_room`` (random in [0, 2^63 - 1], shared by both); the prefill hop is sent
    non-streaming (its answer is only read for its cache hit), decode streams as asked.

Bootstrap address (concurrent connectors): the prefill engine's ``bootstrap_host`` /
``bootstrap_port`` labels (config ``engines[].labels``), else the host of its URL and
``bootstrap_port`` (8998: the default of both SGLang's ``--disaggregation-bootstrap-port`` and
vLLM's ``VLLM_MOONCAKE_BOOTSTRAP_PORT``).

Cache hit (for the client's usage): the prefill answer's
``usage.prompt_tokens_details.cached_tokens``; for vLLM also
``kv_transfer_params.remote_prefill_cached_tokens`` (0.32). ``decode_reports`` says what the
decode engine's own ``cached_tokens`` means, used only when the prefill hit is unknown.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, ClassVar
from urllib.parse import urlsplit

import aiohttp
from pydantic import BaseModel, ConfigDict, Field

from kvgate.middleware.framework.connector import (
    DecodeCachedConvention,
    HopContext,
    TransferUnavailable,
    reported_cached,
)
from kvgate.middleware.framework.types import Api, Endpoint, InferenceRequest

log = logging.getLogger("kvgate.connectors")

_PREFILL_DROP = ("stream_options", "min_tokens")


class ConnectorParams(BaseModel):
    """Params shared by every connector."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    #: ``prefill-hit``: the decode engine's ``cached_tokens`` already is the prefill's hit
    #: (vLLM >= 0.32); ``transferred``: it counts the received KV too (older vLLM, SGLang).
    #: Only used when the prefill answer reports no hit. Default ``transferred``: when unsure,
    #: report "unknown" rather than a hit that was never computed locally.
    decode_reports: DecodeCachedConvention = "transferred"
    #: Bootstrap port when the prefill engine has no ``bootstrap_port`` label (8998: the
    #: default of SGLang's ``--disaggregation-bootstrap-port`` and of vLLM's
    #: ``VLLM_MOONCAKE_BOOTSTRAP_PORT``).
    bootstrap_port: int = Field(8998, ge=1, le=65535)


def _one_token_prefill(req: InferenceRequest, body: dict[str, Any]) -> dict[str, Any]:
    """The client's body as a non-streaming, one-token prefill request."""
    out = {k: v for k, v in body.items() if k not in _PREFILL_DROP}
    out["stream"] = False
    out["max_tokens"] = 1
    if req.api == Api.CHAT:
        out["max_completion_tokens"] = 1
    return out


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def bootstrap_address(prefill: Endpoint, default_port: int) -> tuple[str, int]:
    """Where the decode engine reaches the prefill engine's bootstrap server."""
    host = prefill.labels.get("bootstrap_host") or urlsplit(prefill.url).hostname or "127.0.0.1"
    port_label = prefill.labels.get("bootstrap_port", "")
    port = int(port_label) if port_label.isdigit() else default_port
    return host, port


class _Base:
    name: ClassVar[str] = ""
    Params: ClassVar[type[BaseModel]] = ConnectorParams
    concurrent: ClassVar[bool] = False

    def __init__(self, params: BaseModel) -> None:
        assert isinstance(params, ConnectorParams)
        self.params = params
        self.decode_reports: DecodeCachedConvention = params.decode_reports

    async def prepare(self, session: aiohttp.ClientSession, ctx: HopContext) -> HopContext:
        return ctx  # nothing to learn before the hops

    def hop_failed(self, ctx: HopContext) -> None:
        return None  # nothing cached

    def prefill_hit(self, prefill_answer: Mapping[str, Any]) -> int | None:
        hit = reported_cached(prefill_answer)
        if hit is not None:
            return hit
        ktp = prefill_answer.get("kv_transfer_params")
        return _int(ktp.get("remote_prefill_cached_tokens")) if isinstance(ktp, Mapping) else None


class VllmNixlConnector(_Base):
    """``vllm-nixl``: sequential NIXL transfer (module docstring)."""

    name = "vllm-nixl"

    def prefill_body(
        self, req: InferenceRequest, body: dict[str, Any], ctx: HopContext
    ) -> dict[str, Any]:
        out = _one_token_prefill(req, body)
        out["kv_transfer_params"] = {
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None,
        }
        return out

    def decode_body(
        self, req: InferenceRequest, body: dict[str, Any], ctx: HopContext,
        prefill_answer: Mapping[str, Any] | None,
    ) -> dict[str, Any]:
        params = None if prefill_answer is None else prefill_answer.get("kv_transfer_params")
        if not isinstance(params, Mapping):
            raise TransferUnavailable("the prefill answer has no kv_transfer_params")
        return {**body, "kv_transfer_params": dict(params)}


#: Prefill engines whose id :class:`EngineIds` remembers; past it the least recently used one is
#: forgotten (and asked again on its next request). Far more prefill engines than one gateway
#: fronts, so in practice nothing is evicted; each entry is a URL and an id (~200 bytes).
ENGINE_ID_LIMIT = 1024


def bootstrap_url(host: str, port: int) -> str:
    """``http://<host>:<port>`` (an IPv6 host in brackets): vLLM Mooncake's
    ``remote_bootstrap_addr``, to which the decode engine appends ``/query``."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


def engine_id_from_query(data: object) -> str:
    """The prefill engine's id from its bootstrap server's ``GET /query`` answer.

    vLLM 0.32 answers ``{"<dp rank>": {"engine_id": str, "worker_addr": {"<tp rank>":
    {"<pp rank>": "tcp://host:port"}}}}``: one entry per data-parallel rank, each rank its own
    engine id. kvgate sends the prefill hop to one HTTP endpoint without choosing a rank, so it
    needs exactly one. Raises :class:`TransferUnavailable` for anything else.
    """
    if not isinstance(data, Mapping):
        raise TransferUnavailable("the bootstrap /query answer is not a JSON object")
    if not data:
        raise TransferUnavailable("no prefill worker has registered with the bootstrap server")
    if len(data) > 1:
        raise TransferUnavailable(f"the bootstrap server lists {len(data)} data-parallel ranks; "
                                  "kvgate needs one prefill endpoint per rank")
    entry = next(iter(data.values()))
    engine_id = entry.get("engine_id") if isinstance(entry, Mapping) else None
    if not isinstance(engine_id, str) or not engine_id:
        raise TransferUnavailable("the bootstrap /query answer has no engine_id")
    return engine_id


class EngineIds:
    """Prefill engine ids by bootstrap URL, learned from ``GET <url>/query``.

    Bounded: at most ``limit`` URLs, the least recently used evicted first. An entry older than
    ``ttl_s`` seconds is asked again (a restarted vLLM draws a new id), :meth:`forget` drops one
    at once (a hop failed). Concurrent lookups of one URL share one query.
    """

    def __init__(
        self, ttl_s: float, timeout_s: float, limit: int = ENGINE_ID_LIMIT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self.limit = limit
        self._clock = clock
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._ids: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._pending: dict[str, asyncio.Future[str]] = {}

    def __len__(self) -> int:
        return len(self._ids)

    def forget(self, url: str) -> None:
        self._ids.pop(url, None)

    async def get(self, session: aiohttp.ClientSession, url: str) -> str:
        """The engine id behind ``url``; raises :class:`TransferUnavailable` if it cannot
        be learned."""
        known = self._ids.get(url)
        if known is not None and self._clock() - known[1] < self.ttl_s:
            self._ids.move_to_end(url)
            return known[0]
        task = self._pending.get(url)
        if task is None:
            task = asyncio.ensure_future(self._query(session, url))
            self._pending[url] = task
            task.add_done_callback(lambda t: self._settled(url, t))
        return await asyncio.shield(task)  # a cancelled waiter leaves the shared query running

    def _settled(self, url: str, task: asyncio.Future[str]) -> None:
        self._pending.pop(url, None)
        if task.cancelled() or task.exception() is not None:  # retrieved: awaited or not
            return
        engine_id = task.result()
        previous = self._ids.pop(url, None)
        if previous is None or previous[0] != engine_id:
            log.info("prefill bootstrap %s: engine id %s", url, engine_id)
        self._ids[url] = (engine_id, self._clock())
        while len(self._ids) > self.limit:
            self._ids.popitem(last=False)

    async def _query(self, session: aiohttp.ClientSession, url: str) -> str:
        try:
            async with session.get(url + "/query", timeout=self._timeout) as resp:
                status, raw = resp.status, await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise TransferUnavailable(
                f"bootstrap server {url} unreachable ({type(exc).__name__})") from None
        if status != 200:
            raise TransferUnavailable(f"bootstrap server {url}/query answered {status}")
        try:
            data = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise TransferUnavailable(f"bootstrap server {url}/query answered no JSON") from None
        return engine_id_from_query(data)


class MooncakeParams(ConnectorParams):
    #: How long a learned prefill engine id is used before the bootstrap server is asked
    #: again, seconds. vLLM draws a new random id when an engine restarts (unless its
    #: ``--kv-transfer-config`` fixes ``engine_id``); a restart (model load) takes longer than
    #: 30 s, so a restarted engine is asked again before it serves, and a failed hop drops the
    #: id at once anyway. Cost: one small GET per prefill engine per 30 s.
    engine_id_ttl_s: float = Field(30.0, gt=0)
    #: Timeout of one bootstrap query, seconds. The bootstrap server answers from memory in its
    #: own thread, in milliseconds even when the engine is busy; 2 s means it is down or
    #: wedged, and the request is better decoded locally than kept waiting.
    bootstrap_timeout_s: float = Field(2.0, gt=0)


def transfer_id(ctx: HopContext) -> str:
    """vLLM Mooncake's ``transfer_id``: the request id plus this attempt's room, so a retried
    request never reuses the id of an earlier attempt the prefill engine may still hold."""
    return f"{ctx.request_id}-{ctx.room:016x}"


class VllmMooncakeConnector(_Base):
    """``vllm-mooncake``: concurrent Mooncake transfer (module docstring)."""

    name = "vllm-mooncake"
    Params = MooncakeParams
    concurrent = True

    def __init__(self, params: BaseModel) -> None:
        super().__init__(params)
        assert isinstance(params, MooncakeParams)
        self.engine_ids = EngineIds(params.engine_id_ttl_s, params.bootstrap_timeout_s)

    def bootstrap(self, ctx: HopContext) -> str:
        """The prefill engine's bootstrap URL (``remote_bootstrap_addr``)."""
        return bootstrap_url(*bootstrap_address(ctx.prefill, self.params.bootstrap_port))

    async def prepare(self, session: aiohttp.ClientSession, ctx: HopContext) -> HopContext:
        engine_id = await self.engine_ids.get(session, self.bootstrap(ctx))
        return dataclasses.replace(ctx, prefill_engine_id=engine_id)

    def hop_failed(self, ctx: HopContext) -> None:
        self.engine_ids.forget(self.bootstrap(ctx))

    def prefill_body(
        self, req: InferenceRequest, body: dict[str, Any], ctx: HopContext
    ) -> dict[str, Any]:
        """As NIXL's, plus ``ignore_eos`` and no ``stop_token_ids``: vLLM 0.32's Mooncake
        producer offers the KV only when the prefill ends on its length cap, so a first token
        that is EOS or a stop token would leave the decode engine nothing to pull."""
        out = {k: v for k, v in _one_token_prefill(req, body).items() if k != "stop_token_ids"}
        out["ignore_eos"] = True
        out["kv_transfer_params"] = {"do_remote_decode": True, "transfer_id": transfer_id(ctx)}
        return out

    def decode_body(
        self, req: InferenceRequest, body: dict[str, Any], ctx: HopContext,
        prefill_answer: Mapping[str, Any] | None,
    ) -> dict[str, Any]:
        assert ctx.prefill_engine_id is not None, "prepare() learns the prefill engine id"
        params = {"do_remote_prefill": True, "transfer_id": transfer_id(ctx),
                  "remote_engine_id": ctx.prefill_engine_id,
                  "remote_bootstrap_addr": self.bootstrap(ctx)}
        return {**body, "kv_transfer_params": params}


class SglangConnector(_Base):
    """``sglang``: concurrent SGLang bootstrap transfer (module docstring)."""

    name = "sglang"
    concurrent = True

    def _bootstrap(self, ctx: HopContext) -> dict[str, Any]:
        host, port = bootstrap_address(ctx.prefill, self.params.bootstrap_port)
        return {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": ctx.room}

    def prefill_body(
        self, req: InferenceRequest, body: dict[str, Any], ctx: HopContext
    ) -> dict[str, Any]:
        out = {k: v for k, v in body.items() if k != "stream_options"}
        return {**out, "stream": False, **self._bootstrap(ctx)}

    def decode_body(
        self, req: InferenceRequest, body: dict[str, Any], ctx: HopContext,
        prefill_answer: Mapping[str, Any] | None,
    ) -> dict[str, Any]:
        return {**body, **self._bootstrap(ctx)}


class SharedStoreConnector(_Base):
    """``shared-store`` (sequential): engines sharing a KV store (LMCache with a Mooncake Store
    backend). The prefill hop is a one-token request, which computes the prompt's KV and
    stores it (LMCache saves 256-token chunks); the decode hop is the client's request
    unchanged, and the decode engine's LMCache finds the prefix in the store by its hash. No
    transfer parameters exist; the decode engine counts store hits as cached, so the client's
    cached tokens come from the prefill answer."""

    name = "shared-store"

    def prefill_body(
        self, req: InferenceRequest, body: dict[str, Any], ctx: HopContext
    ) -> dict[str, Any]:
        return _one_token_prefill(req, body)

    def decode_body(
        self, req: InferenceRequest, body: dict[str, Any], ctx: HopContext,
        prefill_answer: Mapping[str, Any] | None,
    ) -> dict[str, Any]:
        return body
