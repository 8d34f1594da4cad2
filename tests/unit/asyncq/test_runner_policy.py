"""The runner's pure policies: the cache-order key and window order, the headroom gate, and
the body a job runs with (table-driven, seeded)."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from kvgate.asyncq.api import Job, JobState
from kvgate.asyncq.headroom import HeadroomParams, gate
from kvgate.asyncq.ordering import order_window, prefix_key
from kvgate.asyncq.runner import run_body
from kvgate.middleware.framework.types import Endpoint, EngineMetrics
from tests.asyncq_helpers import spec

SYS = {"role": "system", "content": "you are a careful reviewer " * 50}


@pytest.mark.parametrize(("a", "b", "same"), [
    ({"model": "m", "messages": [SYS, {"role": "user", "content": "x"}]},
     {"model": "m", "messages": [SYS, {"role": "user", "content": "y"}]}, True),
    ({"model": "m", "messages": [SYS]}, {"model": "n", "messages": [SYS]}, False),
    ({"model": "m", "system": "s", "messages": [{"role": "user", "content": "x"}]},
     {"model": "m", "system": "t", "messages": [{"role": "user", "content": "x"}]}, False),
    ({"model": "m", "instructions": "i", "input": "a"},
     {"model": "m", "instructions": "i", "input": "a"}, True),
    ({"model": "m", "prompt": "p" * 5000 + "a"}, {"model": "m", "prompt": "p" * 5000 + "b"}, True),
    ({"model": "m", "prompt": "short a"}, {"model": "m", "prompt": "short b"}, False),
])
def test_prefix_key(a: dict[str, Any], b: dict[str, Any], same: bool) -> None:
    ka, kb = prefix_key("/v1/x", a), prefix_key("/v1/x", b)
    assert len(ka) == 16 and (ka == kb) is same


def test_prefix_key_without_a_model_is_empty() -> None:
    assert prefix_key("/v1/x", {"messages": []}) == ""


def _job(job_id: str, key: str, priority: int = 0, deadline: float | None = None) -> Job:
    return Job(spec(job_id, prefix_key=key, priority=priority, deadline=deadline),
               JobState.RUNNING, 1, None, None, "r")


def test_window_runs_equal_keys_back_to_back_best_group_first() -> None:
    jobs = [_job("a1", "A"), _job("b1", "B"), _job("c1", ""), _job("a2", "A"),
            _job("b2", "B", priority=3), _job("c2", ""), _job("d1", "D", deadline=5.0)]
    order = [j.spec.id for j in order_window(jobs)]
    assert order == ["b2", "b1", "d1", "a1", "a2", "c1", "c2"]


def test_window_order_is_a_permutation_grouping_keys() -> None:
    rng = random.Random(7)
    jobs = [_job(f"j{i}", rng.choice("ABCD"), priority=rng.choice([0, 0, 1]))
            for i in range(200)]
    order = order_window(jobs)
    assert sorted(j.spec.id for j in order) == sorted(j.spec.id for j in jobs)
    keys = [j.spec.prefix_key for j in order]
    runs = [k for i, k in enumerate(keys) if i == 0 or keys[i - 1] != k]
    assert sorted(runs) == sorted(set(keys))  # each key one contiguous run


def _ep(name: str, in_flight: int, waiting: float | None = None, kv: float | None = None,
        healthy: bool = True) -> Endpoint:
    return Endpoint(id=name, url="http://x", kind="vllm", healthy=healthy,
                    in_flight_requests=in_flight,
                    metrics=EngineMetrics(waiting=waiting, kv_usage=kv))


@pytest.mark.parametrize(("eps", "own", "reason"), [
    ([_ep("a", 0), _ep("b", 0)], 0, "open"),
    ([_ep("a", 2), _ep("b", 0)], 0, "open"),             # 1 live per engine: not above
    ([_ep("a", 3), _ep("b", 0)], 0, "live_load"),
    ([_ep("a", 5), _ep("b", 3)], 6, "open"),              # 8 in flight, 6 ours: 1 live/engine
    ([_ep("a", 4), _ep("b", 4)], 8, "job_slots"),         # 4 jobs per engine already
    ([_ep("a", 0, waiting=1), _ep("b", 0)], 0, "engine_waiting"),
    ([_ep("a", 0, kv=0.95), _ep("b", 0, kv=0.9)], 0, "kv_usage"),
    ([_ep("a", 0, kv=0.8), _ep("b", 0)], 0, "open"),      # b reports none: a's figure counts
    ([_ep("a", 0, healthy=False)], 0, "no_engine"),
    ([], 0, "no_engine"),
])
def test_headroom_gate(eps: list[Endpoint], own: int, reason: str) -> None:
    params = HeadroomParams(max_live_per_engine=1.0, max_jobs_per_engine=4)
    verdict = gate(eps, own, params)
    assert verdict.reason == reason and verdict.open is (reason == "open")


@pytest.mark.parametrize(("body", "expected"), [
    ({"model": "m", "stream": True, "stream_options": {"include_usage": True}}, {"model": "m"}),
    ({"model": "m", "background": True, "store": True}, {"model": "m", "store": True}),
    ({"model": "m"}, {"model": "m"}),
])
def test_run_body_is_not_streamed_nor_backgrounded(body: dict[str, Any],
                                                   expected: dict[str, Any]) -> None:
    assert json.loads(run_body(json.dumps(body).encode())) == expected


@pytest.mark.parametrize(("eps", "own", "reason"), [
    ([_ep("a", 0), _ep("b", 0)], 0, "open"),
    ([_ep("a", 1), _ep("b", 0)], 0, "live_load"),     # any live request in flight
    ([_ep("a", 2), _ep("b", 1)], 3, "open"),          # only our own jobs
    ([_ep("a", 2), _ep("b", 2)], 4, "job_slots"),     # 2 jobs per engine
])
def test_headroom_defaults_start_jobs_only_in_live_gaps(eps: list[Endpoint], own: int,
                                                        reason: str) -> None:
    assert gate(eps, own, HeadroomParams()).reason == reason


def test_run_body_keeps_bytes_it_cannot_parse() -> None:
    assert run_body(b"not json") == b"not json"
