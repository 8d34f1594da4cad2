"""Recent prompts' record chains, so that a session's next turn hashes only what it added.

An agent's turn N+1 sends turn N's whole conversation again plus a little: a 200 KiB prompt
whose first ~99 % was hashed (:func:`kvgate.plugins.prefix.record_hash.chain`) a moment ago. This
memo keeps, for recent prompts, their full-block token ids and their chain; a new prompt is compared
with the remembered prompt that starts with the same first block (same scope, block size and KV
group), and only the blocks after their common whole blocks are hashed, continuing the chain
from the last common block's hash (step 4 of the record hash: ``h_i`` depends only on
``h_{i-1}`` and block ``i``). The result is the same list
:func:`~kvgate.plugins.prefix.record_hash.chain` returns, whatever the memo holds (the tests compare
them).

Cost of a hit: the new ids' bytes (one copy) and a ``memcmp`` of the two prompts' ids when one
extends the other (an agent's next turn, a repeated prompt: no numpy call, which matters for
short prompts, where numpy's fixed cost per call dominates), else one numpy comparison to find
where they diverge (~20 us for 50k ids); instead of the ~5 numpy passes over them (block sums)
that hashing takes.

Keys: ``(group, scope, block size, first block's ids)``: the scope (LoRA adapter, cache salt,
tenant) is part of the key, so one tenant's prompts are never compared with another's. Sessions
that share their first block (one system prompt) share one slot: the last prompt wins it, and a
session whose slot was taken is hashed whole, as without the memo.

Bounded: at most ``max_bytes`` of remembered ids and hashes (4 bytes per token id, ~40 per
hash), least recently used first out; a prompt larger than a quarter of the bound is not kept.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvgate.plugins.prefix import record_hash

#: Bytes a remembered hash costs (a Python int in a list: 32 B object + 8 B pointer).
_HASH_BYTES = 40
#: Bytes per remembered token id (uint32).
_ID_BYTES = 4
#: Default bound: ~160 agent prompts of 200 KiB (one per concurrent session of a busy replica).
DEFAULT_MAX_BYTES = 32 * 1024 * 1024

_Key = tuple[int, tuple[str | None, ...], int, bytes]


@dataclass(slots=True)
class ChainMemoStats:
    """Counters (monotonic): lookups that found a prompt with a common prefix, that did not;
    blocks whose hash was reused or computed; prompts evicted by the bound."""

    hits: int = 0
    misses: int = 0
    reused_blocks: int = 0
    hashed_blocks: int = 0
    evicted: int = 0


@dataclass(slots=True)
class _Entry:
    #: The prompt's full-block ids as native uint32 bytes (:func:`record_hash.id_bytes`).
    ids: bytes
    hashes: list[int]

    @property
    def size(self) -> int:
        return len(self.ids) + _HASH_BYTES * len(self.hashes)


class ChainMemo:
    """LRU of recent prompts' record chains (see the module docstring)."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self.stats = ChainMemoStats()
        self._entries: OrderedDict[_Key, _Entry] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._bytes

    def chain(self, token_ids: Sequence[int], block_size: int, *, group_idx: int = 0,
              scope: tuple[str | None, ...] = ()) -> list[int]:
        """:func:`kvgate.plugins.prefix.record_hash.chain` of ``token_ids``, reusing a recent
        prompt's."""
        n_blocks = len(token_ids) // block_size
        if n_blocks == 0 or self.max_bytes <= 0:
            return record_hash.chain(token_ids, block_size, group_idx=group_idx, scope=scope)
        raw = record_hash.id_bytes(token_ids, n_blocks * block_size)
        key = (group_idx, scope, block_size, raw[:_ID_BYTES * block_size])
        entry = self._entries.get(key)
        common = 0 if entry is None else _common_blocks(entry.ids, raw, block_size)
        if entry is None:
            self.stats.misses += 1
            hashes = record_hash.chain_from(_view(raw), block_size,
                                            record_hash.root(group_idx, scope))
        elif common == n_blocks == len(entry.hashes):  # the same full blocks again
            self.stats.hits += 1
            self.stats.reused_blocks += common
            self._entries.move_to_end(key)
            return list(entry.hashes)
        else:
            self.stats.hits += 1
            h = entry.hashes[common - 1] if common else record_hash.root(group_idx, scope)
            tail = record_hash.chain_from(_view(raw)[common * block_size:], block_size, h)
            hashes = entry.hashes[:common] + tail
        self.stats.reused_blocks += common
        self.stats.hashed_blocks += n_blocks - common
        self._keep(key, _Entry(raw, hashes))
        return list(hashes)

    def _keep(self, key: _Key, entry: _Entry) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= old.size
        if entry.size > self.max_bytes // 4:
            return
        self._entries[key] = entry
        self._bytes += entry.size
        while self._bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= evicted.size
            self.stats.evicted += 1


def _view(raw: bytes) -> npt.NDArray[np.uint32]:
    return np.frombuffer(raw, dtype=np.uint32)


def _common_blocks(old: bytes, new: bytes, block_size: int) -> int:
    """Whole blocks both id byte strings start with. A prompt that extends (or repeats) the
    remembered one, an agent's next turn, is one ``memcmp`` (``startswith``: no copy, no
    numpy call); prompts that diverge are compared in numpy to find where."""
    width = _ID_BYTES * block_size
    if new.startswith(old) or old.startswith(new):
        return min(len(old), len(new)) // width
    length = min(len(old), len(new)) // _ID_BYTES
    same = _view(old)[:length] == _view(new)[:length]
    return int(np.argmin(same)) // block_size
