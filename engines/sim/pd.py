"""Prefill/decode roles of the simulated engine, for the three transfer protocols.

The protocol is read from each request (no configuration needed):

* NIXL (vLLM NixlConnector, sequential): a prefill request carries ``kv_transfer_params`` with
  ``do_remote_decode: true``; the prefill engine runs it for one token and answers with
  ``kv_transfer_params`` (``do_remote_prefill: true``, ``remote_block_ids``,
  ``remote_engine_id``, ``remote_request_id``, ``remote_host``/``remote_port``,
  ``remote_num_tokens``, ``remote_prefill_cached_tokens``, ``transfer_mode: "pull"``,
  ``tp_size``) as vLLM 0.32 does. The decode request carries them back; the prefill is already
  done, so the decode engine only "pulls" the KV.
* Mooncake (vLLM MooncakeConnector, concurrent): prefill with ``kv_transfer_params.transfer_id``
  and ``do_remote_decode``; decode with ``do_remote_prefill``, the same ``transfer_id`` and the
  prefill's bootstrap host/port (``bootstrap_server_host`` / ``bootstrap_server_port``).
* SGLang (concurrent): both requests carry ``bootstrap_host``, ``bootstrap_port`` and
  ``bootstrap_room``.

Concurrent protocols rendezvous through the prefill engine: its :class:`KvBoard` records each
finished prefill under its key (``transfer_id`` or ``bootstrap_room``), and the decode engine
long-polls ``GET http://<bootstrap host>:<bootstrap port>/sim/kv_transfer/<key>`` (for the
simulator the bootstrap port is the prefill engine's HTTP port) until it is there.

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
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from engines.sim.config import PdSimConfig
from engines.sim.protocol import ApiError, ParsedRequest


@dataclass(frozen=True, slots=True)
class Transfer:
    """What a decode request receives: ``tokens`` of KV; ``prefill_hit`` the prefill's own hit."""

    tokens: int
    prefill_hit: int | None


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


def _bootstrap(req: ParsedRequest) -> tuple[str, int] | None:
    if req.bootstrap_host is not None and req.bootstrap_port is not None:
        return req.bootstrap_host, req.bootstrap_port
    params = req.kv_transfer_params or {}
    host, port = params.get("bootstrap_server_host"), params.get("bootstrap_server_port")
    if isinstance(host, str) and isinstance(port, int):
        return host, port
    return None


async def fetch_transfer(
    req: ParsedRequest, session: aiohttp.ClientSession, cfg: PdSimConfig
) -> Transfer | None:
    """For a decode request: what KV it receives (``None``: none, decode locally).

    NIXL: from its ``kv_transfer_params``. Concurrent protocols: long-poll the prefill engine's
    board; raises :class:`ApiError` 503 when the prefill never finishes or cannot be reached.
    """
    params: Mapping[str, Any] = req.kv_transfer_params or {}
    if req.bootstrap_room is None and params.get("do_remote_prefill") is not True:
        return None
    key = transfer_key(req)
    if key is None:  # NIXL: the prefill is done, its answer says how much KV there is
        tokens = params.get("remote_num_tokens")
        hit = params.get("remote_prefill_cached_tokens")
        return Transfer(tokens if isinstance(tokens, int) else len(req.prompt_ids),
                        hit if isinstance(hit, int) else None)
    where = _bootstrap(req)
    if where is None:
        raise ApiError(400, "a remote prefill needs a bootstrap host and port")
    url = f"http://{where[0]}:{where[1]}/sim/kv_transfer/{key}"
    timeout = aiohttp.ClientTimeout(total=cfg.wait_timeout_s + 5)
    try:
        async with session.get(url, params={"timeout": str(cfg.wait_timeout_s)},
                               timeout=timeout) as resp:
            if resp.status != 200:
                raise ApiError(503, f"KV transfer {key} failed (prefill answered {resp.status})")
            data = await resp.json()
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise ApiError(503, f"KV transfer {key} failed: {type(exc).__name__}") from None
    return Transfer(int(data["tokens"]), data.get("prefill_hit"))
