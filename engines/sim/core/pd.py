"""Prefill/decode roles of the simulated engine, for the three transfer protocols.

The protocol is read from each request (no configuration needed):

* NIXL (vLLM NixlConnector, sequential): a prefill request carries ``kv_transfer_params`` with
  ``do_remote_decode: true``; the prefill engine runs it for one token and answers with
  ``kv_transfer_params`` (``do_remote_prefill: true``, ``remote_block_ids``,
  ``remote_engine_id``, ``remote_request_id``, ``remote_host``/``remote_port``,
  ``remote_num_tokens``, ``remote_prefill_cached_tokens``, ``transfer_mode: "pull"``,
  ``tp_size``) as vLLM 0.32 does. The decode request carries them back; the prefill is already
  done, so the decode engine only "pulls" the KV.
* Mooncake (vLLM 0.32 MooncakeConnector, concurrent): prefill with ``do_remote_decode`` and
  ``transfer_id``; decode with ``do_remote_prefill``, the same ``transfer_id``,
  ``remote_engine_id`` and ``remote_bootstrap_addr`` (``http://host:port`` of the prefill
  engine's bootstrap server, :mod:`kvgate.engines.sim.bootstrap`). Validated as vLLM does: a decode
  request with ``do_remote_prefill`` lacking one of the three fields is logged ("Got invalid
  KVTransferParams") and parked, waiting for KV nobody sends, until its client disconnects
  (:class:`InvalidTransferParams`). A valid one asks ``<remote_bootstrap_addr>/query`` for the
  engine's workers, takes the worker of ``remote_engine_id`` (none: the transfer fails, 503)
  and pulls from it. A decode request is NIXL's when it carries ``remote_block_ids``. The
  prefill offers its KV only when it finished on its length cap (:func:`offers_kv`).
* SGLang (concurrent): both requests carry ``bootstrap_host``, ``bootstrap_port`` and
  ``bootstrap_room``.

Concurrent protocols rendezvous through the prefill engine: its :class:`KvBoard` records each
finished prefill under its key (``transfer_id`` or ``bootstrap_room``), and the decode engine
long-polls ``GET http://<host>:<port>/sim/kv_transfer/<key>`` until it is there: for SGLang
host and port are the request's bootstrap fields (for the simulator, the prefill engine's
HTTP port); for Mooncake, the worker address the bootstrap server listed (the bootstrap
server itself).

Loading the KV: the decode engine then waits the transfer time (:func:`transfer_seconds`, times
``time_scale``) and admits the request with the transferred tokens already computed (counted
as ``external_kv_transfer``); only the prompt's last token is computed locally, as in vLLM.
What it reports as ``cached_tokens`` follows ``pd.decode_reports``: ``transferred`` (local hit
plus transferred KV, older vLLM) or ``prefill-hit`` (the prefill side's own hit, vLLM 0.32).

Not simulated: the prefill side keeping transferred blocks pinned for a lease (its request
finishes normally and the blocks stay cached, evictable), partial transfers, TP layouts.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvgate.engines.sim.core.config import PdSimConfig
from kvgate.engines.sim.http.protocol import ApiError, ParsedRequest

log = logging.getLogger("kvgate.sim.pd")

#: What vLLM 0.32's MooncakeConnector requires (present, any value) in a decode request's
#: ``kv_transfer_params`` besides ``do_remote_prefill`` (``update_state_after_alloc``).
MOONCAKE_DECODE_FIELDS = ("remote_engine_id", "remote_bootstrap_addr", "transfer_id")
#: Timeout of a decode engine's bootstrap ``/query``, seconds (vLLM's own is
#: ``VLLM_MOONCAKE_CONNECTOR_TIMEOUT``, 30 s; loopback simulators answer at once).
_QUERY_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class Transfer:
    """What a decode request receives: ``tokens`` of KV; ``prefill_hit`` the prefill's own hit."""

    tokens: int
    prefill_hit: int | None


@dataclass(slots=True)
class PdStats:
    """Decode-side transfer counters (``/sim/state``'s ``pd``)."""

    #: Transfers received (a valid pairing with a finished prefill).
    transfers: int = 0
    #: Transfers that failed (unknown engine id, bootstrap unreachable, prefill never done).
    transfer_failures: int = 0
    #: Mooncake decode requests with invalid ``kv_transfer_params`` ("Got invalid
    #: KVTransferParams"), ever; and those parked right now.
    invalid_params: int = 0
    parked: int = 0


