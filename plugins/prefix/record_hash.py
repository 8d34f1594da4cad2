"""Vectorised chained block hash for the gateway's own prefix record (approximate routing).

The prefix producer's *record* (approximate / auto mode) notes which blocks of which prompts it
routed where. Its keys never meet an engine's (the KV-event index keeps the precise hash of
:mod:`kvgate.plugins.prefix.index.hashing`, which this module does not touch), so the hash is free
to be what is cheapest: a 200 KiB agent prompt is ~51k pseudo-tokens, ~800 blocks of 64, and one
blake2b call per block plus its Python loop cost ~1.5 ms of the gateway's CPU, more than the rest of
its work on the request. Here the whole prompt is hashed with a handful of numpy passes (~0.1 ms).

Algorithm (``record-v1``), for blocks of ``B`` token ids (unsigned 32-bit):

1. *Words.* When ``B`` is even, each pair of ids is one little-endian 64-bit word (a zero-copy
   view of the ids' buffer), else each id is one word: ``W = B/2`` or ``B`` words per block.
2. *Per-word mix.* ``y_j = fmix(w_j XOR K_j)`` with ``K_j`` a fixed pseudo-random 64-bit key of
   the word's position ``j`` in its block (SplitMix64 of ``j``) and ``fmix`` MurmurHash3's 64-bit
   finaliser shortened to one multiply: ``x *= C1; x ^= x >> 32``. XOR, an odd multiply and an
   xor-shift are each bijections of 64-bit words, so two different words at the same position
   never mix to the same ``y``; the position key makes a block's order matter.
3. *Block digest.* ``d_i = fmix64(sum_j y_ij)`` (mod 2**64; the full finaliser spreads the sum's
   bits before chaining).
4. *Chain.* ``h_i = h_{i-1} * M + d_i`` mod 2**64 from ``h_{-1}`` = blake2b-64 of the tag, the
   KV-cache group and the request's scope (LoRA adapter, cache salt, tenant), computed in numpy
   as ``h_i = M^i (h_{-1} M + sum_{k<=i} d_k M^-k)`` (``M`` odd, hence invertible).

Prefix stability: ``d_i`` depends only on block ``i``'s ids and ``h_i`` only on ``h_{i-1}`` and
``d_i``, so prompts that agree on their first ``k`` blocks (and scope) get the same first ``k``
hashes, whatever follows; a block's hash names the whole prefix up to it.

Collisions: the hash is not cryptographic and its keys are public, so a client can craft
colliding prompts; the only effect is a routing preference (the record never grants access
and is scoped by tenant before hashing). For unrelated prompts, distinct blocks differ in at
least one word, whose mixed value differs, and the sum of ~W pseudo-random 64-bit terms then
matches with probability ~2**-64; the chain is injective in ``d_i`` given ``h_{i-1}``. Routing
tolerates far worse: a rare false match only sends a request to an engine that lacks its
prefix, as a miss would.

:func:`reference_chain` is a plain-Python statement of the same algorithm (the tests compare it
with the vectorised one). Pure functions; the memoised tables are bounded (see each).
"""

from __future__ import annotations

import functools
import sys
from array import array
from collections.abc import Sequence
from hashlib import blake2b
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt

from kvgate.plugins.prefix.index.hashing import HashingError

_TAG = b"kvgate-record-v1"
_MASK = (1 << 64) - 1
#: MurmurHash3 fmix64 multipliers (well-studied avalanche constants); ``_M`` chains (odd).
_C1 = 0xFF51AFD7ED558CCD
_C2 = 0xC4CEB9FE1A85EC53
_M = 0x9E3779B97F4A7C15  # 2**64 / golden ratio, odd
_M_INV = pow(_M, -1, 1 << 64)
#: Blocks from which steps 3-4 run in numpy: below, a Python loop (~0.4 us per block) is
#: cheaper than numpy's fixed cost (~20-30 us for the ~10 calls).
_VECTOR_MIN_BLOCKS = 64

U64Array = npt.NDArray[np.uint64]


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


@functools.lru_cache(maxsize=16)
def _position_keys(words: int) -> U64Array:
    """``K_0 .. K_{words-1}`` (one table per words-per-block in use: at most 16 kept)."""
    return np.array([_splitmix64(j) for j in range(words)], dtype=np.uint64)


@functools.lru_cache(maxsize=256)
def root(group_idx: int, scope: tuple[str | None, ...]) -> int:
    """``h_{-1}`` for a KV-cache group and a request scope (at most 256 kept: scopes repeat
    per tenant and salt, and a miss costs ~2 us)."""
    packed = msgpack.packb([group_idx, list(scope)], use_bin_type=True)
    return int.from_bytes(blake2b(_TAG + packed, digest_size=8).digest(), "little")


def _ids(token_ids: Sequence[int] | npt.NDArray[np.uint32],
         count: int) -> npt.NDArray[np.uint32]:
    """The first ``count`` ids as uint32 (zero-copy from an ``array('I')`` or a uint32 array;
    other sequences through an ``array('I')``, which also range-checks them: ~3x faster than
    ``np.asarray`` on a list)."""
    if isinstance(token_ids, np.ndarray) and token_ids.dtype == np.uint32:
        return token_ids[:count]
    if not (isinstance(token_ids, array) and token_ids.itemsize == 4
            and token_ids.typecode in "IL"):
        try:
            token_ids = array("I", token_ids[:count])
        except (OverflowError, TypeError) as exc:
            raise HashingError(f"token ids must be in [0, 2**32): {exc}") from None
    return np.frombuffer(token_ids, dtype=np.uint32, count=count)


