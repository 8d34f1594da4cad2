"""Replay benchmark: reference hit ratios (ideal, pooled LRU), measured ratios, percentiles."""

from __future__ import annotations

import pytest

from bench.replay_metrics import (
    hit_ratio,
    imbalance,
    lru_hit_ratio,
    parse_prometheus,
    percentile,
    reference,
)
from bench.replay_trace import TRACE_BLOCK, TraceRequest

B = TRACE_BLOCK


def req(i: int, ids: list[int], length: int | None = None) -> TraceRequest:
    return TraceRequest(i, i, length if length is not None else len(ids) * B, 1, tuple(ids))


REQS = [req(0, [1, 2]), req(1, [1, 2, 3]), req(2, [4]), req(3, [1, 2, 3, 5])]


@pytest.mark.parametrize(("capacity", "expected_hit_blocks"), [
    (None, 0 + 2 + 0 + 3),  # infinite: every seen prefix hits
    (3, 0 + 2 + 0 + 0),     # [1,2,3] then [4] evicts 1 (LRU): request 3 finds nothing
    (4, 0 + 2 + 0 + 3),     # room for every block looked up
    (1, 0 + 0 + 0 + 0),     # one block: the chain head is always evicted by its own tail
])
def test_lru_hit_ratio_readme_accounting(capacity: int | None, expected_hit_blocks: int) -> None:
    total = sum(r.input_length for r in REQS)
    assert lru_hit_ratio(REQS, capacity) == pytest.approx(expected_hit_blocks * B / total)


def test_lru_order_is_recency_not_insertion() -> None:
    # capacity 3: [1,2] [3] [1] (refreshes 1) [4] evicts 2 (oldest use), not 1
    reqs = [req(0, [1, 2]), req(1, [3]), req(2, [1]), req(3, [4]), req(4, [1]), req(5, [1, 2])]
    hits = [0, 0, B, 0, B, B]  # request 5: 1 hits, 2 was evicted
    total = sum(r.input_length for r in reqs)
    assert lru_hit_ratio(reqs, 3) == pytest.approx(sum(hits) / total)


@pytest.mark.parametrize(("length", "readme", "engine"), [
    # second request repeats a 1.5-block prompt: README counts it all, an engine only the
    # full first block (partial blocks are not cached)
    (B + B // 2, 1.0, B / (B + B // 2)),
    # exact 2-block repeat: the engine computes the last token, so only 1 block hits
    (2 * B, 1.0, 0.5),
])
def test_engine_view_accounting(length: int, readme: float, engine: float) -> None:
    ids = [1, 2]
    reqs = [req(0, ids, length), req(1, ids, length)]
    assert lru_hit_ratio(reqs, None) == pytest.approx(readme / 2)
    assert lru_hit_ratio(reqs, None, engine_view=True) == pytest.approx(engine / 2)


def test_reference_bundles_ideal_and_pooled() -> None:
    ref = reference(REQS, 4)
    assert ref.ideal == lru_hit_ratio(REQS, None)
    assert ref.pooled_lru == lru_hit_ratio(REQS, 4)
    assert ref.ideal >= ref.pooled_lru
    assert ref.capacity_blocks == 4 and not ref.engine_view


@pytest.mark.parametrize(("cached", "prompt", "expected"), [
    ([0, 50, 100], [100, 100, 200], 0.375),
    ([None, 10], [10, 10], None),  # unknown is not zero
    ([0], [0], None),
])
def test_hit_ratio(cached: list[int | None], prompt: list[int], expected: float | None) -> None:
    assert hit_ratio(cached, prompt) == expected


@pytest.mark.parametrize(("loads", "expected"), [
    ({"a": 10.0, "b": 10.0}, 1.0),
    ({"a": 30.0, "b": 10.0}, 1.5),
    ({"a": 0.0, "b": 0.0}, None),
    ({}, None),
])
def test_imbalance(loads: dict[str, float], expected: float | None) -> None:
    assert imbalance(loads) == expected


@pytest.mark.parametrize(("values", "q", "expected"), [
    ([3.0, 1.0, 2.0], 50, 2.0), ([1.0, 2.0], 50, 1.5), ([5.0], 99, 5.0), ([], 50, None),
    ([1.0, 2.0, 3.0, 4.0, 5.0], 90, 4.6),
])
def test_percentile(values: list[float], q: float, expected: float | None) -> None:
    assert percentile(values, q) == (None if expected is None else pytest.approx(expected))


def test_parse_prometheus_sums_labels() -> None:
    text = """# HELP x y
vllm:prompt_tokens_total{engine="a",model_name="m"} 100.0
vllm:prompt_tokens_total{engine="b",model_name="m"} 20
vllm:prompt_tokens_cached_total{engine="a"} 5.0
other 1
"""
    got = parse_prometheus(text, ["vllm:prompt_tokens_total", "vllm:prompt_tokens_cached_total",
                                  "missing"])
    assert got == {"vllm:prompt_tokens_total": 120.0, "vllm:prompt_tokens_cached_total": 5.0,
                   "missing": 0.0}
