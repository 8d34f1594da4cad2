"""pd-admission: requests wait while both pools are saturated; bounded queue; 429/503."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from kvgate.middleware.framework.errors import Overloaded, RateLimited
from kvgate.middleware.framework.types import (
    Api,
    CycleState,
    Endpoint,
    InferenceRequest,
    Outcome,
    OutcomeKind,
    Role,
)
from kvgate.plugins.load.loads import Charge
from kvgate.plugins.load.token_load import TokenLoadScorer
from kvgate.plugins.pd.admission import PdAdmission


class _Lookup:
    def __init__(self, objs: dict[str, object]) -> None:
        self.objs = objs

    def lookup(self, name: str) -> object:
        return self.objs[name]


def _setup(**params: Any) -> tuple[TokenLoadScorer, PdAdmission]:
    scorer = TokenLoadScorer("token-load-scorer", TokenLoadScorer.Params(), _Lookup({}))
    adm = PdAdmission("pd-admission", PdAdmission.Params(**params),
                      _Lookup({"token-load-scorer": scorer}))
    adm.on_endpoints_changed(
        [Endpoint("p0", "http://p0", "vllm", role=Role.PREFILL),
         Endpoint("d0", "http://d0", "vllm", role=Role.DECODE)], [])
    return scorer, adm


def _req(tokens: int = 100) -> InferenceRequest:
    return InferenceRequest("r", Api.CHAT, "m", {}, {}, False, False, tokens, time.monotonic())


DONE = Outcome(OutcomeKind.DONE, 200)

# (case, prefill tokens on p0, decode requests on d0, decode tokens on d0, saturated)
CASES = [
    ("idle", 0, 0, 0, False),
    ("prefill full only", 1000, 0, 0, False),
    ("decode full only", 0, 2, 0, False),
    ("both full", 1000, 2, 0, True),
    ("decode tokens full", 1000, 0, 500, True),
    ("just under", 999, 1, 499, False),
]


@pytest.mark.parametrize(("case", "pre", "dreq", "dtok", "full"), CASES,
                         ids=[c[0] for c in CASES])
def test_saturation(case: str, pre: int, dreq: int, dtok: int, full: bool) -> None:
    scorer, adm = _setup(max_prefill_tokens=1000, max_decode_requests=2, max_decode_tokens=500)
    if pre:
        scorer.tracker.charge("x", [Charge("p0", pre, 0)], 0.0)
    for i in range(dreq):
        scorer.tracker.charge(f"d{i}", [Charge("d0", 0, 0)], 0.0)
    if dtok:
        scorer.tracker.charge("y", [Charge("d0", 0, dtok)], 0.0)
    assert adm.saturated() is full


def _saturate(scorer: TokenLoadScorer) -> int:
    return scorer.tracker.charge("busy", [Charge("p0", 1000, 0), Charge("d0", 0, 500)],
                                 time.monotonic())


async def test_waits_until_a_completion_frees_capacity() -> None:
    scorer, adm = _setup(max_prefill_tokens=1000, max_decode_tokens=500, poll_s=10)
    ticket = _saturate(scorer)
    order: list[int] = []

    async def admit(i: int) -> None:
        await adm.on_request(_req(1), CycleState())
        order.append(i)

    tasks = [asyncio.create_task(admit(i)) for i in range(3)]
    await asyncio.sleep(0.05)
    assert order == [] and adm.stats["waited"] == 3
    scorer.tracker.release(ticket)
    await adm.on_complete(_req(), CycleState(), Endpoint("d0", "u", "vllm"), DONE)
    await asyncio.wait_for(asyncio.gather(*tasks), 2)
    assert order == [0, 1, 2]  # first come, first served


async def test_queue_bound_answers_429_with_retry_after() -> None:
    scorer, adm = _setup(max_prefill_tokens=1000, max_decode_tokens=500, max_waiting=1,
                         retry_after_s=3)
    _saturate(scorer)
    waiter = asyncio.create_task(adm.on_request(_req(), CycleState()))
    await asyncio.sleep(0.01)
    with pytest.raises(RateLimited) as info:
        await adm.on_request(_req(), CycleState())
    assert info.value.status == 429 and info.value.headers == {"retry-after": "3"}
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    assert len(adm._queue) == 0


async def test_wait_bound_answers_503_with_retry_after() -> None:
    scorer, adm = _setup(max_prefill_tokens=1000, max_decode_tokens=500, max_wait_s=0.05,
                         poll_s=0.01)
    _saturate(scorer)
    with pytest.raises(Overloaded) as info:
        await adm.on_request(_req(), CycleState())
    assert info.value.status == 503 and "retry-after" in info.value.headers
    assert adm.stats["timed_out"] == 1


async def test_admitted_but_undispatched_prompts_count_until_dispatch() -> None:
    scorer, adm = _setup(max_prefill_tokens=1000, max_decode_tokens=500)
    scorer.tracker.charge("busy", [Charge("d0", 0, 500)], time.monotonic())  # decode full
    state = CycleState()
    await adm.on_request(_req(1000), state)  # admitted: prefill had room
    assert adm.saturated()  # its prompt now fills the prefill pool
    await adm.before_dispatch(_req(), state, None)  # type: ignore[arg-type]
    assert not adm.saturated()
    # a request that never reaches dispatch is swept
    await adm.on_request(_req(1000), CycleState())
    assert adm.saturated()
    adm.clock = lambda: time.monotonic() + 60
    assert not adm.saturated()
