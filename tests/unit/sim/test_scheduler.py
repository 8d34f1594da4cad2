"""Scheduler: chunked prefill, budgets, prefix hits, KV events, preemption, determinism."""

from __future__ import annotations

import random

import pytest

from kvgate.engines.sim.core.config import SimConfig
from kvgate.engines.sim.core.kv_events import BlockRemoved, BlockStored, KvEvent
from kvgate.engines.sim.core.scheduler import Scheduler, SeqSpec, SeqState, Status, TokenOut


def _prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(16, 32_000) for _ in range(n)]


def _spec(rid: str, prompt: list[int], max_tokens: int = 4, **kw: object) -> SeqSpec:
    return SeqSpec(rid, prompt, max_tokens, ignore_eos=True, **kw)  # type: ignore[arg-type]


def _run(s: Scheduler, max_steps: int = 10_000) -> dict[str, list[TokenOut]]:
    out: dict[str, list[TokenOut]] = {}
    for _ in range(max_steps):
        if not s.has_work():
            return out
        for seq, tok in s.complete(s.schedule()):
            out.setdefault(seq.request_id, []).append(tok)
    raise AssertionError("did not finish")


def _sched(**kw: object) -> Scheduler:
    return Scheduler(SimConfig(block_size=16, time_scale=0, **kw))


@pytest.mark.parametrize(("prompt", "budget", "chunks"), [
    (100, 32, [32, 32, 32, 4]),
    (100, 8192, [100]),
    (64, 64, [64]),
    (1, 16, [1]),
])
def test_chunked_prefill_then_one_token_per_step(
    prompt: int, budget: int, chunks: list[int]
) -> None:
    s = _sched(max_num_batched_tokens=budget)
    s.add(_spec("a", _prompt(prompt), max_tokens=3))
    seen = []
    while s.has_work():
        plan = s.schedule()
        seen.append(plan[0].new)
        s.complete(plan)
    assert seen == [*chunks, 1, 1]  # the prefill samples token 1; two decode steps for 2 and 3


@pytest.mark.parametrize(("prompt_len", "cached"), [(32, 16), (33, 32), (47, 32), (48, 32),
                                                    (49, 48), (10, 0)])
def test_hit_is_block_aligned_and_leaves_one_token(prompt_len: int, cached: int) -> None:
    s = _sched()
    prompt = _prompt(prompt_len)
    s.add(_spec("warm", prompt))
    _run(s)
    seq = s.add(_spec("hit", prompt))
    _run(s)
    assert seq.cached_tokens == cached
    assert s.stats.prefix_cache_hits == cached
    assert s.stats.prefix_cache_queries == 2 * prompt_len


def test_generated_blocks_are_cached_too() -> None:
    """A follow-up prompt = prompt + the answer hits the answer's blocks (multi-turn)."""
    s = _sched()
    prompt = _prompt(40)
    first = s.add(_spec("t1", prompt, max_tokens=30))
    _run(s)
    follow = s.add(_spec("t2", first.tokens + _prompt(5, seed=1)))
    _run(s)
    assert follow.cached_tokens == (len(first.tokens) - 1) // 16 * 16 == 64


@pytest.mark.parametrize(("max_num_seqs", "requests"), [(1, 3), (2, 5), (4, 4)])
def test_running_batch_is_bounded(max_num_seqs: int, requests: int) -> None:
    s = _sched(max_num_seqs=max_num_seqs)
    for i in range(requests):
        s.add(_spec(f"r{i}", _prompt(20, seed=i), max_tokens=5))
    while s.has_work():
        s.complete(s.schedule())
        assert len(s.running) <= max_num_seqs
    assert s.stats.finished["length"] == requests


def test_budget_is_shared_by_decodes_and_prefill() -> None:
    s = _sched(max_num_batched_tokens=64)
    for i in range(3):
        s.add(_spec(f"d{i}", _prompt(10, seed=i), max_tokens=50))
    s.complete(s.schedule())  # three short prefills in one step
    s.add(_spec("long", _prompt(500, seed=9)))
    plan = s.schedule()
    assert [p.new for p in plan] == [1, 1, 1, 61]
    assert sum(p.new for p in plan) == 64


