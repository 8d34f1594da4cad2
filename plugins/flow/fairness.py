"""Fairness accounting (pure, no I/O): virtual token counters per tenant (VTC) and attained
service per agent session (least attained service), both bounded LRU maps.

* **Tenants (VTC, Sheng et al., OSDI '24).** Each tenant has a counter of the tokens it was
  served, divided by its weight (prompt tokens + ``output_weight`` x output tokens). Among the
  tenants with queued requests the one with the smallest counter goes next, so over a saturated
  period each backlogged tenant gets tokens in proportion to its weight, whatever its request
  rate. A request is charged its prompt estimate when it leaves the queue (a burst cannot go
  all at once) and corrected with its real usage. A tenant that becomes backlogged is lifted to
  the smallest counter of the backlogged tenants (else to the last served counter): credit is
  not banked while idle. With ``redis_url`` each replica also adds the tokens the other
  replicas served (plugins/flow/shared.py): the counters are the fleet's, not the replica's.
* **Sessions (LAS).** Within a tenant, the queued request whose session has been served the
  fewest tokens goes first (new and short agent sessions are not stuck behind long ones), aged
  by its wait (``aging_tokens_per_s``) so that no session starves.
"""

from __future__ import annotations

from collections import OrderedDict

from kvgate.plugins.flow.params import FlowParams


class Fairness:
    """Counters by tenant and by (tenant, session); bounded by ``max_tenants`` /
    ``max_sessions`` (the least recently touched evicted)."""

    def __init__(self, params: FlowParams) -> None:
        self.p = params
        self._vtc: OrderedDict[str, float] = OrderedDict()
        self._sessions: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._last_served = 0.0
        #: Tokens served through this replica by tenant (cumulative, counter units before the
        #: weight): what it publishes to the other replicas (plugins/flow/shared.py).
        self.own: OrderedDict[str, float] = OrderedDict()
        self.evicted_tenants = 0
        self.evicted_sessions = 0

    def weight(self, tenant: str) -> float:
        return self.p.tenant_weights.get(tenant, 1.0)

    def counter(self, tenant: str) -> float:
        return self._vtc.get(tenant, self._last_served)

    def lift(self, tenant: str, backlogged_min: float | None) -> None:
        """``tenant`` becomes backlogged: no counter below the current virtual time."""
        floor = self._last_served if backlogged_min is None else backlogged_min
        self._set(tenant, max(self._vtc.get(tenant, floor), floor))

    def served(self, tenant: str, tokens: float) -> None:
        """Charge ``tenant`` ``tokens`` (negative: a correction) in its own units."""
        value = self.counter(tenant) + tokens / self.weight(tenant)
        self._set(tenant, value)

    def used(self, tenant: str, tokens: float) -> None:
        """Real usage served here (published to the other replicas)."""
        self.own[tenant] = self.own.get(tenant, 0.0) + tokens
        self.own.move_to_end(tenant)
        while len(self.own) > self.p.max_tenants:
            self.own.popitem(last=False)

    def remote(self, deltas: dict[str, float]) -> None:
        """Tokens the other replicas served since the last exchange, by tenant."""
        for tenant, tokens in deltas.items():
            self.served(tenant, tokens)

    def dequeued(self, tenant: str) -> None:
        """``tenant``'s request was taken: its counter is the virtual time now."""
        self._last_served = max(self._last_served, self.counter(tenant))

    def attained(self, tenant: str, session: str | None) -> float:
        if session is None:
            return 0.0
        return self._sessions.get((tenant, session), 0.0)

    def session_served(self, tenant: str, session: str | None, tokens: float) -> None:
        if session is None:
            return
        key = (tenant, session)
        self._sessions[key] = self._sessions.get(key, 0.0) + tokens
        self._sessions.move_to_end(key)
        while len(self._sessions) > self.p.max_sessions:
            self._sessions.popitem(last=False)
            self.evicted_sessions += 1

    def cost(self, prompt_tokens: int, output_tokens: int) -> float:
        """A usage's tokens in counter units (before the tenant's weight)."""
        return prompt_tokens + self.p.output_weight * output_tokens

    def _set(self, tenant: str, value: float) -> None:
        self._vtc[tenant] = value
        self._vtc.move_to_end(tenant)
        while len(self._vtc) > self.p.max_tenants:
            self._vtc.popitem(last=False)
            self.evicted_tenants += 1

    def tenants(self) -> int:
        return len(self._vtc)

    def sessions(self) -> int:
        return len(self._sessions)


__all__ = ["Fairness"]
