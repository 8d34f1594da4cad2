"""A bounded index of which engine holds which KV-cache block, keyed by kvgate's own block hash.

Hashing
    Engines' own block hashes cannot be recomputed outside the engine (vLLM seeds its root hash
    randomly per process and its default digest hashes a pickle), so every block is re-keyed with
    kvgate's own deterministic chained hash (:mod:`kvgate.plugins.prefix.index.hashing`: the token
    ids and extra keys of each block, chained from a root per KV-cache group, so blocks of different
    groups never collide). A block's hash therefore names the whole prefix up to and including it,
    exactly like the engine's. Only full blocks are hashed (engines only cache full blocks).

Holders, bounds and eviction
    The per-holder maps and the bounds (``capacity_blocks``, ``holder_capacity_blocks``,
    :meth:`KvIndex.set_capacity`) are :mod:`kvgate.plugins.prefix.index.holders`' (:class:`KvIndex`
    is its :class:`~kvgate.plugins.prefix.index.holders.HolderTable`). A stored block whose parent
    is unknown is re-keyed from a recently routed prompt when one matches
    (:mod:`kvgate.plugins.prefix.index.recent`, :meth:`KvIndex.remember`), else skipped as an
    orphan.

Recency and expiry
    Engines emit nothing on a cache hit, so a successful :meth:`KvIndex.match` refreshes the
    matched blocks' recency; blocks are refreshed tail first, root last, so that eviction takes
    a chain's tail before its root (a dropped root would make every descendant unmatchable).
    Holds with an expiry (speculative or approximate records) are treated as absent once
    expired and dropped when met.

Prefix-closed mode (the gateway's own record, ``prefix_closed=True``)
    An index written only by :meth:`KvIndex.record` (whole chains from their root; no events,
    no removals) keeps an invariant: a block that is held and unexpired has its parent held,
    unexpired, and more recent in LRU order (a record refreshes tail first, so the parent
    ends after the child; an expiry only grows and a parent's is never below its child's;
    LRU eviction therefore always takes a leaf). "Block ``i`` of a prompt is held" is then
    monotone in ``i``, so :meth:`KvIndex.match` finds the longest held prefix by binary
    search (~10 lookups for 800 blocks instead of 800), and :meth:`KvIndex.record` of a
    chain whose tail is already held with at least the new expiry only refreshes the LRU
    order (one C-level pass) instead of visiting every block in Python; not even that when the
    holder's last record was this same chain and no block was dropped since (the chain is
    already at the LRU end in that order). A match does not
    refresh recency in this mode: the record mirrors each engine's cache, and an engine's
    cache is only touched by the requests it serves, which :meth:`KvIndex.record` refreshes.

Nothing here does I/O; the index is single-threaded (owned by the event loop).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

from kvgate.plugins.prefix.events.removals import RemovalLog
from kvgate.plugins.prefix.index.hashing import (
    ExtraKeys,
    HashingError,
    chain_hashes,
    request_extra_keys,
)
from kvgate.plugins.prefix.index.holders import (
    DEVICE,
    DEVICE_MEDIA,
    LEARNED,
    NEVER,
    OTHER,
    EngineHash,
    Hold,
    Holder,
    HolderId,
    IndexStats,
    engine_of,
    holder_id,
    tier_of,
)
from kvgate.plugins.prefix.index.matching import MatchingTable
from kvgate.plugins.prefix.index.recent import PackingError, RecentPrompts, pack_tokens
from kvgate.plugins.prefix.index.resume import DEFAULT_MAX_BYTES

__all__ = [
    "DEVICE", "DEVICE_MEDIA", "LEARNED", "OTHER", "EngineHash", "ExtraKeys", "HashingError",
    "Hold", "HolderId", "IndexStats", "KvIndex", "chain_hashes", "engine_of", "holder_id",
    "request_extra_keys", "tier_of",
]


class KvIndex(MatchingTable):
    """Which holder has which block, bounded (see the module docstring).

    Parameters:
        capacity_blocks: most (holder, block) pairs kept, all holders together.
        holder_capacity_blocks: most blocks kept per holder (None: only the global bound).
        default_block_size: tokens per block assumed for a holder that has reported none yet.
        recent_prompt_bytes: bound of the recently routed prompts kept to re-key events whose
            parent is unknown (:mod:`kvgate.plugins.prefix.index.recent`; 0: none kept, such events
            are skipped).
        prefix_closed: written by :meth:`record` only (module docstring, "Prefix-closed
            mode"); event updates raise ``TypeError``.
        match_memo_bytes: bound of the walks remembered to resume a session's next match
            (:mod:`kvgate.plugins.prefix.index.resume`; 0: every match walks from the root).
    """

    def __init__(
        self,
        capacity_blocks: int,
        holder_capacity_blocks: int | None = None,
        default_block_size: int = 16,
        recent_prompt_bytes: int = 0,
        *,
        prefix_closed: bool = False,
        match_memo_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        super().__init__(capacity_blocks, holder_capacity_blocks, default_block_size,
                         prefix_closed=prefix_closed, match_memo_bytes=match_memo_bytes)
        self.recent = RecentPrompts(recent_prompt_bytes) if recent_prompt_bytes else None
        #: Blocks the engines' events removed lately (evictions while a request is in flight).
        self.removals = RemovalLog()

    def _event_update(self) -> None:
        if self.prefix_closed:
            raise TypeError("a prefix-closed index is written by record() only")

    # -- event updates ------------------------------------------------------------------
    def store(
        self,
        holder_key: HolderId,
        engine_hashes: Sequence[EngineHash],
        parent: EngineHash | None,
        token_ids: Sequence[int],
        block_size: int,
        *,
        medium: str | None = None,
        group_idx: int = 0,
        extra_keys: Sequence[ExtraKeys] | None = None,
        source: HolderId | None = None,
    ) -> int:
        """Apply a ``BlockStored``: consecutive blocks of one chain after ``parent``.

        Returns how many blocks were indexed: 0 when the parent is unknown and no recent prompt
        supplies it (the chain cannot be re-keyed; counted as orphans). Raises
        :class:`HashingError` for bad token ids. Without token ids (and with hashes), the
        blocks are filed by the hashes the index knows (:meth:`store_known`, ``source``).
        """
        if not token_ids and engine_hashes:
            return self.store_known(holder_key, engine_hashes, source=source, medium=medium,
                                    group_idx=group_idx)
        self._event_update()
        holder = self._holder(holder_key)
        holder.block_sizes[group_idx] = block_size  # learnt even from an orphan
        parent_own: int | None = None
        ancestors: Sequence[int] = ()
        if parent is not None:
            parent_own = holder.by_ehash.get((group_idx, parent))
            if parent_own is None:
                ancestors = self._resolve(holder_key, token_ids, block_size, group_idx,
                                          extra_keys)
                parent_own = ancestors[-1] if ancestors else None
            if parent_own is None:
                self.stats.orphan_blocks += len(engine_hashes)
                return 0
        own = chain_hashes(
            token_ids, block_size, parent=parent_own, group_idx=group_idx, extra_keys=extra_keys
        )
        tier = tier_of(medium)
        pairs = list(zip(engine_hashes, own, strict=False))
        for ehash, h in reversed(pairs):  # tail first: the root ends up most recent
            self._put_event_hold(holder, (group_idx, ehash), h, tier)
        if ancestors and parent is not None:  # after the blocks: the root stays most recent
            self._put_event_hold(holder, (group_idx, parent), ancestors[-1], DEVICE)
            for h in reversed(ancestors[:-1]):
                self._put_held(holder, h)
        self.stats.stored_blocks += len(pairs)
        self._enforce(holder, holder_key)
        return len(pairs)

    def store_known(
        self,
        holder_key: HolderId,
        engine_hashes: Sequence[EngineHash],
        *,
        source: HolderId | None = None,
        medium: str | None = None,
        group_idx: int = 0,
    ) -> int:
        """Apply a ``BlockStored`` without token ids (vLLM's Mooncake store worker sends ``[]``
        when it lacks them): the store is known to hold each block, by the engine's hash only.

        A block is filed under ``holder_key`` when the index already knows its hash, in
        ``holder_key`` itself or in ``source`` (the publishing engine's own holder: its GPU
        events carried the tokens, and the store worker reuses the engine's block hashes);
        otherwise it cannot be re-keyed and is counted in ``tokenless_unknown``. Returns how
        many blocks were indexed.
        """
        self._event_update()
        holder = self._holder(holder_key)
        known = None if source is None else self._holders.get(source)
        found: list[tuple[tuple[int, EngineHash], int]] = []
        for ehash in engine_hashes:
            ekey = (group_idx, ehash)
            h = holder.by_ehash.get(ekey)
            if h is None and known is not None:
                h = known.by_ehash.get(ekey)
            if h is None:
                self.stats.tokenless_unknown += 1
            else:
                found.append((ekey, h))
        tier = tier_of(medium)
        for ekey, h in reversed(found):  # tail first: the root ends up most recent
            self._put_event_hold(holder, ekey, h, tier)
        self.stats.tokenless_blocks += len(found)
        self.stats.stored_blocks += len(found)
        self._enforce(holder, holder_key)
        return len(found)

    def _put_event_hold(
        self, holder: Holder, ekey: tuple[int, EngineHash], h: int, tier: int
    ) -> None:
        old = holder.by_ehash.get(ekey)
        if old is not None and old != h:
            self._drop(holder, old)
        hold = holder.blocks.get(h)
        if hold is None:
            holder.blocks[h] = Hold(tier, NEVER, ekey)
            self._size += 1
        else:
            if hold.ekey is not None and hold.ekey != ekey:
                holder.by_ehash.pop(hold.ekey, None)
            self._retier(holder, hold, tier if hold.expires != NEVER else hold.tiers | tier,
                         ekey)
            hold.expires = NEVER
            holder.blocks.move_to_end(h)
        holder.by_ehash[ekey] = h

    def remove(
        self,
        holder_key: HolderId,
        engine_hashes: Iterable[EngineHash],
        *,
        medium: str | None = None,
        group_idx: int = 0,
    ) -> int:
        """Apply a ``BlockRemoved`` (any order; vLLM sends one hash per event, tail to root).

        Only the given tier is cleared; a block left on no tier is dropped. Returns the number of
        blocks found.
        """
        self._event_update()
        holder = self._holders.get(holder_key)
        tier = tier_of(medium)
        found = 0
        for ehash in engine_hashes:
            h = None if holder is None else holder.by_ehash.get((group_idx, ehash))
            if holder is None or h is None:
                self.stats.unknown_removals += 1
                continue
            found += 1
            self.removals.removed(engine_of(holder_key), h)
            hold = holder.blocks[h]
            if not hold.tiers & ~tier:
                self._drop(holder, h)
            else:
                self._retier(holder, hold, hold.tiers & ~tier, hold.ekey)
        self.stats.removed_blocks += found
        return found

    def reset_engine(self, engine: str) -> int:
        """Reset every holder (all data-parallel ranks) of an engine (it left the pool)."""
        self.removals.forget(engine)
        if self.recent is not None:
            for hid in self.holders():
                if engine_of(hid) == engine:
                    self.recent.forget(hid)
        for hid in [h for h in self._caps if engine_of(h) == engine]:
            del self._caps[hid]
        return sum(self.reset(hid) for hid in self.holders() if engine_of(hid) == engine)

    # -- orphans ----------------------------------------------------------------------------
    def remember(self, holder_key: HolderId, token_ids: Sequence[int], hashes: Sequence[int],
                 *, block_size: int, group_idx: int = 0) -> None:
        """Keep a prompt just routed to ``holder`` (its ids and own hashes in ``block_size``
        blocks) to re-key later events whose parent is unknown (no-op without
        ``recent_prompt_bytes``)."""
        if self.recent is None:
            return
        try:
            data = pack_tokens(token_ids[: len(hashes) * block_size])
        except PackingError:
            return
        self.recent.add(holder_key, group_idx, block_size, data, hashes)

    def _resolve(self, holder_key: HolderId, token_ids: Sequence[int], block_size: int,
                 group_idx: int, extra_keys: Sequence[ExtraKeys] | None) -> Sequence[int]:
        """Own hashes of the blocks before an event whose parent is unknown, from a recent
        prompt whose block ``i`` is the event's first block (checked by its own hash, so extra
        keys agree too): its blocks ``0..i-1``, which the engine reused (the event extends
        them). :meth:`store` indexes them as held and links the parent to block ``i-1``."""
        if self.recent is None or len(token_ids) < block_size:
            return ()
        try:
            first = pack_tokens(token_ids[:block_size])
        except PackingError:
            return ()
        extra = list(extra_keys[:1]) if extra_keys else None
        for hashes, i in self.recent.candidates(holder_key, group_idx, first):
            if i > 0 and chain_hashes(token_ids[:block_size], block_size, parent=hashes[i - 1],
                                      group_idx=group_idx, extra_keys=extra)[0] == hashes[i]:
                self.stats.resolved_orphans += 1
                return hashes[:i]
        return ()

    def _put_held(self, holder: Holder, h: int) -> None:
        """Index ``h`` as held on the device with no known engine hash (an ancestor the engine
        reused); an earlier record becomes permanent."""
        hold = holder.blocks.get(h)
        if hold is None:
            holder.blocks[h] = Hold(DEVICE, NEVER, None)
            self._size += 1
            return
        if hold.expires != NEVER:
            self._retier(holder, hold, DEVICE, hold.ekey)
            hold.expires = NEVER
        holder.blocks.move_to_end(h)

    # -- records (speculative / approximate) -----------------------------------------------
    def record(
        self, holder_key: HolderId, hashes: Sequence[int], expires: float, *, block_size: int,
        group_idx: int = 0, learned: bool = False, chain: Sequence[int] | None = None,
    ) -> None:
        """Note that ``holder`` should hold ``hashes`` (device tier) until ``expires``.

        Used for speculative entries (the request was just routed there) and for the
        approximate mode. ``hashes`` are of ``group_idx``'s chain in blocks of ``block_size``,
        which becomes the holder's block size for that group until an event says otherwise.
        A block already known from an event keeps its event entry and is only refreshed; an
        earlier record gets the later expiry. ``learned``: the entries come from the engine's
        reported cached tokens (flagged :data:`LEARNED` until an event announces them).
        ``chain``: the whole prompt's chain when ``hashes`` is a prefix of it (finds the
        prompt's remembered walk, :meth:`MatchMemo.recorded`; the result is the same).
        """
        holder = self._holder(holder_key)
        holder.block_sizes.setdefault(group_idx, block_size)
        blocks = holder.blocks
        get, refresh = blocks.get, blocks.move_to_end
        bits = DEVICE | LEARNED if learned else DEVICE
        if self.prefix_closed and hashes:
            tail = get(hashes[-1])
            if tail is not None and tail.expires >= expires:
                # held to the tail, so every ancestor is held with at least this expiry: the
                # loop below would change no expiry nor tier, only refresh; and nothing to
                # refresh when the last record left this very chain at the end
                if holder.last_chain != hashes:
                    deque(map(refresh, reversed(hashes)), maxlen=0)
                    holder.last_chain = list(hashes)
                return
        # blocks a remembered walk saw held from events (never expiring): refreshed only
        known = 0 if self.prefix_closed else self.resume.recorded(
            holder_key, hashes, expires, holder.epoch, chain)
        added = 0
        for h in reversed(hashes[known:]) if known else reversed(hashes):
            hold = get(h)
            if hold is None:
                blocks[h] = Hold(bits, expires, None)
                added += 1
                continue
            if hold.expires < expires:  # an event's entry never expires (inf): kept as is
                hold.expires = expires
                # an expiring hold is a record's, so it is on the device: only the learnt bit
                # can be new (one test per block less on the speculative path)
                if learned and not hold.tiers & LEARNED:
                    self._retier(holder, hold, hold.tiers | bits, hold.ekey)
            refresh(h)
        if known:  # tail first, after the rest: the same order as the loop's
            deque(map(refresh, reversed(hashes[:known])), maxlen=0)
        self._size += added
        if self.prefix_closed:
            holder.last_chain = list(hashes)  # cleared by any eviction below
        self._enforce(holder, holder_key)

    def forget_records(self, holder_key: HolderId, hashes: Iterable[int],
                       expiring_after: float) -> int:
        """Drop the record entries among ``hashes`` that expire after ``expiring_after`` (a
        finite expiry: entries known from events stay; an earlier bound keeps shorter-lived
        entries such as speculation). Returns how many were dropped."""
        self._event_update()
        holder = self._holders.get(holder_key)
        if holder is None:
            return 0
        dropped = 0
        for h in hashes:
            hold = holder.blocks.get(h)
            if hold is not None and expiring_after < hold.expires != NEVER:
                self._drop(holder, h)
                dropped += 1
        return dropped
