"""Which blocks an engine's KV events removed lately (``BlockRemoved``), and in what order: to
tell an index fault from an eviction that happened while a request was in flight.

Under KV pressure the engine may evict blocks between the gateway's routing decision and the
engine admitting the request: the index predicted them (rightly, when it decided), the engine
reports fewer cached tokens, and the ``BlockRemoved`` events arrive afterwards. Such an ``over``
prediction says nothing about the index; counting it against the index's agreement made the
index state flap between ``exact``, ``degraded`` and ``approximate`` all through a pressured run
(issue 28). The prefix-cache producer notes :attr:`RemovalLog.seq` at dispatch and asks at
usage whether any of the blocks it predicted beyond the engine's report was removed since.

Bounded: the last ``per_engine`` removals of each engine (oldest first out; 8,192 = a 128k-token
prompt in 16-token blocks, far more than an engine evicts while one request is in flight).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

#: Removals kept per engine.
PER_ENGINE = 8192


class RemovalLog:
    """Per engine, the recently removed blocks (kvgate's chain hashes) with their sequence."""

    def __init__(self, per_engine: int = PER_ENGINE) -> None:
        self.per_engine = per_engine
        #: Removals seen so far, all engines (a dispatch notes it; later removals are after).
        self.seq = 0
        self._engines: dict[str, OrderedDict[int, int]] = {}
        #: The sequence of each engine's last whole-cache clear (one int per engine).
        self._cleared: dict[str, int] = {}

    def removed(self, engine: str, block: int) -> None:
        self.seq += 1
        log = self._engines.setdefault(engine, OrderedDict())
        log[block] = self.seq
        log.move_to_end(block)
        if len(log) > self.per_engine:
            log.popitem(last=False)

    def cleared(self, engine: str) -> None:
        """``engine`` dropped its whole cache (``AllBlocksCleared``, a restart): every block
        counts as removed now. vLLM publishes a reset only after its next engine step, so on
        an idle engine the first request after ``/reset_prefix_cache`` or ``sleep`` is routed
        on the index from before it: that miss is the reset's, not the index's."""
        self.seq += 1
        self._cleared[engine] = self.seq
        self._engines.pop(engine, None)

    def removed_after(self, engine: str, blocks: Sequence[int], seq: int) -> bool:
        """Whether any of ``blocks`` was removed from ``engine`` after ``seq``."""
        if self._cleared.get(engine, 0) > seq:
            return bool(blocks)
        log = self._engines.get(engine)
        if not log:
            return False
        get = log.get
        return any(get(b, 0) > seq for b in blocks)

    def forget(self, engine: str) -> None:
        self._engines.pop(engine, None)
        self._cleared.pop(engine, None)


__all__ = ["PER_ENGINE", "RemovalLog"]