def id_bytes(token_ids: Sequence[int] | npt.NDArray[np.uint32], count: int) -> bytes:
    """The first ``count`` ids as native-order uint32 bytes (one copy; range-checked like
    :func:`_ids`): what the chain memo (plugins/prefix/record_chains.py) compares and keeps."""
    if isinstance(token_ids, array) and token_ids.itemsize == 4 and token_ids.typecode in "IL":
        return memoryview(token_ids)[:count].tobytes()
    return _ids(token_ids, count).tobytes()


def _fmix64(x: U64Array) -> U64Array:
    x ^= x >> np.uint64(33)
    x *= np.uint64(_C1)
    x ^= x >> np.uint64(33)
    x *= np.uint64(_C2)
    x ^= x >> np.uint64(33)
    return x


def _words(token_ids: Sequence[int] | npt.NDArray[np.uint32], count: int,
           pair: bool) -> U64Array:
    """The first ``count`` ids as 64-bit words (step 1)."""
    if (pair and sys.byteorder == "little" and isinstance(token_ids, array)
            and token_ids.itemsize == 4 and token_ids.typecode in "IL"):
        return np.frombuffer(token_ids, dtype=np.uint64, count=count // 2)  # zero-copy
    ids = _ids(token_ids, count)
    if pair:  # little-endian pairs on any host
        return ids.astype("<u4", copy=False).view("<u8").astype(np.uint64, copy=False)
    return ids.astype(np.uint64)


def block_sums(token_ids: Sequence[int] | npt.NDArray[np.uint32], block_size: int) -> U64Array:
    """``sum_j y_ij`` of every full block (steps 1-2; :func:`block_digests` adds step 3)."""
    if block_size <= 0:
        raise HashingError(f"block size must be positive, got {block_size}")
    n_blocks = len(token_ids) // block_size
    pair = block_size % 2 == 0
    width = block_size // 2 if pair else block_size
    words = _words(token_ids, n_blocks * block_size, pair)
    y = words.reshape(n_blocks, width) ^ _position_keys(width)  # a new array: mixed in place
    y *= np.uint64(_C1)
    y ^= y >> np.uint64(32)
    sums: U64Array = y.sum(axis=1, dtype=np.uint64)
    return sums


def block_digests(token_ids: Sequence[int], block_size: int) -> U64Array:
    """``d_i`` of every full block (steps 1-3 of the module docstring)."""
    return _fmix64(block_sums(token_ids, block_size))


@functools.lru_cache(maxsize=32)
def _power_table(base: int, count: int) -> U64Array:
    out = np.full(count, base, dtype=np.uint64)
    out[0] = 1
    return np.cumprod(out, dtype=np.uint64)  # wraps modulo 2**64


def _powers(base: int, count: int) -> U64Array:
    """``base**0 .. base**(count-1)`` mod 2**64, from a table whose length is a power of two
    (two bases: at most 32 tables, the largest one per prompt-length octave)."""
    return _power_table(base, 1 << max(0, count - 1).bit_length())[:count]


def chain(token_ids: Sequence[int], block_size: int, *, group_idx: int = 0,
          scope: tuple[str | None, ...] = ()) -> list[int]:
    """The record hashes ``h_0 .. h_{n-1}`` of the full blocks of ``token_ids``."""
    return chain_from(token_ids, block_size, root(group_idx, scope))


def chain_from(token_ids: Sequence[int] | npt.NDArray[np.uint32], block_size: int,
               h: int) -> list[int]:
    """The chain of ``token_ids``'s full blocks continued from ``h`` (``h_{-1}``: the root;
    or the hash of the block before ``token_ids`` to extend a known chain, step 4).

    Below :data:`_VECTOR_MIN_BLOCKS` blocks, steps 3-4 run as a Python loop over the sums
    (numpy's ~20 us of fixed cost per call would dominate a short prompt)."""
    sums = block_sums(token_ids, block_size)
    n = len(sums)
    if n < _VECTOR_MIN_BLOCKS:
        out = []
        for s in sums.tolist():
            h = (h * _M + _fmix64_int(s)) & _MASK
            out.append(h)
        return out
    with np.errstate(over="ignore"):
        acc = np.cumsum(_fmix64(sums) * _powers(_M_INV, n), dtype=np.uint64)
        acc += np.uint64(h * _M & _MASK)
        acc *= _powers(_M, n)
    return acc.tolist()  # type: ignore[no-any-return]


def reference_chain(token_ids: Sequence[int], block_size: int, *, group_idx: int = 0,
                    scope: tuple[str | None, ...] = ()) -> list[int]:
    """:func:`chain` in plain Python, step by step as the module docstring states it."""
    pair = block_size % 2 == 0
    width = block_size // 2 if pair else block_size
    h = root(group_idx, scope)
    out = []
    for start in range(0, len(token_ids) // block_size * block_size, block_size):
        block = [int(t) for t in token_ids[start:start + block_size]]
        total = 0
        for j in range(width):
            w = block[2 * j] | block[2 * j + 1] << 32 if pair else block[j]
            y = ((w ^ _splitmix64(j)) * _C1) & _MASK
            total = (total + (y ^ (y >> 32))) & _MASK
        h = (h * _M + _fmix64_int(total)) & _MASK
        out.append(h)
    return out


def _fmix64_int(x: int) -> int:
    x ^= x >> 33
    x = (x * _C1) & _MASK
    x ^= x >> 33
    x = (x * _C2) & _MASK
    return x ^ (x >> 33)


def scope_of(*parts: Any) -> tuple[str | None, ...]:
    """A scope tuple from optional strings (``None`` kept: position matters)."""
    return tuple(None if p is None else str(p) for p in parts)