class InvalidTransferParams(Exception):
    """A Mooncake decode request lacking a required field: vLLM 0.32 logs "Got invalid
    KVTransferParams", schedules no pull, and leaves the request waiting for remote KV (its
    local hit is at most the prompt minus one token, so there always is KV to wait for)."""


def transfer_seconds(tokens: int, cfg: PdSimConfig) -> float:
    """Modelled KV transfer time [s]: setup + bytes / bandwidth."""
    if tokens <= 0:
        return 0.0
    return cfg.transfer_setup_s + tokens * cfg.kv_bytes_per_token / cfg.transfer_bytes_per_s


def transfer_key(req: ParsedRequest) -> str | None:
    """The rendezvous key of a concurrent protocol's request (``None``: NIXL or no P/D)."""
    if req.bootstrap_room is not None:
        return f"room-{req.bootstrap_room}"
    params = req.kv_transfer_params or {}
    tid = params.get("transfer_id")
    return f"tid-{tid}" if isinstance(tid, str) and tid else None


def offers_kv(key: str, finish_reason: str | None) -> bool:
    """Whether a finished prefill offers its KV: vLLM 0.32's Mooncake producer only when the
    request ended on its length cap (a one-token prefill that sampled EOS or a stop token
    drops the transfer); SGLang's whenever it finished."""
    if key.startswith("tid-"):
        return finish_reason == "length"
    return finish_reason not in (None, "abort")


def is_prefill_request(req: ParsedRequest) -> bool:
    params = req.kv_transfer_params or {}
    return params.get("do_remote_decode") is True or req.bootstrap_room is not None


class KvBoard:
    """Finished prefills awaiting their decode engine, by key. Bounded: past ``limit`` entries
    the oldest is dropped (its decode then times out, as a lost transfer would)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._entries: OrderedDict[str, asyncio.Future[Transfer]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def _future(self, key: str) -> asyncio.Future[Transfer]:
        fut = self._entries.get(key)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            self._entries[key] = fut
            while len(self._entries) > self.limit:
                _, old = self._entries.popitem(last=False)
                old.cancel()
        return fut

    def publish(self, key: str, transfer: Transfer) -> None:
        fut = self._future(key)
        if not fut.done():
            fut.set_result(transfer)

    def fail(self, key: str) -> None:
        fut = self._entries.pop(key, None)
        if fut is not None and not fut.done():
            fut.cancel()

    async def take(self, key: str, timeout_s: float) -> Transfer | None:
        """Wait for the key's prefill; ``None`` on timeout or if it failed. Removes the entry."""
        fut = self._future(key)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout_s)
        except TimeoutError:
            return None
        except asyncio.CancelledError:
            if fut.cancelled():  # the prefill failed or its entry was evicted
                return None
            raise
        finally:
            if self._entries.get(key) is fut:  # one decode per key: the entry is spent
                del self._entries[key]


