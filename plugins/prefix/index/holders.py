"""The KV index's storage: per-holder LRU maps of held blocks, bounded (:class:`HolderTable`).

:class:`kvgate.plugins.prefix.index.index.KvIndex` is a :class:`HolderTable`; this module holds what
does not depend on how blocks are matched or learnt: the holder key helpers, the tier bits, one hold
(:class:`Hold`), one holder's maps (:class:`Holder`), the index counters (:class:`IndexStats`)
and the bounds with their eviction. Hashing, matching, event updates, records and orphans are
in :mod:`kvgate.plugins.prefix.index.index`.

Holders
    A *holder* is one KV cache: an engine id, or ``"<engine>#dp<r>"`` for data-parallel rank
    ``r > 0`` (each rank has its own cache). Per holder the table keeps an LRU-ordered map
    own-hash -> :class:`Hold` (tiers held as a bit set, the engine's hash for removals, an
    expiry time) and a map (group, engine-hash) -> own-hash to resolve removals and parent
    links, plus the block size it uses per KV-cache group.

Bounds and eviction
    ``capacity_blocks`` bounds the total number of (holder, block) pairs. When it is exceeded the
    least recently used block of the *largest* holder is dropped, so one busy engine cannot push
    the others' entries out. ``holder_capacity_blocks`` (optional) bounds each holder on its own,
    which lets the approximate mode mirror an engine's LRU cache; :meth:`HolderTable.set_capacity`
    overrides it for one holder (an engine whose KV capacity is known).

Change stamps
    Each holder carries two stamps drawn from one counter of the table (so a holder created
    anew never repeats an old one): ``epoch`` changes whenever a held block is dropped (any
    cause), loses its device bit or its engine hash, or gains the learnt bit; ``gains`` whenever
    a held block gains the device bit or an engine hash, or loses the learnt bit. Expiries only
    grow while a block is held. :mod:`kvgate.plugins.prefix.index.resume` resumes a walk of a
    prompt from where the last one stopped while they say nothing it relied on changed.

Nothing here does I/O; single-threaded (owned by the event loop).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "DEVICE", "DEVICE_MEDIA", "LEARNED", "NEVER", "OTHER", "EngineHash", "Hold", "Holder",
    "HolderId", "HolderTable", "IndexStats", "engine_of", "holder_id", "tier_of",
]

#: Tier bits of a hold.
DEVICE = 1
OTHER = 2
#: Not a tier: set on record entries learnt from an engine's reported cached tokens (no event
#: announced those blocks); cleared when an event does.
LEARNED = 4
#: ``medium`` values that mean device (accelerator) memory; vLLM reports "GPU" (also on CPU
#: builds), and older engines omit the field, which vLLM documents as GPU.
DEVICE_MEDIA = frozenset({"GPU", None})
#: The expiry of a hold known from an event (it never expires).
NEVER = math.inf

HolderId = str
EngineHash = int | bytes


def holder_id(engine: str, dp_rank: int | None) -> HolderId:
    """The holder key of an engine's data-parallel rank (rank 0 and unknown: the engine id)."""
    return engine if not dp_rank else f"{engine}#dp{dp_rank}"


def engine_of(holder: HolderId) -> str:
    """The engine id of a holder key."""
    return holder.partition("#")[0]


def tier_of(medium: str | None) -> int:
    return DEVICE if medium in DEVICE_MEDIA else OTHER


class Hold:
    """One holder's copy of one block."""

    __slots__ = ("ekey", "expires", "tiers")

    def __init__(self, tiers: int, expires: float, ekey: tuple[int, EngineHash] | None) -> None:
        self.tiers = tiers
        self.expires = expires
        #: (group, engine hash) when the block is known from an event; None for records.
        self.ekey = ekey


class Holder:
    """One holder's maps (module docstring, "Holders"), and its change stamps ("Change
    stamps")."""

    __slots__ = ("block_sizes", "blocks", "by_ehash", "epoch", "gains", "last_chain")

    def __init__(self, stamp: int = 0) -> None:
        #: Set from the table's stamp counter on every change that can shorten a walk's
        #: result over blocks already held (``epoch``) or lengthen one (``gains``).
        self.epoch = stamp
        self.gains = stamp
        self.blocks: OrderedDict[int, Hold] = OrderedDict()
        self.by_ehash: dict[tuple[int, EngineHash], int] = {}
        self.block_sizes: dict[int, int] = {}
        #: prefix-closed mode: the chain the last record left at the LRU end, tail to root,
        #: while no block has been dropped since (None otherwise).
        self.last_chain: list[int] | None = None


@dataclass(slots=True)
class IndexStats:
    """Counters (monotonic) of an index."""

    stored_blocks: int = 0
    removed_blocks: int = 0
    orphan_blocks: int = 0  # stored blocks whose parent the index does not know
    resolved_orphans: int = 0  # events whose unknown parent a recent prompt supplied
    #: blocks of token-less BlockStored events filed by a hash the index knew (store_known)
    tokenless_blocks: int = 0
    #: blocks of token-less BlockStored events whose hash the index did not know (not indexed:
    #: without tokens kvgate cannot derive its own hash; not malformed either)
    tokenless_unknown: int = 0
    unknown_removals: int = 0
    evicted_blocks: int = 0
    expired_blocks: int = 0
    resets: int = 0
    #: blocks an engine's reported cached_tokens said it held
    #: (kvgate.plugins.prefix.producer._learn)
    learned_blocks: int = 0
    #: speculative or learnt entries dropped because the engine reported holding less
    unlearned_blocks: int = 0


