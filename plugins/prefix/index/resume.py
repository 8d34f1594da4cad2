"""Where each holder's last walk of a prompt stopped, so a session's next turn walks only what
it added (:class:`MatchMemo`, used by :meth:`kvgate.plugins.prefix.index.index.KvIndex.match`).

An agent's turn N+1 resends turn N's prompt plus a few hundred tokens: its block chain starts
with turn N's (the same hashes; :mod:`kvgate.plugins.prefix.record_chains` even reuses the
same ints). The match walks, per holder, the chain while the holder has it, one dict lookup per
block (~6,600 at 100k tokens in blocks of 16). This memo keeps, per recent chain and holder, the
walk's result as a :class:`Run`: how many blocks were held (``total``), the leading runs on the
device tier / known from events / not learnt (``device``, ``conf``, ``unl``), the earliest
expiry among them, and the holder's change stamps (``epoch``, ``gains``) at the end of the walk.

Why resuming is exact. Let ``k`` = min(the blocks the new chain shares with the remembered one,
the run's ``total``). The full walk over blocks ``0..k-1`` reads, per block, whether it is held,
its expiry against ``now``, its device bit, whether it carries an engine hash, and its learnt
bit. The holder's ``epoch`` changes on every change that can make one of those answers worse
for an existing block (a block dropped for any reason: removal, eviction, expiry, reset,
forgotten record; the device bit lost; the learnt bit gained; the engine hash lost), and its
``gains`` on every change that can make one better (device bit gained, learnt bit lost, engine
hash gained). Expiries only ever grow while a block is held. So when ``epoch`` is unchanged and
``now`` is before the earliest expiry the run saw, blocks ``0..k-1`` are still held, unexpired,
with the same bits: the walk's state at ``k`` is the run's, cut at ``k``, and walking on from
``k`` gives exactly the full walk's answer (blocks added since can only lie at ``k`` or after,
where the walk goes on). When only ``gains`` changed, a leading run may now reach further:
the walk resumes at the shortest of them instead (every block before it is held with every bit
as before). The full walk also drops the first expired block it meets; with ``now`` before
every expiry of ``0..k-1`` it meets none there either.

Finding the remembered chain: like :mod:`kvgate.plugins.prefix.record_chains`, each chain is
indexed under ``(j, hash of block j-1)`` for its last :data:`TAIL_KEYS` lengths ``j``, and a new
chain of ``n`` blocks probes ``j = n, n-1, ...`` (at most :data:`MAX_PROBES`); a hit is verified
by comparing the lists ``new[:j] == old[:j]`` (C-level, pointer-equal ints), so a hash
collision cannot resume a walk of another prefix. A chain that extends the one found supersedes
it (one entry per session); a chain found nowhere is walked in full.

Bounded: ``max_bytes`` (:data:`HASH_BYTES` per remembered hash, :data:`RUN_BYTES` per holder's
run), least recently used out (``evicted``); a chain over a quarter of the bound is not kept.
Nothing here does I/O; single-threaded (owned by the event loop, like the index).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

#: Bytes a remembered hash costs (a list slot; the int itself is shared with the caller's list).
HASH_BYTES = 8
#: Bytes a holder's run costs (the dataclass and its dict slot).
RUN_BYTES = 200
#: Bytes an entry costs besides its hashes and runs (the entry, its list, its index keys).
ENTRY_BYTES = 400
#: Default bound: ~300 chains of 100k tokens in blocks of 16 (53 KB of hashes each).
DEFAULT_MAX_BYTES = 16 * 1024 * 1024
#: A chain is indexed by its last this many lengths: a chat's next turn re-tokenizes the
#: previous generation prompt with the reply after it, so its previous last block may differ.
TAIL_KEYS = 2
#: Blocks a new chain may have beyond the remembered one it extends (as record_chains).
MAX_PROBES = 1024

HolderId = str


@dataclass(frozen=True, slots=True)
class Run:
    """One holder's walk of a chain (module docstring); counts are in blocks."""

    epoch: int
    gains: int
    total: int
    device: int
    conf: int
    unl: int
    expires: float

    def cut(self, k: int) -> Run:
        """This run restricted to the chain's first ``k`` blocks."""
        if k >= self.total:
            return self
        return Run(self.epoch, self.gains, k, min(self.device, k), min(self.conf, k),
                   min(self.unl, k), self.expires)


@dataclass(slots=True)
class MatchMemoStats:
    """Counters (monotonic): lookups that found a remembered chain / did not; holder walks
    resumed / walked from the root; blocks the resumed walks skipped, and that records only
    refreshed (:meth:`MatchMemo.recorded`); entries dropped by the
    bound / replaced by their session's next turn. ``entries`` and ``bytes``: held now."""

    hits: int = 0
    misses: int = 0
    resumed: int = 0
    full_walks: int = 0
    skipped_blocks: int = 0
    #: Blocks records only refreshed (a C-level pass) because a run showed them event-held.
    refreshed_blocks: int = 0
    evicted: int = 0
    superseded: int = 0
    entries: int = 0
    bytes: int = 0


