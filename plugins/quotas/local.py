"""The in-process quota store: one replica's buckets, in-flight leases and budgets.

Admission checks every scope and dimension, then applies them all, in one synchronous section
(no ``await`` in between), so concurrent requests on the event loop cannot both take the last
slot. It is the default with one replica and the fallback for quotas while Redis is down.

Memory: per scope (``key:<id>``, ``tenant:<name>``) three buckets and the in-flight leases
(bounded by ``max_concurrent`` or by the requests in flight), in an LRU of ``max_scopes``
entries. Evicting a scope forgets its buckets (they restart full: at most one extra minute's
allowance for a key idle long enough to be the least recently used of ``max_scopes``); scopes
with requests in flight are never evicted. Spend per budgeted scope is kept apart and never
evicted (money): bounded by the keys file.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kvgate.plugins.quotas.model import (
    DIMENSIONS,
    Ask,
    Bucket,
    Quota,
    ScopeLimits,
    Settlement,
    StoreStats,
    Verdict,
    full_in_ms,
    tightest,
    wait_ms,
)

#: Retry-After for a concurrency refusal: slots free when requests end, not on a clock.
CONCURRENCY_RETRY_MS = 1000


@dataclass(slots=True)
class _Scope:
    buckets: list[Bucket | None] = field(default_factory=lambda: [None, None, None])
    #: request id -> (lease deadline ms, reserved cost units)
    leases: dict[str, tuple[int, int]] = field(default_factory=dict)
    reserved: int = 0

    def sweep(self, now_ms: int) -> None:
        for rid in [r for r, (deadline, _) in self.leases.items() if deadline <= now_ms]:
            self.reserved -= self.leases.pop(rid)[1]


class LocalStore:
    """See the module docstring."""

    def __init__(self, max_scopes: int = 100_000) -> None:
        self.max_scopes = max_scopes
        self._scopes: OrderedDict[str, _Scope] = OrderedDict()
        self.spent: dict[str, int] = {}
        self.stats = StoreStats()
        self.evicted = 0

    def _scope(self, name: str) -> _Scope:
        found = self._scopes.get(name)
        if found is None:
            found = self._scopes[name] = _Scope()
            self._evict()
        else:
            self._scopes.move_to_end(name)
        return found

    def _evict(self) -> None:
        if len(self._scopes) <= self.max_scopes:
            return
        for name, scope in self._scopes.items():
            if not scope.leases:
                del self._scopes[name]
                self.evicted += 1
                return

    async def admit(self, ask: Ask, now_ms: int) -> Verdict:
        return self.admit_now(ask, now_ms)

    def admit_now(self, ask: Ask, now_ms: int) -> Verdict:
        """Check every scope, then reserve in every scope (synchronous: atomic on the loop)."""
        states = [(lim, self._scope(lim.scope)) for lim in ask.scopes]
        for lim, st in states:
            refused = self._check(ask, lim, st, now_ms)
            if refused is not None:
                self.stats.reject(refused.dimension, refused.scope)
                return refused
        reqs: list[Quota] = []
        toks: list[Quota] = []
        for lim, st in states:
            for i, limit in enumerate(lim.bucket_limits):
                bucket = st.buckets[i]
                if bucket is not None:
                    bucket.level -= ask.amounts[i]
                    q = Quota(limit, max(0, int(bucket.level)), full_in_ms(bucket.level, limit))
                    (reqs if i == 0 else toks).append(q)
            if lim.needs_lease:
                cost = ask.cost_units if lim.has_budget else 0
                st.leases[ask.request_id] = (now_ms + ask.lease_ms, cost)
                st.reserved += cost
        self.stats.admitted += 1
        return Verdict(True, requests=tightest(reqs), tokens=tightest(toks))

    def _check(self, ask: Ask, lim: ScopeLimits, st: _Scope, now_ms: int) -> Verdict | None:
        for i, limit in enumerate(lim.bucket_limits):
            if limit <= 0:
                st.buckets[i] = None
                continue
            bucket = st.buckets[i]
            if bucket is None:
                bucket = st.buckets[i] = Bucket(float(limit), now_ms)
            level = bucket.refill(limit, now_ms)
            wait = wait_ms(level, ask.amounts[i], limit)
            if wait > 0:
                return Verdict(False, lim.scope, DIMENSIONS[i], wait)
        st.sweep(now_ms)
        if lim.max_concurrent > 0 and len(st.leases) >= lim.max_concurrent:
            return Verdict(False, lim.scope, "concurrent", CONCURRENCY_RETRY_MS)
        if lim.has_budget and self.spent.get(lim.scope, 0) + st.reserved >= lim.budget_units:
            return Verdict(False, lim.scope, "budget")
        return None

    async def settle(self, ask: Ask, used: Settlement, now_ms: int) -> None:
        self.settle_now(ask, used, now_ms)

    def settle_now(self, ask: Ask, used: Settlement, now_ms: int) -> None:
        """Correct the token buckets with the real usage; release the lease; add the spend."""
        delta = (0, used.input_tokens - ask.input_tokens, used.output_tokens - ask.output_tokens)
        for lim in ask.scopes:
            st = self._scopes.get(lim.scope)
            if st is not None:
                for i, limit in enumerate(lim.bucket_limits):
                    bucket = st.buckets[i]
                    if bucket is not None and limit > 0 and delta[i]:
                        bucket.refill(limit, now_ms)
                        bucket.level = min(float(limit), bucket.level - delta[i])
                lease = st.leases.pop(ask.request_id, None)
                if lease is not None:
                    st.reserved -= lease[1]
            if used.cost_units:  # every scope asked about: a budget added later is exact
                self.spent[lim.scope] = self.spent.get(lim.scope, 0) + used.cost_units

    async def seed(self, spent_units: dict[str, int]) -> None:
        for scope, units in spent_units.items():
            self.spent.setdefault(scope, units)

    def in_flight(self) -> int:
        return sum(len(st.leases) for st in self._scopes.values())
