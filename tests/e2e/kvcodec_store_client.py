"""Real K/V through a real Mooncake Store with the codec's :class:`CodecStore`; run it with the
ENGINE venv's python (torch), ``PYTHONPATH`` holding only ``kvgate/engines/kvcodec``
(kvgate.engines.kvcodec.venv.engine_side_path), and the Mooncake venv's site-packages as an argument
(appended to ``sys.path``: both venvs come from the same base interpreter, the engine venv's
packages win). The store is configured like LMCache's connector by mooncake_store_client.py.

``python kvcodec_store_client.py hold|read MOONCAKE_SITE EXTRA_CONFIG_JSON BLOCK_VALUES``

* ``hold``: capture all-MiniLM-L6-v2's K and V (one 256-token window), put each (layer, kind)
  tensor under ``kv/<kind>/<layer>``; print one JSON line: per key the put's return code, the
  SHA-256 of the tensor's bits, its shape, raw and stored bytes; keep the client (the objects
  live in its segment) until a line on stdin; print ``{"close": rc}``.
* ``read``: read the keys listed on stdin (a JSON list) as raw frames and through
  ``CodecStore.get``; print per key the frame's length, the decoded tensor's bit SHA-256 and
  shape, and ``CodecStore.get`` of an absent key.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import sys
from typing import Any


def digest(t: Any) -> str:
    import torch

    return hashlib.sha256(t.contiguous().view(torch.int16).numpy().tobytes()).hexdigest()


def emit(data: dict[str, Any]) -> None:
    print(json.dumps(data), flush=True)


def main(argv: list[str]) -> int:
    mode, site, extra, block_values = argv[1], argv[2], json.loads(argv[3]), int(argv[4])
    sys.path.append(site)
    from kvgate.engines.kvcodec.store import CodecStore

    # The sibling script (this script's folder is sys.path[0]); it imports mooncake.store.
    raw_store = importlib.import_module("mooncake_store_client").connect(extra)
    store = CodecStore(raw_store, block_values=block_values)
    if mode == "hold":
        from kvgate.engines.kvcodec.measure.realkv import capture

        report = {}
        for name, tensor in capture(windows=1).items():
            key = f"kv/{name}"
            before = store.bytes_stored
            report[key] = {"put": store.put(key, tensor), "sha256": digest(tensor),
                           "shape": list(tensor.shape), "raw": 2 * tensor.numel(),
                           "stored": store.bytes_stored - before}
        emit(report)
        sys.stdin.readline()
    else:
        got = {}
        for key in json.loads(sys.stdin.readline()):
            tensor = store.get(key)
            got[key] = {"len": len(bytes(raw_store.get(key))),
                        "sha256": None if tensor is None else digest(tensor),
                        "shape": None if tensor is None else list(tensor.shape)}
        emit({"got": got, "absent": store.get("kv/absent") is None})
    emit({"close": raw_store.close()})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
