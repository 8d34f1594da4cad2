"""Recently routed prompts, so that a ``BlockStored`` whose parent the index does not know can
still be re-keyed.

Why: kvgate keys blocks with its own chained hash, so a stored block's own hash needs its
parent's own hash. After the index lost an engine's entries (the gateway restarted, batches were
lost, the engine's entries were reset) the engine keeps extending prefixes it still caches — a
hot system prompt is never stored again — and every such event names a parent the index does
not know. Without help those blocks stay unindexed for as long as the prefix stays hot.

How: when the prefix producer dispatches a request (precise mode), it hands the prompt's packed
token ids and own hashes to :meth:`RecentPrompts.add`. An orphan event's first block is looked
up in the recent prompts routed to the same holder, newest first, at block boundaries
(``bytes.find`` on the packed ids). The caller checks a candidate by recomputing the block's own
hash from the candidate parent (so token ids *and* extra keys must agree) before trusting it.

Bounded: at most ``capacity_bytes`` of packed token ids (4 bytes per token) and
``max_prompts`` prompts, all holders together; the oldest prompt is dropped first. A lookup
searches at most the ``SCAN_PROMPTS`` newest prompts of the holder, so an event that no recent
prompt explains (traffic routed by another gateway replica) costs the event loop at most
64 x 40 KB = 2.5 MB of ``bytes.find`` for 10k-token prompts (~1 ms), and in practice it is
rare: once a parent is linked, later events extending it are not orphans.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

#: Newest prompts of a holder searched per lookup (the event follows a request routed moments
#: earlier, so it is almost always among the last few).
SCAN_PROMPTS = 64


class PackingError(ValueError):
    """Token ids outside [0, 2**32)."""


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 (the layout the own hash consumes)."""
    if isinstance(token_ids, array) and token_ids.itemsize == 4 and token_ids.typecode in "IL":
        return token_ids.tobytes() if sys.byteorder == "little" else _swapped(token_ids)
    try:
        return struct.pack(f"<{len(token_ids)}I", *token_ids)
    except struct.error as exc:
        raise PackingError(f"token ids must be in [0, 2**32): {exc}") from None


def _swapped(token_ids: array[int]) -> bytes:
    out = array(token_ids.typecode, token_ids)
    out.byteswap()
    return out.tobytes()


@dataclass(frozen=True, slots=True)
class _Prompt:
    holder: str
    group_idx: int
    block_size: int
    data: bytes  # packed token ids of the full blocks
    hashes: tuple[int, ...]  # own hash of each full block


class RecentPrompts:
    """The last prompts routed to each holder (see the module docstring)."""

    def __init__(self, capacity_bytes: int, max_prompts: int = 1024) -> None:
        if capacity_bytes <= 0 or max_prompts <= 0:
            raise ValueError("capacity must be positive")
        self.capacity_bytes = capacity_bytes
        self.max_prompts = max_prompts
        self._prompts: deque[_Prompt] = deque()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._prompts)

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def add(self, holder: str, group_idx: int, block_size: int, data: bytes,
            hashes: Sequence[int]) -> None:
        """Remember a prompt routed to ``holder``: ``data`` packed ids, ``hashes`` own hashes."""
        data = data[: len(hashes) * 4 * block_size]
        if not hashes or len(data) > self.capacity_bytes:
            return
        self._prompts.append(_Prompt(holder, group_idx, block_size, data, tuple(hashes)))
        self._bytes += len(data)
        while self._bytes > self.capacity_bytes or len(self._prompts) > self.max_prompts:
            self._bytes -= len(self._prompts.popleft().data)

    def candidates(self, holder: str, group_idx: int, block: bytes
                   ) -> Iterator[tuple[tuple[int, ...], int]]:
        """``(hashes, i)`` of recent prompts of ``holder`` whose block ``i`` is ``block``
        (packed ids of one block), newest prompt first."""
        scanned = 0
        for prompt in reversed(self._prompts):
            if prompt.holder != holder or prompt.group_idx != group_idx:
                continue
            scanned += 1
            if scanned > SCAN_PROMPTS:
                return
            width = 4 * prompt.block_size
            if len(block) != width:
                continue
            at = prompt.data.find(block)
            while at >= 0:
                if at % width == 0:
                    yield prompt.hashes, at // width
                at = prompt.data.find(block, at + 1)

    def forget(self, holder: str) -> None:
        """Drop a holder's prompts (its engine left the pool)."""
        kept = deque(p for p in self._prompts if p.holder != holder)
        self._bytes = sum(len(p.data) for p in kept)
        self._prompts = kept
