"""A Mooncake Store client configured like LMCache's Mooncake connector; run it with the Mooncake
venv's python (kvgate's venv cannot import ``mooncake``), standard library only.

``python mooncake_store_client.py hold|read EXTRA_CONFIG_JSON KEY NBYTES SEED``

* ``EXTRA_CONFIG_JSON``: the ``extra_config`` mapping of a rendered ``lmcache-<role>-<i>.yaml``.
  It becomes ``store.setup()``'s argument by LMCache 0.5.6's rules (``MooncakeStoreConfig``):
  the legacy keys (``local_hostname``, ``metadata_server``, ``global_segment_size``,
  ``local_buffer_size``, ``protocol``, ``device_name``, ``master_server_address``) pass as they
  are, ``mooncake_<name>`` keys pass as ``<name>`` and win over a legacy key of that name, every
  value becomes a string, defaults fill ``protocol``/``device_name``/sizes; the dict goes to the
  dict ``setup(config)`` overload, or positionally where only that exists.
* ``hold``: put ``NBYTES`` seeded random bytes under ``KEY``; print ``{"put", "is_exist"}`` as
  one JSON line; keep the client (and so the object's memory segment) alive until a line or EOF
  on stdin; print ``{"close"}``.
* ``read``: get ``KEY``; print its length and SHA-256, ``is_exist``, ``batch_is_exist`` of
  ``[KEY, KEY + "-absent"]`` and the length read for the absent key.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import random
import sys
from typing import Any

LEGACY_KEYS = ("local_hostname", "metadata_server", "global_segment_size", "local_buffer_size",
               "protocol", "device_name", "master_server_address")
INT_KEYS = {"global_segment_size", "local_buffer_size"}
PREFIX = "mooncake_"
#: ``mooncake_``-prefixed keys LMCache keeps for itself (never sent to ``setup``).
LMCACHE_ONLY = {"mooncake_transfer_timeout", "mooncake_storage_root_dir",
                "mooncake_prefer_local_alloc"}
DEFAULTS = {"global_segment_size": "3355443200", "local_buffer_size": "1073741824",
            "protocol": "tcp", "device_name": ""}


def setup_config(extra: dict[str, Any]) -> dict[str, str]:
    legacy = {k: str(v) for k, v in extra.items() if k in LEGACY_KEYS and v is not None}
    prefixed = {k[len(PREFIX):]: str(v) for k, v in extra.items()
                if k.startswith(PREFIX) and k != PREFIX and k not in LMCACHE_ONLY
                and v is not None}
    return {**DEFAULTS, **legacy, **prefixed}


def connect(extra: dict[str, Any]) -> Any:
    store = importlib.import_module("mooncake.store").MooncakeDistributedStore()
    config = setup_config(extra)
    try:
        rc = store.setup(config)
    except TypeError:  # a Mooncake without the dict overload
        rc = store.setup(*[int(config.get(k) or 0) if k in INT_KEYS else config.get(k, "")
                           for k in LEGACY_KEYS])
    if rc != 0:
        raise SystemExit(f"store.setup returned {rc} for {config}")
    return store


def emit(data: dict[str, Any]) -> None:
    print(json.dumps(data), flush=True)


def main(argv: list[str]) -> int:
    mode, extra, key, nbytes, seed = argv[1], json.loads(argv[2]), argv[3], int(argv[4]), argv[5]
    store = connect(extra)
    if mode == "hold":
        blob = random.Random(int(seed)).randbytes(nbytes)
        emit({"put": store.put(key, blob), "is_exist": store.is_exist(key)})
        sys.stdin.readline()
    else:
        got = bytes(store.get(key))
        absent = key + "-absent"
        emit({"len": len(got), "sha256": hashlib.sha256(got).hexdigest(),
              "is_exist": store.is_exist(key),
              "batch_is_exist": list(store.batch_is_exist([key, absent])),
              "absent_len": len(bytes(store.get(absent)))})
    emit({"close": store.close()})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
