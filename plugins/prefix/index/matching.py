"""Matching a prompt against the KV index: per holder, the longest held prefix of its block
chain (:class:`MatchingTable`, the base of :class:`kvgate.plugins.prefix.index.index.KvIndex`).

Two walks. Event-updated mode (the KV-event index): the chain is walked block by block while
the holder has it, counting the leading runs on the device tier, known from events and not
learnt from usage, dropping the first expired block met, and the matched blocks' recency is
refreshed (a C-level pass, tail first: the root ends most recent). A session's next turn
resumes the walk where its previous turn's stopped when nothing it relied on changed
(:mod:`kvgate.plugins.prefix.index.resume`: the same answer as the walk from the root, which
the tests check against the walk with the memo off). Prefix-closed mode (the gateway's own
record): a binary search (:meth:`MatchingTable._match_closed`; the module docstring of
:mod:`kvgate.plugins.prefix.index.index` says why it is exact). Nothing here does I/O.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence

from kvgate.plugins.prefix.index.hashing import chain_hashes, request_extra_keys
from kvgate.plugins.prefix.index.holders import (
    DEVICE,
    LEARNED,
    NEVER,
    Holder,
    HolderId,
    HolderTable,
)
from kvgate.plugins.prefix.index.resume import DEFAULT_MAX_BYTES, Entry, MatchMemo, Run


class MatchingTable(HolderTable):
    """:class:`HolderTable` with matching (module docstring); the parameters are
    :class:`kvgate.plugins.prefix.index.index.KvIndex`'s of the same names."""

    def __init__(self, capacity_blocks: int, holder_capacity_blocks: int | None,
                 default_block_size: int, *, prefix_closed: bool,
                 match_memo_bytes: int = DEFAULT_MAX_BYTES) -> None:
        super().__init__(capacity_blocks, holder_capacity_blocks, default_block_size)
        self.prefix_closed = prefix_closed
        #: Where each holder's last walk of recent chains stopped (event-updated mode).
        self.resume = MatchMemo(0 if prefix_closed else match_memo_bytes)
        #: Its counters and size (/metrics: ``holder="index.match_memo"``).
        self.match_memo = self.resume.stats

    # -- reading (sizes and holders: HolderTable) ----------------------------------------
    def match(
        self,
        hashes_by_size: Mapping[int, Sequence[int]],
        now: float,
        group_idx: int = 0,
        holders: Iterable[HolderId] | None = None,
        runs: dict[HolderId, tuple[int, int]] | None = None,
    ) -> dict[HolderId, tuple[int, int]]:
        """Longest held prefix per holder: ``holder -> (device_tokens, other_tokens)``.

        ``hashes_by_size[bs]`` are the prompt's own hashes for block size ``bs``; each holder is
        matched with its own block size. ``device_tokens`` is the leading run held on the device
        tier; ``other_tokens`` what the longest held run adds beyond it. Holders without a match
        are left out. Matched blocks are refreshed (see the module docstring). ``runs``
        (event-updated mode): filled per matched holder with ``(confirmed, unlearned)`` tokens
        within the match, found by the same walk: the leading run held *from events* (a
        speculative entry, which only guesses what a dispatched request will store, ends it),
        and the leading run *not* learnt from reported cached tokens (events, resolved
        ancestors, speculation: what the index knew on its own).
        """
        out: dict[HolderId, tuple[int, int]] = {}
        memo = None if self.prefix_closed else self.resume
        found: dict[int, tuple[Entry | None, int, dict[HolderId, Run]]] = {}
        for hid in self._holders if holders is None else holders:
            holder = self._holders.get(hid)
            if holder is None:
                continue
            size = holder.block_sizes.get(group_idx, self.default_block_size)
            hashes = hashes_by_size.get(size)
            if not hashes:
                continue
            if memo is None:
                device = total = self._match_closed(holder, hashes, now)
            else:
                if size not in found:
                    found[size] = (*memo.find(hashes), {})
                entry, common, walked = found[size]
                run = walked[hid] = self._match_one(
                    holder, hashes, now, None if entry is None else entry.runs.get(hid), common)
                device, total = run.device, run.total
                if runs is not None and total:
                    runs[hid] = (run.conf * size, run.unl * size)
            if total:
                out[hid] = (device * size, (total - device) * size)
        if memo is not None:
            for size, (entry, common, walked) in found.items():
                memo.keep(hashes_by_size[size], walked, entry, common)
        return out

    def match_tokens(
        self,
        token_ids: Sequence[int],
        now: float,
        *,
        block_size: int | None = None,
        lora: str | None = None,
        cache_salt: str | None = None,
        group_idx: int = 0,
    ) -> dict[HolderId, tuple[int, int]]:
        """:meth:`match` for a token-id prompt, hashed the way vLLM keys a text prompt's blocks
        (``block_size`` None: each holder's own block size)."""
        sizes = self.block_sizes(group_idx) if block_size is None else frozenset({block_size})
        hashes = {
            size: chain_hashes(
                token_ids, size, group_idx=group_idx,
                extra_keys=request_extra_keys(len(token_ids) // size, lora, cache_salt),
            )
            for size in sizes
        }
        return self.match(hashes, now, group_idx)

    def _match_one(self, holder: Holder, hashes: Sequence[int], now: float,
                   last: Run | None, common: int) -> Run:
        """The longest held unexpired run (blocks: device, total, confirmed, unlearned),
        walked on from ``last`` (this holder's walk of a chain sharing ``common`` blocks)
        where :mod:`kvgate.plugins.prefix.index.resume` shows that exact, else from the root."""
        k, stats, expires = 0, self.resume.stats, NEVER
        if last is not None and last.epoch == holder.epoch and now < last.expires:
            k = min(common, last.total)
            if last.gains != holder.gains:  # a leading run may reach further: re-walk it
                k = min(k, last.device, last.conf, last.unl)
            stats.resumed += 1
            stats.skipped_blocks += k
            expires = last.expires
        else:
            stats.full_walks += 1
            last = None
        device, conf, unl = (0, 0, 0) if last is None else (
            min(last.device, k), min(last.conf, k), min(last.unl, k))
        on_device, in_conf, in_unl = device == k, conf == k, unl == k
        blocks = holder.blocks
        get = blocks.get
        total = k
        for h in hashes[k:] if k else hashes:
            hold = get(h)
            if hold is None:
                break
            if hold.expires <= now:
                self._drop(holder, h)
                self.stats.expired_blocks += 1
                break
            if hold.expires < expires:
                expires = hold.expires
            if on_device and not hold.tiers & DEVICE:
                on_device = False
            device += on_device
            total += 1
            if in_conf:
                in_conf = hold.ekey is not None
                conf += in_conf
            if in_unl:
                in_unl = not hold.tiers & LEARNED
                unl += in_unl
        if total:  # tail first: the root ends up most recent (a C-level loop over ~800 blocks)
            deque(map(blocks.move_to_end, reversed(hashes[:total])), maxlen=0)
        return Run(holder.epoch, holder.gains, total, device, conf, unl, expires)

    def _match_closed(self, holder: Holder, hashes: Sequence[int], now: float) -> int:
        """Blocks of the longest held, unexpired prefix, by binary search (prefix-closed mode:
        held-and-unexpired is monotone along a chain). Every record is on the device tier. The
        first block past the match, when held but expired, is dropped as :meth:`_match_one`
        does; recency is left alone (module docstring). The two commonest answers take one
        lookup: the whole chain (a repeated prompt: its last block is held), or none (an engine
        that never saw its first block)."""
        get = holder.blocks.get
        n = len(hashes)
        if not n:
            return 0
        tail = get(hashes[-1])
        if tail is not None and tail.expires > now:
            return n
        if get(hashes[0]) is None:
            return 0
        lo, hi = 0, n  # blocks [0, lo) are held; [hi, n) are not
        while lo < hi:
            mid = (lo + hi) // 2
            hold = get(hashes[mid])
            if hold is not None and hold.expires > now:
                lo = mid + 1
            else:
                hi = mid
        if lo < n and get(hashes[lo]) is not None:
            self._drop(holder, hashes[lo])
            self.stats.expired_blocks += 1
        return lo

