"""kvgate's own deterministic chained block hash (see :mod:`plugins.kv_index` for why).

``h_i = blake2b-64(h_{i-1} || n_i || tokens_i || extra_i)`` with ``tokens_i`` the block's token
ids as little-endian uint32, ``n_i`` their count and ``extra_i`` the block's extra keys packed
with msgpack; ``h_{-1} = blake2b-64("kvgate-kv-v1", group_idx)``. Pure functions, no state.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from hashlib import blake2b
from typing import Any

import msgpack

_ROOT_TAG = b"kvgate-kv-v1"

ExtraKeys = tuple[Any, ...] | None


class HashingError(ValueError):
    """Token ids or extra keys that cannot be hashed (negative or >= 2**32 ids, odd types)."""



def root_hash(group_idx: int) -> int:
    digest = blake2b(_ROOT_TAG + group_idx.to_bytes(4, "little", signed=True), digest_size=8)
    return int.from_bytes(digest.digest(), "little")


def request_extra_keys(n_blocks: int, lora: str | None, cache_salt: str | None) -> list[ExtraKeys]:
    """The extra keys vLLM attaches to a text prompt's blocks: LoRA name on every block, then
    ``cache_salt`` on the first block only (``None`` for a block without any)."""
    base: tuple[Any, ...] = (lora,) if lora else ()
    out: list[ExtraKeys] = [base or None] * n_blocks
    if n_blocks and cache_salt:
        out[0] = (*base, cache_salt)
    return out


def chain_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    parent: int | None = None,
    group_idx: int = 0,
    extra_keys: Sequence[ExtraKeys] | None = None,
) -> list[int]:
    """Own hashes of the full blocks of ``token_ids`` (see the module docstring).

    ``parent`` continues an existing chain (default: the group's root). ``extra_keys`` gives one
    entry per block (missing entries count as ``None``).
    """
    if block_size <= 0:
        raise HashingError(f"block size must be positive, got {block_size}")
    n_blocks = len(token_ids) // block_size
    try:
        data = struct.pack(f"<{n_blocks * block_size}I", *token_ids[: n_blocks * block_size])
    except struct.error as exc:
        raise HashingError(f"token ids must be in [0, 2**32): {exc}") from None
    prev = (root_hash(group_idx) if parent is None else parent).to_bytes(8, "little")
    width = 4 * block_size
    count = block_size.to_bytes(4, "little")
    out: list[int] = []
    for i in range(n_blocks):  # one blake2b call per block: ~1 us, the cost of this function
        extra = extra_keys[i] if extra_keys is not None and i < len(extra_keys) else None
        tail = _pack_extra(extra) if extra else b""
        prev = blake2b(prev + count + data[i * width : (i + 1) * width] + tail,
                       digest_size=8).digest()
        out.append(int.from_bytes(prev, "little"))
    return out


def _pack_extra(extra: tuple[Any, ...]) -> bytes:
    try:
        packed: bytes = msgpack.packb(list(extra), use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise HashingError(f"extra keys cannot be hashed: {exc}") from None
    return packed