def nixl_answer_params(
    engine_id: str, host: str, port: int, request_id: str, prompt_tokens: int, cached: int,
    block_size: int,
) -> dict[str, Any]:
    """The ``kv_transfer_params`` a vLLM 0.32 NIXL prefill engine answers with."""
    blocks = -(-prompt_tokens // block_size)
    return {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": engine_id,
        "remote_request_id": request_id, "remote_block_ids": list(range(blocks)),
        "remote_host": host, "remote_port": port, "remote_num_tokens": prompt_tokens,
        "remote_prefill_cached_tokens": cached, "transfer_mode": "pull", "tp_size": 1,
    }


def _nixl_transfer(req: ParsedRequest, params: Mapping[str, Any]) -> Transfer:
    """NIXL: the prefill is done; its answer (passed back here) says how much KV there is."""
    tokens = params.get("remote_num_tokens")
    hit = params.get("remote_prefill_cached_tokens")
    return Transfer(tokens if isinstance(tokens, int) else len(req.prompt_ids),
                    hit if isinstance(hit, int) else None)


def _sglang_source(req: ParsedRequest) -> tuple[str, str]:
    """Where an SGLang decode request pulls from: its bootstrap host and port."""
    if req.bootstrap_host is None or req.bootstrap_port is None:
        raise ApiError(400, "a remote prefill needs a bootstrap host and port")
    return f"http://{req.bootstrap_host}:{req.bootstrap_port}", f"room-{req.bootstrap_room}"


async def _get_json(session: aiohttp.ClientSession, url: str, timeout_s: float,
                    params: Mapping[str, str] | None = None) -> Any:
    """GET ``url``'s JSON; any failure is the transfer's (:class:`ApiError` 503)."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with session.get(url, params=params, timeout=timeout) as resp:
            if resp.status != 200:
                raise ApiError(503, f"KV transfer failed: {url} answered {resp.status}")
            return await resp.json()
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise ApiError(503, f"KV transfer failed: {url}: {type(exc).__name__}") from None


def _worker_url(entry: object, engine_id: str) -> str | None:
    """The pull URL of a ``/query`` entry (one data-parallel rank) if it is ``engine_id``'s:
    its tensor-parallel rank 0, pipeline rank 0 worker, ``tcp://host:port`` as HTTP."""
    if not isinstance(entry, Mapping) or entry.get("engine_id") != engine_id:
        return None
    ranks = entry.get("worker_addr")
    first = ranks.get("0") if isinstance(ranks, Mapping) else None
    addr = first.get("0") if isinstance(first, Mapping) else None
    return "http://" + addr.removeprefix("tcp://") if isinstance(addr, str) else None


async def _mooncake_source(
    params: Mapping[str, Any], session: aiohttp.ClientSession, stats: PdStats
) -> tuple[str, str]:
    """Where a Mooncake decode request pulls from, as vLLM 0.32 finds it (module docstring)."""
    missing = [name for name in MOONCAKE_DECODE_FIELDS if name not in params]
    if missing:
        stats.invalid_params += 1
        log.warning("Got invalid KVTransferParams: %s. This request will not utilize "
                    "KVTransfer (missing %s)", dict(params), ", ".join(missing))
        raise InvalidTransferParams(", ".join(missing))
    addr, engine_id = params["remote_bootstrap_addr"], params["remote_engine_id"]
    if not isinstance(addr, str) or not isinstance(engine_id, str):
        raise ApiError(503, "KV transfer failed: remote_bootstrap_addr and remote_engine_id "
                       "must be strings")
    listing = await _get_json(session, addr + "/query", _QUERY_TIMEOUT_S)
    for entry in listing.values() if isinstance(listing, Mapping) else ():
        url = _worker_url(entry, engine_id)
        if url is not None:
            return url, f"tid-{params['transfer_id']}"
    raise ApiError(503, f"KV transfer failed: remote engine_id {engine_id} not found from "
                   f"bootstrap server {addr}")


async def fetch_transfer(
    req: ParsedRequest, session: aiohttp.ClientSession, cfg: PdSimConfig, stats: PdStats
) -> Transfer | None:
    """For a decode request: what KV it receives (``None``: none, decode locally).

    NIXL: from its ``kv_transfer_params``. Concurrent protocols: long-poll the prefill side.
    Raises :class:`ApiError` 503 when the transfer fails, :class:`InvalidTransferParams` for a
    Mooncake request vLLM would park.
    """
    params: Mapping[str, Any] = req.kv_transfer_params or {}
    if req.bootstrap_room is None and not params.get("do_remote_prefill"):
        return None
    try:
        if req.bootstrap_room is not None:
            url, key = _sglang_source(req)
        elif "remote_block_ids" in params:
            transfer = _nixl_transfer(req, params)
            stats.transfers += 1
            return transfer
        else:
            url, key = await _mooncake_source(params, session, stats)
        data = await _get_json(session, f"{url}/sim/kv_transfer/{key}", cfg.wait_timeout_s + 5,
                               {"timeout": str(cfg.wait_timeout_s)})
    except ApiError as exc:
        if exc.status == 503:
            stats.transfer_failures += 1
        raise
    stats.transfers += 1
    return Transfer(int(data["tokens"]), data.get("prefill_hit"))


async def take_transfer(board: KvBoard, key: str, wait_param: str | None) -> Transfer | None:
    """The prefill side of the long poll: wait (the ``timeout`` query parameter, seconds;
    default 30, at most 600) for the finished prefill ``key``."""
    try:
        wait = min(float(wait_param or "30"), 600.0)
    except ValueError:
        wait = 30.0
    return await board.take(key, wait)