def test_kv_events_chain_and_evictions() -> None:
    s = _sched(capacity_blocks=4, max_model_len=64)
    prompt = _prompt(40)
    s.add(_spec("a", prompt, max_tokens=1))
    _run(s)
    events: list[KvEvent] = s.drain_events()
    assert events == [BlockStored(block_hashes=events[0].block_hashes,  # type: ignore[union-attr]
                                  parent_block_hash=None, token_ids=prompt[:32], block_size=16)]
    stored = events[0].block_hashes  # type: ignore[union-attr]
    s.add(_spec("b", _prompt(60, seed=5), max_tokens=1))
    _run(s)
    events = s.drain_events()
    removed = [e.block_hashes[0] for e in events if isinstance(e, BlockRemoved)]
    assert removed == [stored[1], stored[0]]  # tail of the chain first
    new = [e for e in events if isinstance(e, BlockStored)]
    assert sum(len(e.block_hashes) for e in new) == 3
    assert s.cache.used_blocks == 0


def test_salted_first_block_carries_extra_keys() -> None:
    s = _sched()
    s.add(_spec("a", _prompt(40), cache_salt="tenant-1"))
    _run(s)
    (event,) = s.drain_events()
    assert isinstance(event, BlockStored)
    assert event.extra_keys == [("tenant-1",), None]


def test_preemption_recomputes_and_everything_finishes() -> None:
    # 8 blocks of 16 = 128 tokens; two sequences growing to 32 + 60 tokens each cannot coexist.
    s = _sched(capacity_blocks=8, max_model_len=128)
    seqs = [s.add(_spec(f"r{i}", _prompt(32, seed=i), max_tokens=60)) for i in range(2)]
    out = _run(s)
    assert s.stats.preemptions >= 1
    assert all(len(out[q.request_id]) == 60 for q in seqs)
    assert all(q.status is Status.FINISHED for q in seqs)
    assert s.cache.used_blocks == 0
    # Usage reports the first admission's hit, not the recompute's.
    assert [q.cached_tokens for q in seqs] == [0, 0]


def test_abort_frees_blocks_wherever_the_request_is() -> None:
    s = _sched(max_num_seqs=1)
    running = s.add(_spec("run", _prompt(100), max_tokens=50))
    waiting = s.add(_spec("wait", _prompt(100, seed=1), max_tokens=50))
    s.complete(s.schedule())
    assert s.cache.used_blocks > 0
    assert s.abort(waiting) and s.abort(running)
    assert not s.abort(running)
    assert s.cache.used_blocks == 0 and not s.has_work()
    assert s.stats.finished["abort"] == 2


def test_abort_during_a_step_is_not_completed() -> None:
    s = _sched()
    seq = s.add(_spec("a", _prompt(20)))
    plan = s.schedule()
    s.abort(seq)
    assert s.complete(plan) == []
    assert s.cache.used_blocks == 0


def _texts(seq_seed: int | None, engine_seed: int, prompt_seed: int) -> list[str]:
    s = Scheduler(SimConfig(seed=engine_seed, time_scale=0))
    s.add(SeqSpec("a", _prompt(30, seed=prompt_seed), 12, ignore_eos=True, seed=seq_seed))
    return [t.text for t in _run(s)["a"]]


@pytest.mark.parametrize(("a", "b", "same"), [
    ((None, 0, 0), (None, 0, 0), True),
    ((None, 0, 0), (None, 1, 0), False),
    ((None, 0, 0), (5, 0, 0), False),
    ((None, 0, 0), (None, 0, 1), False),
])
def test_output_is_a_function_of_seeds_and_prompt(
    a: tuple[int | None, int, int], b: tuple[int | None, int, int], same: bool
) -> None:
    assert (_texts(*a) == _texts(*b)) is same


@pytest.mark.parametrize(("ignore_eos", "max_tokens", "min_tokens", "reason"), [
    (True, 300, 0, "length"),
    (False, 300, 0, "stop"),
    (False, 5, 0, "length"),
    (False, 300, 290, "stop"),
])
def test_finish_reasons(ignore_eos: bool, max_tokens: int, min_tokens: int, reason: str) -> None:
    s = Scheduler(SimConfig(time_scale=0, natural_output_len=(20, 40)))
    seq: SeqState = s.add(SeqSpec("a", _prompt(10), max_tokens, ignore_eos=ignore_eos,
                                  min_tokens=min_tokens))
    tokens = _run(s)["a"]
    assert tokens[-1].finish_reason == reason
    assert all(t.finish_reason is None for t in tokens[:-1])
    expected = {"length": max_tokens, "stop": max(seq.natural_len, min_tokens)}[reason]
    assert len(tokens) == expected