@dataclass(slots=True)
class Entry:
    """A remembered chain and its holders' runs."""

    hashes: list[int]
    runs: dict[HolderId, Run] = field(default_factory=dict)
    keys: tuple[tuple[int, int], ...] = ()
    key: int = -1

    @property
    def size(self) -> int:
        return ENTRY_BYTES + HASH_BYTES * len(self.hashes) + RUN_BYTES * len(self.runs)


class MatchMemo:
    """LRU of recent chains' runs per holder (see the module docstring)."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES,
                 stats: MatchMemoStats | None = None) -> None:
        self.max_bytes = max_bytes
        self.stats = stats if stats is not None else MatchMemoStats()
        self._entries: OrderedDict[int, Entry] = OrderedDict()
        self._tails: dict[tuple[int, int], int] = {}
        self._next = 0

    def __len__(self) -> int:
        return len(self._entries)

    def find(self, hashes: Sequence[int]) -> tuple[Entry | None, int]:
        """The remembered chain ``hashes`` continues and the blocks both start with."""
        entry, common = self._probe(hashes)
        if entry is None:
            self.stats.misses += 1
        else:
            self.stats.hits += 1
        return entry, common

    def recorded(self, holder: HolderId, hashes: Sequence[int], expires: float,
                 epoch: int, chain: Sequence[int] | None = None) -> int:
        """``hashes`` are being recorded for ``holder`` (stamp ``epoch``) until ``expires``.
        Returns how many leading blocks are known from events (the remembered run's ``conf``,
        while its ``epoch`` holds: held, never expiring, so the record only refreshes them).
        Afterwards every block of ``hashes`` is held until ``expires`` at least, so a remembered
        run within them keeps its answers at least as long (each block's expiry is the greater
        of its own and ``expires``, hence so is their earliest). ``chain``: a longer chain
        ``hashes`` is a prefix of (found by it; only the common part of ``hashes`` counts)."""
        if chain is not None and len(chain) > len(hashes) and chain[:len(hashes)] == hashes:
            entry, common = self._probe(chain)
            common = min(common, len(hashes))
        else:
            entry, common = self._probe(hashes)
        run = None if entry is None else entry.runs.get(holder)
        if entry is None or run is None:
            return 0
        if run.total <= common and run.expires < expires:
            entry.runs[holder] = replace(run, expires=expires)
        known = min(run.conf, common) if run.epoch == epoch else 0
        self.stats.refreshed_blocks += known
        return known

    def _probe(self, hashes: Sequence[int]) -> tuple[Entry | None, int]:
        n = len(hashes)
        if self.max_bytes <= 0 or not n:
            return None, 0
        get = self._tails.get
        for j in range(n, max(0, n - MAX_PROBES), -1):
            key = get((j, hashes[j - 1]))
            if key is None:
                continue
            entry = self._entries[key]
            old = entry.hashes
            if (old if len(old) == j else old[:j]) == (hashes if n == j else hashes[:j]):
                self._entries.move_to_end(key)
                return entry, j
        return None, 0

    def keep(self, hashes: Sequence[int], runs: dict[HolderId, Run], found: Entry | None,
             common: int) -> None:
        """Remember ``runs`` (this walk's, per holder) for ``hashes``; ``found`` / ``common``:
        :meth:`find`'s answer. The same chain again updates its entry; a chain extending it
        replaces it, keeping its other holders' runs cut to the common blocks."""
        if self.max_bytes <= 0 or not hashes:
            return
        if found is not None and common == len(found.hashes) == len(hashes):
            self.stats.bytes -= found.size
            found.runs.update(runs)
            self.stats.bytes += found.size
            self._enforce()
            return
        carried = {} if found is None else {
            hid: run.cut(common) for hid, run in found.runs.items() if hid not in runs}
        carried.update(runs)
        n = len(hashes)
        keys = tuple((j, hashes[j - 1]) for j in range(n, max(0, n - TAIL_KEYS), -1))
        key = self._next
        entry = Entry(list(hashes), carried, keys, key)
        if entry.size > self.max_bytes // 4:
            return
        self._next += 1
        if found is not None and common >= len(found.hashes) + 1 - TAIL_KEYS:
            self._drop_key(found.key)
            self.stats.superseded += 1
        for tail in keys:
            old = self._tails.get(tail)
            if old is not None:
                self._drop_key(old)
            self._tails[tail] = key
        self._entries[key] = entry
        self.stats.entries += 1
        self.stats.bytes += entry.size
        self._enforce()

    def clear(self) -> None:
        self._entries.clear()
        self._tails.clear()
        self.stats.entries = self.stats.bytes = 0

    def _enforce(self) -> None:
        while self.stats.bytes > self.max_bytes and self._entries:
            self._drop_key(next(iter(self._entries)))
            self.stats.evicted += 1

    def _drop_key(self, key: int) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        self.stats.entries -= 1
        self.stats.bytes -= entry.size
        for tail in entry.keys:
            if self._tails.get(tail) == key:
                del self._tails[tail]
