"""``pd-admission``: token-aware admission for prefill/decode pools.

(RequestHook, DispatchHook, CompletionHook, PrefillHook, EndpointSetListener.)

Load comes from a ``token-load-scorer`` declared before it (``load_scorer``), which charges
every dispatch's uncached prompt tokens to the engine that prefills it and its expected output
to the engine that decodes it (``decision.prefill`` / ``decision.target``), per engine. This
plugin groups engines into pools by role (``prefill`` engines, ``decode`` engines; ``both``
engines belong to both pools) and keeps the fleet out of overload:

* an engine's prefill side is saturated when its in-flight prefill tokens (plus requests
  admitted here but not dispatched yet) reach ``max_prefill_tokens``;
* its decode side is saturated when its in-flight requests reach ``max_decode_requests`` or its
  in-flight decode tokens reach ``max_decode_tokens``;
* a pool is saturated when every engine in it is; a request is admitted at once unless *both*
  pools are saturated (with only the prefill pool full, the P/D handler can still decode
  locally; with only the decode pool full, the request still cannot stream — but that pool's
  load also bounds prefill hops, whose output lands there, so waiting on both is the rule).

Otherwise the request waits, first come first served, in a queue of at most ``max_waiting``
requests; a request finding the queue full gets 429 with ``Retry-After``, one that waited
``max_wait_s`` gets 503 (``overloaded``) with ``Retry-After``. Waiters are woken whenever a
dispatch completes or a prefill hop ends (and re-check every ``poll_s`` in case a hook ran in
another order).

Params (units in brackets):

* ``load_scorer`` — the token-load-scorer instance (default ``token-load-scorer``).
* ``max_prefill_tokens`` [tokens per engine] — 32768: four full steps of vLLM's 8192-token
  batch (≈ 0.75 s of H100 prefill for an 8B model); more queued prefill only adds TTFT.
* ``max_decode_requests`` [requests per engine] — 256: vLLM's ``max_num_seqs``; past it the
  engine queues requests itself.
* ``max_decode_tokens`` [tokens per engine] — 262144: expected output in flight (256 requests
  x 1024 tokens); bounds KV growth on long generations.
* ``max_waiting`` [requests] — 1024: the queue bound (the gateway holds each waiter's parsed
  body, ~KBs each).
* ``max_wait_s`` [s] — 30: longer than a typical burst, shorter than client timeouts.
* ``retry_after_s`` [s] — 1: sent as ``Retry-After`` (whole seconds).
* ``poll_s`` [s] — 0.05.

Bounded state: the role map (one entry per engine) and the queue (``max_waiting``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field

from kvgate.middleware.framework.errors import ConfigError, Overloaded, RateLimited
from kvgate.middleware.framework.plugin import (
    CompletionHook,
    DispatchHook,
    EndpointSetListener,
    Plugin,
    PluginLookup,
    PrefillHook,
    RequestHook,
)
from kvgate.middleware.framework.types import (
    CycleState,
    Endpoint,
    EndpointId,
    InferenceRequest,
    Outcome,
    Role,
    RoutingDecision,
    StateKey,
)
from kvgate.plugins.load.loads import EngineLoad
from kvgate.plugins.load.token_load import TokenLoadScorer

#: Seconds after which an admitted request that never reached dispatch stops counting as
#: pending load (admission to dispatch takes milliseconds: tokenization and scheduling).
PENDING_TTL_S = 10.0


def prefill_saturated(load: EngineLoad, pending: int, max_tokens: int) -> bool:
    return load.prefill_tokens + pending >= max_tokens


def decode_saturated(load: EngineLoad, max_requests: int, max_tokens: int) -> bool:
    return load.requests >= max_requests or load.decode_tokens >= max_tokens


class PdAdmission(
    Plugin, RequestHook, DispatchHook, CompletionHook, PrefillHook, EndpointSetListener
):
    """Waits requests while both pools are saturated (module docstring)."""

    type_name = "pd-admission"
    example_params: ClassVar[Mapping[str, object]] = {
        "load_scorer": "token-load-scorer", "max_prefill_tokens": 32768, "max_waiting": 64,
    }

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)

        load_scorer: str = "token-load-scorer"
        max_prefill_tokens: int = Field(default=32768, ge=1)
        max_decode_requests: int = Field(default=256, ge=1)
        max_decode_tokens: int = Field(default=262144, ge=1)
        max_waiting: int = Field(default=1024, ge=0)
        max_wait_s: float = Field(default=30.0, ge=0)
        retry_after_s: int = Field(default=1, ge=0)
        poll_s: float = Field(default=0.05, gt=0)

    def __init__(self, name: str, params: BaseModel, plugins: PluginLookup) -> None:
        super().__init__(name, params, plugins)
        assert isinstance(params, PdAdmission.Params)
        self.p = params
        scorer = plugins.lookup(params.load_scorer)
        if not isinstance(scorer, TokenLoadScorer):
            raise ConfigError(f"load_scorer {params.load_scorer!r} is not a token-load-scorer")
        self.scorer = scorer
        self.roles: dict[EndpointId, Role] = {}
        self._queue: deque[object] = deque()
        self._wake = asyncio.Event()
        #: Admitted, not yet dispatched: ticket -> (prompt tokens, admission time). Normally
        #: settled within milliseconds by the dispatch hook; a request that fails before its
        #: dispatch is swept after PENDING_TTL_S.
        self._pending: dict[int, tuple[int, float]] = {}
        self._pending_tokens = 0
        self._tickets = itertools.count(1)
        self._admitted: StateKey[int] = StateKey(f"{name}/admitted")
        #: Counters for tests and operators.
        self.stats = {"admitted": 0, "waited": 0, "rejected_full": 0, "timed_out": 0}
        self.clock = time.monotonic

    # -- pure checks -------------------------------------------------------------------------
    def _pool(self, role: Role) -> list[EndpointId]:
        return [ep for ep, r in self.roles.items() if r in (role, Role.BOTH)]

    def saturated(self) -> bool:
        """Both pools saturated (an empty pool counts as saturated only if the other is)."""
        tracker = self.scorer.tracker
        prefill = self._pool(Role.PREFILL)
        decode = self._pool(Role.DECODE)
        if not prefill and not decode:
            return False
        self._sweep()
        pending = self._pending_tokens
        p_full = all(prefill_saturated(tracker.load(e), pending, self.p.max_prefill_tokens)
                     for e in prefill)
        d_full = all(decode_saturated(tracker.load(e), self.p.max_decode_requests,
                                      self.p.max_decode_tokens) for e in decode)
        return p_full and d_full

    def _retry_after(self) -> dict[str, str]:
        return {"retry-after": str(self.p.retry_after_s)}

    # -- RequestHook -------------------------------------------------------------------------
    async def on_request(self, req: InferenceRequest, state: CycleState) -> None:
        if self._queue or self.saturated():
            await self._wait()
        ticket = next(self._tickets)
        self._pending[ticket] = (req.prompt_token_estimate, self.clock())
        self._pending_tokens += req.prompt_token_estimate
        state.put(self._admitted, ticket)
        self.stats["admitted"] += 1

    async def _wait(self) -> None:
        if len(self._queue) >= self.p.max_waiting:
            self.stats["rejected_full"] += 1
            raise RateLimited("all engines are at capacity and the admission queue is full",
                              headers=self._retry_after())
        ticket = object()
        self._queue.append(ticket)
        self.stats["waited"] += 1
        deadline = self.clock() + self.p.max_wait_s
        try:
            while self._queue[0] is not ticket or self.saturated():
                remaining = deadline - self.clock()
                if remaining <= 0:
                    self.stats["timed_out"] += 1
                    raise Overloaded(f"all engines stayed at capacity for {self.p.max_wait_s} s",
                                     headers=self._retry_after())
                wake = self._wake
                with contextlib.suppress(TimeoutError):  # woken, or time to re-check
                    await asyncio.wait_for(wake.wait(), min(remaining, self.p.poll_s))
        finally:
            self._queue.remove(ticket)
            self._notify()

    def _notify(self) -> None:
        self._wake.set()
        self._wake = asyncio.Event()

    def _settle(self, state: CycleState) -> None:
        ticket = state.get(self._admitted)
        entry = None if ticket is None else self._pending.pop(ticket, None)
        if entry is not None:
            self._pending_tokens -= entry[0]

    def _sweep(self) -> None:
        cutoff = self.clock() - PENDING_TTL_S
        while self._pending:
            ticket, (tokens, at) = next(iter(self._pending.items()))
            if at > cutoff:
                break
            del self._pending[ticket]
            self._pending_tokens -= tokens

    # -- DispatchHook / CompletionHook -------------------------------------------------------
    async def before_dispatch(
        self, req: InferenceRequest, state: CycleState, decision: RoutingDecision
    ) -> None:
        self._settle(state)  # from now on the token-load tracker carries its load

    async def on_complete(
        self, req: InferenceRequest, state: CycleState, target: Endpoint, outcome: Outcome
    ) -> None:
        self._settle(state)
        self._notify()

    async def on_prefill_done(
        self, req: InferenceRequest, state: CycleState, prefill: Endpoint, ok: bool
    ) -> None:
        self._notify()  # the token-load scorer (declared first) released the prefill load

    # -- EndpointSetListener -----------------------------------------------------------------
    def on_endpoints_changed(
        self, added: Sequence[Endpoint], removed: Sequence[Endpoint]
    ) -> None:
        for ep in removed:
            self.roles.pop(ep.id, None)
        for ep in added:
            self.roles[ep.id] = ep.role
