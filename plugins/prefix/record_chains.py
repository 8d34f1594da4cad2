"""Recent prompts' block-hash chains, so that a session's next turn hashes only what it added.

An agent's turn N+1 sends turn N's whole conversation again plus a little: a 200 KiB prompt
whose first ~99 % was hashed a moment ago. This memo keeps, for recent prompts, their full-block
token ids and their chain, and computes a new prompt's chain from the remembered prompt it
shares the most whole blocks with, hashing only the blocks after them, continuing the chain
from the last common block's hash (each hash depends only on its parent and its block). Two
chains: the gateway's record hash (:mod:`kvgate.plugins.prefix.record_hash`, :data:`RECORD`)
and the KV-event index's hash in the engines' block layout with vLLM's extra keys
(:mod:`kvgate.plugins.prefix.index.hashing`, :data:`EVENTS`). The result is the list the hash
function computes on the whole prompt, whatever the memo holds (the tests compare them).

Finding the remembered prompt:

1. **By its last blocks.** Every prompt is indexed under ``(j, the ids of its block j-1)`` for
   its last :data:`TAIL_KEYS` whole-block prefixes ``j = n, n-1``. A new prompt of ``n'``
   blocks probes ``j = n', n'-1, ...`` (at most :data:`MAX_PROBES`) with its own block
   ``j-1``; a hit is checked with one ``memcmp`` (the remembered ids' first ``j`` blocks must
   be the new prompt's). This finds the previous turn of the *same* session even when hundreds
   of sessions share a system prompt (the old single slot per first block went to whichever
   session ran last, and the others were rehashed from just after the system prompt), and
   even when the previous turn's last block differs (its generation prompt is tokenized again
   with the reply after it). The new prompt then **supersedes** the one it continues (one
   entry per session, its latest turn).
2. **By its first block** (one slot per first block, last one in wins): prompts that diverge
   (an edit, a shorter retry) are compared in numpy to find where, and share what agrees.

Keys include ``(group, scope, block size)``: the scope (LoRA adapter, cache salt, tenant for the
record) is part of the key, so one tenant's prompts are never compared with another's.

Bounded: at most ``max_bytes`` of remembered ids and hashes (4 bytes per token id, ~40 per
hash), least recently used first out (``evicted``); a prompt larger than a quarter of the bound
is not kept.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from kvgate.plugins.prefix import record_hash
from kvgate.plugins.prefix.index import hashing as kv_hashing

#: Bytes a remembered hash costs (a Python int in a list: 32 B object + 8 B pointer).
_HASH_BYTES = 40
#: Bytes per remembered token id (uint32).
_ID_BYTES = 4
#: Default bound: ~160 agent prompts of 200 KiB (one per concurrent session of a busy replica).
DEFAULT_MAX_BYTES = 32 * 1024 * 1024
#: Blocks a new prompt may have beyond the remembered one it extends (probes by last block):
#: 1,024 blocks is 16k tokens at block size 16 (a large tool output), ~0.3 ms of probing when
#: nothing is found.
MAX_PROBES = 1024
#: A prompt is indexed by its last this many whole-block prefixes: the next turn of a chat
#: re-tokenizes the previous one's generation prompt (``...assistant<|end_header_id|>\n\n``)
#: together with the reply that follows it, so its last few ids, hence its last block, may
#: differ from the previous prompt's while everything before agrees.
TAIL_KEYS = 2

Scope = tuple[str | None, ...]
_Key = tuple[int, Scope, int, bytes]
_TailKey = tuple[int, Scope, int, int, bytes]
U32Array = npt.NDArray[np.uint32]
#: Token ids as native uint32 bytes (a name the class's ``bytes`` property does not shadow).
Raw = bytes


class ChainHash(Protocol):
    """A chained block hash: the root of a chain, and a chain continued over some blocks."""

    def root(self, group_idx: int, scope: Scope) -> int: ...

    def chain_from(self, ids: U32Array, block_size: int, parent: int, first_block: int,
                   group_idx: int, scope: Scope) -> list[int]: ...


class _RecordHash:
    """:mod:`kvgate.plugins.prefix.record_hash` (the scope is hashed into the root)."""

    def root(self, group_idx: int, scope: Scope) -> int:
        return record_hash.root(group_idx, scope)

    def chain_from(self, ids: U32Array, block_size: int, parent: int, first_block: int,
                   group_idx: int, scope: Scope) -> list[int]:
        return record_hash.chain_from(ids, block_size, parent)


class _EventHash:
    """:mod:`kvgate.plugins.prefix.index.hashing` with vLLM's extra keys; scope
    ``(lora, cache_salt)``: the adapter's name on every block, the salt on the first only."""

    def root(self, group_idx: int, scope: Scope) -> int:
        return kv_hashing.root_hash(group_idx)

    def chain_from(self, ids: U32Array, block_size: int, parent: int, first_block: int,
                   group_idx: int, scope: Scope) -> list[int]:
        lora, salt = (*scope, None, None)[:2]
        n = len(ids) // block_size
        extra = None
        if lora or salt:
            extra = kv_hashing.request_extra_keys(first_block + n, lora, salt)[first_block:]
        packed = array("I")
        packed.frombytes(ids.tobytes())
        return kv_hashing.chain_hashes(packed, block_size, parent=parent, group_idx=group_idx,
                                       extra_keys=extra)


RECORD: ChainHash = _RecordHash()
EVENTS: ChainHash = _EventHash()


