"""A shared KV tier for simulated engines: one capacity-bounded block store every engine of a
fleet writes its computed blocks to and reads prefixes from, over a modelled link.

What it models. Mooncake Store (DRAM of the fleet's hosts, reached through the Transfer Engine
over RDMA) or an LMCache remote backend behind vLLM: an engine that computes a full block saves
it to the store (write-through, as vLLM's Mooncake store connector and LMCache save every
computed block); an engine admitting a prompt first matches its own GPU cache, then continues
the match in the store and loads those blocks instead of computing them. Only DRAM is modelled
(Mooncake's NVMe behind DRAM is not: one tier, one bandwidth).

Algorithm. The store is an LRU over chained block hashes (a hash names its whole prefix, so a
prefix match stops at the first missing block). Chains are inserted and refreshed *tail first,
root last*, so eviction takes a chain's tail before its root and a shared root outlives its
branches (a dropped root would make every descendant unreachable). Past ``capacity`` the least
recently used block is evicted. Bounded by ``capacity`` blocks; every operation costs O(blocks
touched).

Writes. ``write="through"`` (the default, what the real connectors do) saves every computed
block; ``write="evicted"`` saves a block when a GPU evicts it instead (an exclusive tier), to
measure what the duplication costs.

Cost. Loading ``n`` blocks takes ``load_setup_s + n * block_size * kv_bytes_per_token /
link_bytes_per_s`` seconds (:meth:`SharedTier.load_seconds`); the engine adds it to the step that
admits the request (pessimistic: a real connector overlaps the load with other sequences'
steps). Writes run in the background and cost nothing on the critical path (link contention is
not modelled). Parameters and their sources: :class:`TierParams`, docs/shared-tier.md,
shared/design/H100_TIMING.md ("Shared KV tier").

Events. The store publishes what it holds in vLLM 0.32's wire format, as a store-level
publisher: ``BlockStored`` / ``BlockRemoved`` with ``medium="CPU"`` and ``locality="REMOTE"``
(vLLM's offloading connectors' medium for host memory, and its marker for a tier that is not
the publisher's own). :meth:`SharedTier.drain_events` hands them out; nothing here does I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kvgate.engines.sim.core.kv_events import BlockRemoved, BlockStored, KvEvent

#: vLLM's ``MEDIUM_CPU`` (host DRAM) and its locality marker for a tier shared by the fleet.
MEDIUM_CPU = "CPU"
LOCALITY_REMOTE = "REMOTE"


class TierParams(BaseModel):
    """The shared tier's size and link. Defaults: the 8B model of H100_TIMING.md over RDMA."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: Blocks the store holds before compression (DRAM given to the tier / block bytes).
    capacity_blocks: int = Field(ge=1)
    #: Tokens per block; the engines' block size.
    block_size: int = Field(ge=1)
    #: Blocks stored per block of raw KV: 1 / (1 - saving) with a KV codec of that saving
    #: (``bench/results/codec-saving.json``), 1.0 without one.
    capacity_factor: float = Field(default=1.0, ge=1.0)
    #: KV bytes per token: 131,072 (2 * 32 layers * 8 KV heads * 128 * 2 B, bf16), the same
    #: figure as the P/D transfer model (``PdSimConfig.kv_bytes_per_token``).
    kv_bytes_per_token: int = Field(default=131_072, ge=1)
    #: Store-to-GPU bandwidth, bytes/s: 25 GB/s, one 200 Gb/s RDMA NIC at full rate (the
    #: P/D transfer model's figure; Mooncake's Transfer Engine reaches line rate on one NIC).
    link_bytes_per_s: float = Field(default=25e9, gt=0)
    #: Fixed cost of one load (lookup in the store's master, descriptors), seconds: 2 ms, as a
    #: P/D transfer's setup.
    load_setup_s: float = Field(default=2e-3, ge=0)
    #: When engines write: ``through``, every computed block as it becomes full (vLLM's Mooncake
    #: store connector, LMCache: the tier then also holds what the GPUs hold); ``evicted``, a
    #: block when a GPU evicts it (a victim cache: what the GPUs hold is not duplicated; its
    #: events carry no token ids or parent, as the evicting cache knows only the hash).
    write: Literal["through", "evicted"] = "through"

    @property
    def capacity(self) -> int:
        """Blocks held, the codec's factor applied."""
        return max(1, int(self.capacity_blocks * self.capacity_factor))


@dataclass(slots=True)
class TierStats:
    """Cumulative counters of a tier (blocks unless named otherwise)."""

    stored: int = 0
    removed: int = 0
    loads: int = 0  # admissions that loaded at least one block
    loaded: int = 0
    load_seconds: float = 0.0


class SharedTier:
    """The fleet's shared block store. See the module docstring."""

    def __init__(self, params: TierParams) -> None:
        self.params = params
        self.capacity = params.capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()  # LRU first
        self._events: list[KvEvent] = []
        self.stats = TierStats()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._blocks

    def match_blocks(self, hashes: Sequence[int]) -> int:
        """How many leading ``hashes`` the store holds. Does not touch LRU order."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def load_seconds(self, blocks: int) -> float:
        """Time to load ``blocks`` blocks into an engine's GPU memory; 0.0 for none."""
        if blocks <= 0:
            return 0.0
        p = self.params
        return p.load_setup_s + blocks * p.block_size * p.kv_bytes_per_token / p.link_bytes_per_s

    def load(self, hashes: Sequence[int]) -> float:
        """An engine loads these blocks (held at its match): refreshes those still held (a
        write between the match and the load may have evicted some: the copy is already on
        its way); returns the load time."""
        for h in reversed(hashes):
            if h in self._blocks:
                self._blocks.move_to_end(h)
        seconds = self.load_seconds(len(hashes))
        if hashes:
            self.stats.loads += 1
            self.stats.loaded += len(hashes)
            self.stats.load_seconds += seconds
        return seconds

    def put(self, hashes: Sequence[int], parent: int | None, token_ids: Sequence[int]) -> None:
        """An engine saves consecutive blocks of one chain (``parent`` precedes them).

        Blocks already held are refreshed; new ones are stored (``BlockStored``), evicting the
        least recently used (``BlockRemoved``, one hash each).
        """
        new = {h for h in hashes if h not in self._blocks}
        if new:
            self._stored_events(hashes, new, parent, token_ids)
            self.stats.stored += len(new)
        for h in reversed(hashes):
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity:
            victim, _ = self._blocks.popitem(last=False)
            self._events.append(BlockRemoved([victim], medium=MEDIUM_CPU,
                                             locality=LOCALITY_REMOTE))
            self.stats.removed += 1

    def _stored_events(self, hashes: Sequence[int], new: set[int], parent: int | None,
                       token_ids: Sequence[int]) -> None:
        """One ``BlockStored`` per run of consecutive new blocks."""
        bs = self.params.block_size
        start: int | None = None
        for j in range(len(hashes) + 1):
            fresh = j < len(hashes) and hashes[j] in new
            if fresh and start is None:
                start = j
            elif not fresh and start is not None:
                self._events.append(BlockStored(
                    block_hashes=list(hashes[start:j]),
                    parent_block_hash=hashes[start - 1] if start else parent,
                    token_ids=list(token_ids[start * bs: j * bs]), block_size=bs,
                    medium=MEDIUM_CPU, locality=LOCALITY_REMOTE))
                start = None

    def drain_events(self) -> list[KvEvent]:
        """The store's events since the last call, in order."""
        events, self._events = self._events, []
        return events
