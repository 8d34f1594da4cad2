# mypy: ignore-errors
"""Writes ``vllm_salt_fixture.json``: what vLLM 0.32 itself does with ``cache_salt``, for
``test_cache_salt.py`` to check kvgate's hashing against. Run in the engine venv (it imports
vllm; ``engines/local/paths.py`` ``engine_python()``)::

    ~/.cache/kvgate/engine-venv/bin/python tests/unit/plugins/make_vllm_salt_fixture.py

Per case (salt, LoRA adapter): the untagged extra keys vLLM publishes in ``BlockStored`` for each
block (``generate_block_hash_extra_keys`` then ``to_event_extra_keys``, as
``BlockPool.cache_full_blocks`` does), and vLLM's own block hashes (sha256), to show which
blocks a salt changes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_utils as kcu
from vllm.v1.request import Request

BLOCK = 16
TOKENS = list(range(1000, 1000 + 3 * BLOCK + 5))  # three full blocks and a partial one
CASES = [(None, None), ("kvg1.tenant-a", None), ("kvg1.tenant-b", None), ("kvg1.tenant-a", "ad1")]


def _request(salt: str | None, lora: str | None) -> Request:
    lora_req = None if lora is None else LoRARequest(lora, 1, "/adapters/" + lora)
    return Request("r", TOKENS, SamplingParams(max_tokens=1), None, cache_salt=salt,
                   lora_request=lora_req, block_hasher=kcu.get_request_block_hasher(BLOCK, sha256))


def main() -> None:
    kcu.init_none_hash(sha256)
    out = {"vllm": __import__("vllm").__version__, "block_size": BLOCK, "tokens": TOKENS,
           "cases": []}
    for salt, lora in CASES:
        req = _request(salt, lora)
        keys = [kcu.generate_block_hash_extra_keys(req, i * BLOCK, (i + 1) * BLOCK, 0)[0]
                for i in range(len(TOKENS) // BLOCK)]
        out["cases"].append({
            "cache_salt": salt, "lora": lora,
            "event_extra_keys": kcu.to_event_extra_keys(keys),
            "block_hashes": [bytes(h).hex() for h in req.block_hashes],
        })
    path = Path(__file__).with_name("vllm_salt_fixture.json")
    path.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    print(path, file=sys.stderr)


if __name__ == "__main__":
    main()