@dataclass(slots=True)
class ChainMemoStats:
    """Counters (monotonic): lookups that found a prompt with a common prefix, that did not;
    blocks whose hash was reused or computed; prompts evicted by the bound, replaced by their
    session's next turn. ``bytes``: held now."""

    hits: int = 0
    misses: int = 0
    reused_blocks: int = 0
    hashed_blocks: int = 0
    evicted: int = 0
    superseded: int = 0
    bytes: int = 0


@dataclass(slots=True)
class _Entry:
    #: The prompt's full-block ids as native uint32 bytes (:func:`record_hash.id_bytes`).
    ids: bytes
    hashes: list[int]
    first: _Key
    last: tuple[_TailKey, ...]

    @property
    def size(self) -> int:
        return len(self.ids) + _HASH_BYTES * len(self.hashes)


class ChainMemo:
    """LRU of recent prompts' chains (see the module docstring); ``hasher``: :data:`RECORD`
    (default) or :data:`EVENTS`."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, hasher: ChainHash = RECORD) -> None:
        self.max_bytes = max_bytes
        self.hasher = hasher
        self.stats = ChainMemoStats()
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._first: dict[_Key, int] = {}
        #: Remembered prompts per first block: none, and no prompt can be a prefix (no probing).
        self._sharing: dict[_Key, int] = {}
        self._last: dict[_TailKey, int] = {}
        self._next = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self.stats.bytes

    def chain(self, token_ids: Sequence[int], block_size: int, *, group_idx: int = 0,
              scope: Scope = ()) -> list[int]:
        """The chain of ``token_ids``'s full blocks, reusing a recent prompt's."""
        n_blocks = len(token_ids) // block_size
        hasher = self.hasher
        if n_blocks == 0 or self.max_bytes <= 0:
            raw0 = record_hash.id_bytes(token_ids, n_blocks * block_size)
            return hasher.chain_from(_view(raw0), block_size, hasher.root(group_idx, scope), 0,
                                     group_idx, scope) if n_blocks else []
        raw = record_hash.id_bytes(token_ids, n_blocks * block_size)
        width = _ID_BYTES * block_size
        first: _Key = (group_idx, scope, block_size, raw[:width])
        last = tuple((group_idx, scope, block_size, j, raw[(j - 1) * width:j * width])
                     for j in range(n_blocks, max(0, n_blocks - TAIL_KEYS), -1))
        found, common = self._find(raw, first, width, n_blocks)
        stats = self.stats
        if found is None:
            stats.misses += 1
            hashes = hasher.chain_from(_view(raw), block_size, hasher.root(group_idx, scope), 0,
                                       group_idx, scope)
        else:
            entry = self._entries[found]
            stats.hits += 1
            if common == n_blocks == len(entry.hashes):  # the same full blocks again
                stats.reused_blocks += common
                self._entries.move_to_end(found)
                return list(entry.hashes)
            h = entry.hashes[common - 1] if common else hasher.root(group_idx, scope)
            tail = hasher.chain_from(_view(raw)[common * block_size:], block_size, h, common,
                                     group_idx, scope)
            hashes = entry.hashes[:common] + tail
            if common >= len(entry.hashes) + 1 - TAIL_KEYS:  # the session's next turn
                self._drop(found)
                stats.superseded += 1
        stats.reused_blocks += common
        stats.hashed_blocks += n_blocks - common
        self._keep(_Entry(raw, hashes, first, last))
        return list(hashes)

    def _find(self, raw: Raw, first: _Key, width: int, n_blocks: int) -> tuple[int | None, int]:
        """The remembered prompt to continue and the whole blocks it shares with ``raw``."""
        if first not in self._sharing:  # a new first block: nothing remembered starts like it
            return None, 0
        group, scope, size, _ = first
        get = self._last.get
        for j in range(n_blocks, max(0, n_blocks - MAX_PROBES), -1):
            found = get((group, scope, size, j, raw[(j - 1) * width:j * width]))
            if found is None:
                continue
            ids = self._entries[found].ids
            if raw.startswith(ids) if len(ids) == j * width else raw[:j * width] == ids[:j * width]:
                return found, j
        found = self._first.get(first)
        if found is None:
            return None, 0
        return found, _common_blocks(self._entries[found].ids, raw, size)

    def _keep(self, entry: _Entry) -> None:
        if entry.size > self.max_bytes // 4:
            return
        key = self._next
        self._next += 1
        old = self._last.get(entry.last[0])
        if old is not None:  # the same blocks again, or a prompt ending like it: replaced
            self._drop(old)
        self._first[entry.first] = key  # last one in wins; the previous stays findable by its end
        self._sharing[entry.first] = self._sharing.get(entry.first, 0) + 1
        for tail in entry.last:
            self._last[tail] = key
        self._entries[key] = entry
        self.stats.bytes += entry.size
        while self.stats.bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
            self.stats.evicted += 1

    def _drop(self, key: int) -> None:
        """Forget entry ``key`` (and its index slots, where they still name it)."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        self.stats.bytes -= entry.size
        if self._first.get(entry.first) == key:
            del self._first[entry.first]
        left = self._sharing.pop(entry.first) - 1
        if left:
            self._sharing[entry.first] = left
        for tail in entry.last:
            if self._last.get(tail) == key:
                del self._last[tail]


def _view(raw: bytes) -> U32Array:
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
