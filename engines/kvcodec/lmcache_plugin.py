"""The codec in LMCache's data path: a remote storage plugin that stores LMCache's KV chunks in a
Mooncake Store encoded (engine side; imported by LMCache only, never by the gateway).

Why a connector and not a serde: LMCache 0.5.6's ``remote_serde`` takes only its built-in names
(``CreateSerde`` in ``lmcache/v1/storage_backend/naive_serde/__init__.py`` knows ``naive``,
``kivi`` and ``cachegen`` and raises ``ValueError`` for any other); its supported extension point
for the remote tier is the *remote storage plugin* framework: ``remote_storage_plugins: [NAME]``
plus ``extra_config`` keys ``remote_storage_plugin.NAME.module_path`` / ``.class_name`` naming a
``RemoteConnector`` subclass, which LMCache imports and builds with ``(loop, local_cpu_backend,
config)`` (``ConnectorManager._remote_adapters_plugin_launcher``). ``kvgate deploy render``
writes exactly that (``PLUGIN_NAME`` below) for a fleet with a Mooncake shared tier.

:class:`KvcodecMooncakeConnector` opens its own ``MooncakeDistributedStore``, configured from the
same ``extra_config`` keys as LMCache's built-in Mooncake connector (LMCache's own
``MooncakeStoreConfig.load_from_lmcache_config`` and ``setup_mooncake_store``), and puts each
chunk as a ``KVO1`` frame (:func:`kvgate.engines.kvcodec.store.encode_object`): the chunk's
bytes, BF16 entropy-coded by the codec, with its shapes, dtypes and memory format, so a get in
any other process rebuilds the same object bit for bit. Keys are LMCache's
(``CacheEngineKey.to_string()``). ``extra_config["kvcodec_block_values"]``: values per codec
block (default one vLLM block of one layer of an 8B model, 16,384).
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector
from lmcache.v1.storage_backend.connector.mooncakestore_connector import (
    MooncakeStoreConfig,
    setup_mooncake_store,
)

from kvgate.engines.kvcodec.codec import Params, backend
from kvgate.engines.kvcodec.store import (
    DEFAULT_BLOCK_VALUES,
    ObjectHeader,
    decode_object,
    encode_object,
)

PLUGIN_NAME = "kvcodec"
MODULE_PATH = __name__
CLASS_NAME = "KvcodecMooncakeConnector"


class KvcodecMooncakeConnector(RemoteConnector):  # type: ignore[misc]
    """LMCache remote connector: Mooncake Store put/get of codec-encoded chunks."""

    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend: Any,
                 config: Any) -> None:
        super().__init__(local_cpu_backend.config, local_cpu_backend.metadata)
        from mooncake.store import MooncakeDistributedStore

        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.store = MooncakeDistributedStore()
        setup_mooncake_store(self.store, MooncakeStoreConfig.load_from_lmcache_config(config))
        extra = config.extra_config or {}
        self.block_values = int(extra.get("kvcodec_block_values", DEFAULT_BLOCK_VALUES))
        self.params = Params()
        self.backend = backend("torch")
        #: bytes LMCache handed over and bytes stored (frames), for the saving
        self.bytes_in = 0
        self.bytes_stored = 0

    def _encode(self, memory_obj: Any) -> bytes:
        data = memory_obj.byte_array
        header = ObjectHeader(
            shapes=[list(s) for s in memory_obj.get_shapes()],
            dtypes=[str(d).removeprefix("torch.") for d in memory_obj.get_dtypes()],
            fmt=int(memory_obj.get_memory_format().value), nbytes=len(data))
        raw = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(
            0, dtype=torch.uint8)
        return encode_object(raw, header, self.block_values, self.params, self.backend)

    def _put_sync(self, key: str, memory_obj: Any) -> int:
        frame = self._encode(memory_obj)
        rc = int(self.store.put(key, frame))
        if rc == 0:
            self.bytes_in += memory_obj.get_size()
            self.bytes_stored += len(frame)
        return rc

    def _get_sync(self, key: str) -> Any:
        frame = bytes(self.store.get(key))
        if not frame:
            return None
        header, data = decode_object(frame, self.backend)
        from lmcache.v1.memory_management import MemoryFormat

        obj = self.local_cpu_backend.allocate(
            [torch.Size(s) for s in header.shapes],
            [getattr(torch, d) for d in header.dtypes], MemoryFormat(header.fmt))
        if obj is None:
            return None
        obj.raw_tensor.view(torch.uint8)[:header.nbytes].copy_(data)
        return obj

    async def exists(self, key: Any) -> bool:
        return self.exists_sync(key)

    def exists_sync(self, key: Any) -> bool:
        return bool(self.store.is_exist(key.to_string()) == 1)

    async def get(self, key: Any) -> Any:
        return await asyncio.to_thread(self._get_sync, key.to_string())

    async def put(self, key: Any, memory_obj: Any) -> None:
        rc = await asyncio.to_thread(self._put_sync, key.to_string(), memory_obj)
        if rc != 0:
            raise RuntimeError(f"Mooncake put of {key.to_string()} returned {rc}")

    async def list(self) -> list[str]:
        return []

    async def close(self) -> None:
        self.store.close()


def lmcache_extra_config() -> dict[str, str]:
    """The ``extra_config`` keys that make LMCache load this connector as ``PLUGIN_NAME``."""
    return {f"remote_storage_plugin.{PLUGIN_NAME}.module_path": MODULE_PATH,
            f"remote_storage_plugin.{PLUGIN_NAME}.class_name": CLASS_NAME}
