"""kvgate's own deterministic chained block hash (see :mod:`kvgate.plugins.prefix.index.index` for
why).

Version ``kvgate-kv-v2``: block ``i`` digests to ``d_i = blake2b-64(tokens_i || extra_i)``
(``tokens_i`` the block's ids as little-endian uint32, ``extra_i`` its extra keys packed with
msgpack, if any; read as a little-endian uint64), and the chain is, modulo 2**64,

    ``h_i = h_{i-1} * M + d_i``,  ``h_{-1} = blake2b-64("kvgate-kv-v2", group_idx)``,

with ``M`` a fixed odd multiplier. Why this shape: v1 hashed the parent into each block
(``blake2b(h_{i-1} || block)``), which forces one Python step per block with byte
concatenation; an agent prompt of 200 KB is ~800 blocks of 64 pseudo-tokens and that loop cost
more than the rest of the gateway's work on it. Here the digests are independent (one C call per
block on a zero-copy view of the ids) and the chain is a polynomial: for long prompts it is
computed in numpy as ``h_i = M^i * (h_{-1} * M + cumsum_j(d_j * M^-j))`` (``M^-1`` is ``M``'s
inverse modulo 2**64; ``M`` odd), for short ones in a plain loop; both give the same integers.

The values are routing keys of the gateway's own index (never the engine's, never used for
access control): two distinct prefixes collide with probability ~2**-64 per pair (the digests
are uniform and the chain is injective in the last digest given the parent). Pure functions;
the memoised tables below are bounded.
"""

from __future__ import annotations

import functools
import struct
import sys
from array import array
from collections.abc import Sequence
from hashlib import blake2b
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt

_ROOT_TAG = b"kvgate-kv-v2"
_MASK = (1 << 64) - 1
#: The chain's multiplier (odd, so invertible modulo 2**64; MurmurHash3's fmix64 constant) and
#: its inverse.
_M = 0xFF51AFD7ED558CCD
_M_INV = pow(_M, -1, 1 << 64)
#: Blocks from which the chain is computed in numpy (below, a Python loop is cheaper: numpy's
#: fixed cost is ~20 us, the loop's ~0.15 us per block).
_VECTOR_MIN_BLOCKS = 128

_U64_LE = struct.Struct("<Q")

ExtraKeys = tuple[Any, ...] | None
U64Array = npt.NDArray[np.uint64]


class HashingError(ValueError):
    """Token ids or extra keys that cannot be hashed (negative or >= 2**32 ids, odd types)."""


@functools.lru_cache(maxsize=64)
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


def token_bytes(token_ids: Sequence[int], count: int) -> memoryview:
    """The first ``count`` ids as little-endian uint32 bytes (zero-copy from an ``array('I')``
    on a little-endian host); HashingError for ids outside [0, 2**32)."""
    if isinstance(token_ids, array) and token_ids.itemsize == 4 and token_ids.typecode in "IL":
        packed = token_ids
    else:
        try:
            packed = array("I", token_ids[:count])
        except (OverflowError, TypeError) as exc:
            raise HashingError(f"token ids must be in [0, 2**32): {exc}") from None
    if sys.byteorder == "big":
        packed = array(packed.typecode, packed[:count])
        packed.byteswap()
    return memoryview(packed).cast("B")[: 4 * count]


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
    if n_blocks == 0:
        return []
    digests = _digests(token_bytes(token_ids, n_blocks * block_size), 4 * block_size,
                       n_blocks, extra_keys)
    start = root_hash(group_idx) if parent is None else parent
    if n_blocks < _VECTOR_MIN_BLOCKS:
        return _chain_loop(digests, start)
    return _chain_vector(digests, start)


def _digests(data: memoryview, width: int, n_blocks: int,
             extra_keys: Sequence[ExtraKeys] | None) -> bytes:
    """The blocks' blake2b-64 digests, concatenated (8 bytes each)."""
    if not extra_keys:
        return b"".join([blake2b(data[i : i + width], digest_size=8).digest()
                         for i in range(0, n_blocks * width, width)])
    out = []
    for i in range(n_blocks):
        extra = extra_keys[i] if i < len(extra_keys) else None
        h = blake2b(data[i * width : (i + 1) * width], digest_size=8)
        if extra:
            h.update(_pack_extra(extra))
        out.append(h.digest())
    return b"".join(out)


def _chain_loop(digests: bytes, start: int) -> list[int]:
    out = []
    h = start
    for (d,) in _U64_LE.iter_unpack(digests):
        h = (h * _M + d) & _MASK
        out.append(h)
    return out


def _chain_vector(digests: bytes, start: int) -> list[int]:
    d = np.frombuffer(digests, dtype="<u8").astype(np.uint64)
    n = len(d)
    scaled = np.cumsum(d * _powers(_M_INV, n), dtype=np.uint64)
    scaled += np.uint64(start * _M & _MASK)
    scaled *= _powers(_M, n)
    return scaled.tolist()  # type: ignore[no-any-return]


@functools.lru_cache(maxsize=32)
def _power_table(base: int, count: int) -> U64Array:
    out = np.full(count, base, dtype=np.uint64)
    out[0] = 1
    return np.cumprod(out, dtype=np.uint64)  # numpy wraps uint64 products modulo 2**64


def _powers(base: int, count: int) -> U64Array:
    """``base**0 .. base**(count-1)`` modulo 2**64, sliced from a memoised table whose length
    is a power of two (two bases, at most 32 tables: bounded)."""
    return _power_table(base, 1 << (count - 1).bit_length())[:count]


def _pack_extra(extra: tuple[Any, ...]) -> bytes:
    try:
        packed: bytes = msgpack.packb(list(extra), use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise HashingError(f"extra keys cannot be hashed: {exc}") from None
    return packed