class HolderTable:
    """Every holder's blocks, bounded (module docstring). The parameters are
    :class:`kvgate.plugins.prefix.index.index.KvIndex`'s of the same names."""

    def __init__(
        self, capacity_blocks: int, holder_capacity_blocks: int | None, default_block_size: int,
    ) -> None:
        if capacity_blocks <= 0 or default_block_size <= 0:
            raise ValueError("capacity and block size must be positive")
        self.capacity_blocks = capacity_blocks
        self.holder_capacity_blocks = holder_capacity_blocks
        self.default_block_size = default_block_size
        self.stats = IndexStats()
        self._holders: dict[HolderId, Holder] = {}
        #: The holder keys of each engine (one per data-parallel rank that has held blocks),
        #: kept with ``_holders``: a request matches its candidates' holders only.
        self._by_engine: dict[str, list[HolderId]] = {}
        self._caps: dict[HolderId, int] = {}  # per-holder bounds overriding the default
        self._size = 0
        self._stamp = 0  # the holders' change stamps (module docstring)

    # -- reading ------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._size

    def holders(self) -> tuple[HolderId, ...]:
        return tuple(self._holders)

    def holders_of(self, engines: Iterable[str]) -> list[HolderId]:
        """The holders of ``engines`` (every rank of each; none for an engine with none)."""
        by_engine = self._by_engine
        return [h for engine in engines for h in by_engine.get(engine, ())]

    def blocks_of(self, holder: HolderId) -> int:
        h = self._holders.get(holder)
        return 0 if h is None else len(h.blocks)

    def block_size(self, holder: HolderId, group_idx: int = 0) -> int:
        h = self._holders.get(holder)
        size = None if h is None else h.block_sizes.get(group_idx)
        return self.default_block_size if size is None else size

    def block_sizes(self, group_idx: int = 0) -> frozenset[int]:
        """Block sizes the holders use for ``group_idx`` (holders that have reported none use
        the default)."""
        return frozenset(
            h.block_sizes.get(group_idx, self.default_block_size) for h in self._holders.values()
        )

    # -- holders and bounds -------------------------------------------------------------
    def reset(self, holder_key: HolderId) -> int:
        """Forget everything a holder had (engine restart, lost events, cache cleared)."""
        holder = self._holders.pop(holder_key, None)
        if holder is None:
            return 0
        engine = engine_of(holder_key)
        keys = self._by_engine[engine]
        keys.remove(holder_key)
        if not keys:
            del self._by_engine[engine]
        self._size -= len(holder.blocks)
        self.stats.resets += 1
        return len(holder.blocks)

    def set_capacity(self, holder_key: HolderId, blocks: int | None) -> None:
        """Bound ``holder`` to ``blocks`` (None: back to ``holder_capacity_blocks``); its least
        recently used blocks beyond it are dropped at once."""
        if blocks is None:
            self._caps.pop(holder_key, None)
            return
        if blocks <= 0:
            raise ValueError("capacity must be positive")
        if self._caps.get(holder_key) == blocks:
            return
        self._caps[holder_key] = blocks
        holder = self._holders.get(holder_key)
        if holder is not None:
            self._enforce(holder, holder_key)

    def capacity_of(self, holder_key: HolderId) -> int | None:
        """The per-holder bound in force for ``holder`` (None: only the global bound)."""
        return self._caps.get(holder_key, self.holder_capacity_blocks)

    # -- internals ------------------------------------------------------------------------
    def _holder(self, key: HolderId) -> Holder:
        holder = self._holders.get(key)
        if holder is None:
            self._stamp += 1
            holder = self._holders[key] = Holder(self._stamp)
            self._by_engine.setdefault(engine_of(key), []).append(key)
        return holder

    def _lost(self, holder: Holder) -> None:
        """A held block changed so that a walk over it may stop sooner (module docstring)."""
        self._stamp += 1
        holder.epoch = self._stamp

    def _gained(self, holder: Holder) -> None:
        """A held block changed so that a walk's leading runs may reach further."""
        self._stamp += 1
        holder.gains = self._stamp

    def _retier(self, holder: Holder, hold: Hold, tiers: int,
                ekey: tuple[int, EngineHash] | None) -> None:
        """Set a held block's tiers and engine hash, stamping the holder as they change."""
        old, known = hold.tiers, hold.ekey is not None
        hold.tiers, hold.ekey = tiers, ekey
        device, learned = (old ^ tiers) & DEVICE, (old ^ tiers) & LEARNED
        if (device and old & DEVICE) or (learned and tiers & LEARNED) or (known and ekey is None):
            self._lost(holder)
        if (device and tiers & DEVICE) or (learned and old & LEARNED) or (
                ekey is not None and not known):
            self._gained(holder)

    def _drop(self, holder: Holder, h: int) -> None:
        hold = holder.blocks.pop(h)
        holder.last_chain = None
        self._lost(holder)
        self._size -= 1
        if hold.ekey is not None and holder.by_ehash.get(hold.ekey) == h:
            del holder.by_ehash[hold.ekey]

    def _evict_oldest(self, holder: Holder) -> None:
        h = next(iter(holder.blocks))
        self._drop(holder, h)
        self.stats.evicted_blocks += 1

    def _enforce(self, touched: Holder, key: HolderId) -> None:
        cap = self._caps.get(key, self.holder_capacity_blocks)
        if cap is not None:
            while len(touched.blocks) > cap:
                self._evict_oldest(touched)
        while self._size > self.capacity_blocks:
            largest = max(self._holders.values(), key=lambda x: len(x.blocks))
            self._evict_oldest(largest)
