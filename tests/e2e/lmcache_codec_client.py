"""Real K/V through LMCache 0.5.6's own remote backend with the codec's remote storage plugin
(kvgate.engines.kvcodec.lmcache_plugin), configured from a rendered ``lmcache-<engine>.yaml``.

Run it with the LMCache venv's python (kvgate.engines.local.lmcache: LMCache on the engine venv's
torch and the Mooncake venv's client), ``PYTHONPATH`` holding only ``kvgate/engines/kvcodec``
(kvgate.engines.kvcodec.venv.engine_side_path).

``python lmcache_codec_client.py hold|read LMCACHE_CONFIG_YAML``

* ``hold``: capture all-MiniLM-L6-v2's K and V on one 256-token window, lay them out as one
  LMCache chunk (``KV_2LTD``: 2 x 6 layers x 256 tokens x 384, bfloat16), put it through
  ``RemoteBackend.submit_put_task`` and wait; print one JSON line: the key, the chunk's bit
  SHA-256, its raw bytes and the bytes the store holds for it (the frame), ``contains``; keep
  the client (the object lives in its segment) until a line on stdin; print ``{"close": 0}``.
* ``read``: read the key (a JSON string on stdin) through ``RemoteBackend.get_blocking`` in
  this separate process; print its bit SHA-256, shape, dtype, memory format, the frame's length
  and whether an absent key gives ``None``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
import threading
from typing import Any

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.v1.storage_backend.remote_backend import RemoteBackend

MODEL = "sentence-transformers/all-MiniLM-L6-v2"
#: (layers, K/V, tokens per chunk, KV heads, head_dim) of all-MiniLM-L6-v2 in LMCache's terms.
KV_SHAPE = (6, 2, 256, 12, 32)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.int16).numpy().tobytes()).hexdigest()


def emit(data: dict[str, Any]) -> None:
    print(json.dumps(data), flush=True)


def backend(config_path: str) -> tuple[RemoteBackend, LocalCPUBackend, LMCacheMetadata]:
    config = LMCacheEngineConfig.from_file(config_path)
    config.max_local_cpu_size = 0.1  # GB of CPU buffers: two 2.25 MiB chunks here
    meta = LMCacheMetadata(model_name=MODEL, world_size=1, local_world_size=1, worker_id=0,
                           local_worker_id=0, kv_dtype=torch.bfloat16, kv_shape=KV_SHAPE)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    cpu = LocalCPUBackend(config, meta)
    [plugin] = config.remote_storage_plugins
    return RemoteBackend(config, meta, loop, cpu, "cpu", plugin_name=plugin), cpu, meta


def key(chunk_hash: int) -> CacheEngineKey:
    return CacheEngineKey(MODEL, 1, 0, chunk_hash, torch.bfloat16)


def frame_len(rb: RemoteBackend, k: CacheEngineKey) -> int:
    inner = rb.connection._connector  # InstrumentedRemoteConnector -> the codec's connector
    return len(bytes(inner.store.get(k.to_string())))


def hold(rb: RemoteBackend, cpu: LocalCPUBackend, meta: LMCacheMetadata) -> None:
    from kvgate.engines.kvcodec.measure.realkv import capture

    kv = capture(windows=1)
    chunk = torch.stack([torch.stack([kv[f"{kind}/{layer}"] for layer in range(KV_SHAPE[0])])
                         for kind in "KV"])
    obj = cpu.allocate(meta.get_shapes(), meta.get_dtypes(), MemoryFormat.KV_2LTD)
    assert obj is not None and obj.tensor is not None
    obj.tensor.copy_(chunk)
    k = key(0x5EED)
    future = rb.submit_put_task(k, obj)
    assert future is not None, "put not submitted"
    future.result(60)
    emit({"key": k.to_string(), "sha256": digest(chunk), "raw": obj.get_size(),
          "stored": frame_len(rb, k), "contains": rb.contains(k)})
    sys.stdin.readline()


def read(rb: RemoteBackend) -> None:
    k = CacheEngineKey.from_string(json.loads(sys.stdin.readline()))
    obj = rb.get_blocking(k)
    out: dict[str, Any] = {"found": obj is not None}
    if obj is not None and obj.tensor is not None:
        out.update(sha256=digest(obj.tensor), shape=list(obj.tensor.shape),
                   dtype=str(obj.tensor.dtype), fmt=obj.get_memory_format().name,
                   stored=frame_len(rb, k))
    out["absent"] = rb.get_blocking(key(0xAB5E)) is None
    emit(out)


def main(argv: list[str]) -> int:
    mode, config_path = argv[1], argv[2]
    rb, cpu, meta = backend(config_path)
    if mode == "hold":
        hold(rb, cpu, meta)
    else:
        read(rb)
    rb.close()
    emit({"close": 0})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
