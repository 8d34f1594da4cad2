"""A block-level prefix cache with reference counts and LRU eviction, like vLLM's.

Blocks hold ``block_size`` tokens. A *full* block is identified by a chained hash: ``h_0 =
H(root, tokens_0)``, ``h_i = H(h_{i-1}, tokens_i)``, where ``root`` derives from the request's
``cache_salt`` (so differently-salted tenants never share blocks). ``H`` is BLAKE2b with an
8-byte digest over the parent hash and the block's token ids (little-endian uint32), read as a
big-endian unsigned 64-bit int — the form vLLM's KV events carry.

Accounting, in blocks (``capacity`` in total):

* *private* blocks: allocated to a running sequence but not (yet) hashed — its partial last
  block, or tokens computed this step and committed right after;
* *cached* blocks: hashed, findable by :meth:`PrefixCache.match`; each has a reference count of
  the running sequences using it. Blocks with count 0 are *evictable* and kept in LRU order;
* free = capacity - private - cached + evictable.

Allocation evicts evictable blocks, least recently released first, only when unallocated space
runs out (what vLLM does). Sequences release their blocks tail first, so a chain is evicted from
its end towards its root and its shared prefix survives longest. Every structure is bounded by
``capacity``; all operations cost O(blocks touched).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

_MASK64 = (1 << 64) - 1


def root_hash(cache_salt: str | None) -> int:
    """Parent hash of a sequence's first block; distinct per ``cache_salt``."""
    data = b"kvgate-sim-root" if cache_salt is None else b"kvgate-sim-salt:" + cache_salt.encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def chain_hash(parent: int, tokens: Sequence[int]) -> int:
    """Hash of one full block given its parent's hash; 64-bit unsigned."""
    data = (parent & _MASK64).to_bytes(8, "big") + struct.pack(f"<{len(tokens)}I", *tokens)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def block_hashes(
    tokens: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    start: Sequence[int] = (),
) -> list[int]:
    """Hashes of every full block of ``tokens``.

    ``start`` may hold the already-known hashes of the first blocks (a previous call's result
    for a prefix of ``tokens``); only the blocks after them are hashed.
    """
    out = list(start)
    parent = out[-1] if out else root_hash(cache_salt)
    for i in range(len(out) * block_size, len(tokens) - block_size + 1, block_size):
        parent = chain_hash(parent, tokens[i : i + block_size])
        out.append(parent)
    return out


@dataclass(frozen=True, slots=True)
class InsertResult:
    """What :meth:`PrefixCache.insert` changed: hashes newly stored, hashes evicted for room."""

    stored: list[int]
    removed: list[int]


class CacheFull(RuntimeError):
    """No room: every block is in use by running sequences."""


class PrefixCache:
    """Block pool with a hash index over full blocks. See the module docstring.

    Parameters:
        capacity_blocks: total blocks (KV memory), ≥ 1.
        block_size: tokens per block, ≥ 1.
    """

    def __init__(self, capacity_blocks: int, block_size: int) -> None:
        if capacity_blocks < 1 or block_size < 1:
            raise ValueError("capacity_blocks and block_size must be >= 1")
        self.capacity = capacity_blocks
        self.block_size = block_size
        self._refs: dict[int, int] = {}  # cached block hash -> running sequences using it
        self._evictable: OrderedDict[int, None] = OrderedDict()  # refs == 0, LRU first
        self._private = 0

    # ---- read-only --------------------------------------------------------------------------

    def __len__(self) -> int:
        """Cached (hashed) blocks, in use or evictable."""
        return len(self._refs)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._refs

    @property
    def used_blocks(self) -> int:
        """Blocks held by running sequences (private + cached with a reference)."""
        return self._private + len(self._refs) - len(self._evictable)

    @property
    def free_blocks(self) -> int:
        """Blocks an allocation can get (unallocated + evictable)."""
        return self.capacity - self.used_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by running sequences (vLLM's ``kv_cache_usage_perc``)."""
        return self.used_blocks / self.capacity

    def match_blocks(self, hashes: Sequence[int]) -> int:
        """How many leading ``hashes`` are cached. Does not touch LRU order."""
        n = 0
        for h in hashes:
            if h not in self._refs:
                break
            n += 1
        return n

    def match(self, tokens: Sequence[int], cache_salt: str | None = None) -> int:
        """Cached tokens of a prompt: the longest cached prefix of its full blocks, in tokens."""
        hashes = block_hashes(tokens, self.block_size, cache_salt)
        return self.match_blocks(hashes) * self.block_size

    # ---- sequences' blocks ------------------------------------------------------------------

    def acquire(self, hashes: Sequence[int]) -> None:
        """Take a reference on cached blocks (a sequence reusing a cached prefix)."""
        for h in hashes:
            refs = self._refs[h]
            if refs == 0:
                del self._evictable[h]
            self._refs[h] = refs + 1

    def allocate(self, n: int) -> list[int]:
        """Reserve ``n`` private blocks, evicting LRU blocks if needed; returns evicted hashes.

        Raises :class:`CacheFull` (and changes nothing) when fewer than ``n`` are free.
        """
        if n <= 0:
            return []
        if n > self.free_blocks:
            raise CacheFull(f"need {n} blocks, {self.free_blocks} free")
        unallocated = self.capacity - self._private - len(self._refs)
        removed = [self._evict_one() for _ in range(max(0, n - unallocated))]
        self._private += n
        return removed

    def commit(self, block_hash: int) -> bool:
        """Turn one private block into the cached block ``block_hash``, referenced once.

        Returns True if the block is new. If another sequence already cached the same content,
        the private block is freed and a reference is taken on the existing one (False).
        """
        if self._private <= 0:
            raise RuntimeError("commit without a private block")
        self._private -= 1
        if block_hash in self._refs:
            self.acquire((block_hash,))
            return False
        self._refs[block_hash] = 1
        return True

    def release(self, hashes: Sequence[int], private: int) -> None:
        """Drop a sequence's references (``hashes`` in chain order) and free its private blocks.

        Blocks left unreferenced become evictable, the chain's tail first in LRU order.
        """
        if private > self._private:
            raise RuntimeError("releasing more private blocks than allocated")
        self._private -= private
        for h in reversed(hashes):
            refs = self._refs[h] - 1
            self._refs[h] = refs
            if refs == 0:
                self._evictable[h] = None

    def insert(self, tokens: Sequence[int], cache_salt: str | None = None) -> InsertResult:
        """Store every full block of ``tokens`` as evictable (a finished sequence's blocks).

        Blocks already cached are refreshed in LRU order; new ones may evict others (never
        ones of ``tokens``). Raises :class:`CacheFull` (changing nothing) without room.
        """
        hashes = block_hashes(tokens, self.block_size, cache_salt)
        existing = [h for h in hashes if h in self._refs]
        self.acquire(existing)  # pinned: the allocation below must not evict them
        new = [h for h in hashes if h not in self._refs]
        try:
            removed = self.allocate(len(new))
        except CacheFull:
            self.release(existing, 0)
            raise
        stored = [h for h in new if self.commit(h)]
        self.release(hashes, 0)
        return InsertResult(stored=stored, removed=removed)

    def clear(self) -> bool:
        """Forget every cached block, if no sequence holds any; returns whether it did."""
        if self.used_blocks:
            return False
        self._refs.clear()
        self._evictable.clear()
        return True

    def evictable_order(self) -> Iterable[int]:
        """Evictable hashes, next victim first (for tests and debugging)."""
        return iter(self._evictable)

    def _evict_one(self) -> int:
        victim, _ = self._evictable.popitem(last=False)
        del self._refs[victim]
        return victim
