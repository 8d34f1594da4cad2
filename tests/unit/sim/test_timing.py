"""Timing model: calibration against H100_TIMING.md and monotonic growth with load."""

from __future__ import annotations

import pytest

from kvgate.engines.sim.core.config import TimingParams
from kvgate.engines.sim.core.timing import Chunk, TimingModel

MODEL = TimingModel(TimingParams())


@pytest.mark.parametrize(
    ("prompt", "measured_s"),
    # H100_TIMING.md: batch-1 prefill of a whole prompt.
    [(512, 0.030), (2048, 0.063), (8192, 0.263), (16384, 0.594), (32768, 1.408)],
)
def test_prefill_calibration_within_ten_percent(prompt: int, measured_s: float) -> None:
    assert MODEL.prefill_seconds(prompt) == pytest.approx(measured_s, rel=0.10)


@pytest.mark.parametrize(
    ("batch", "context", "expected_s"),
    # H100_TIMING.md: 32 sequences at 8k ≈ 17 ms per step; batch 1 at 2k ≈ 5.5 ms.
    [(32, 8192, 0.017), (1, 2048, 0.0055)],
)
def test_decode_calibration(batch: int, context: int, expected_s: float) -> None:
    assert MODEL.decode_step_seconds([context] * batch) == pytest.approx(expected_s, rel=0.05)


@pytest.mark.parametrize("context", [0, 1024, 8192])
def test_decode_grows_with_batch(context: int) -> None:
    times = [MODEL.decode_step_seconds([context] * b) for b in (1, 2, 8, 64, 512)]
    assert times == sorted(times)
    assert times[-1] > times[0]


@pytest.mark.parametrize("batch", [1, 8, 64])
def test_decode_grows_with_context(batch: int) -> None:
    times = [MODEL.decode_step_seconds([c] * batch) for c in (0, 1000, 10_000, 100_000)]
    assert times == sorted(times) and times[-1] > times[0]


@pytest.mark.parametrize("prompt", [256, 2048, 16384])
def test_cached_prefix_makes_prefill_cheaper_but_not_free(prompt: int) -> None:
    cold = MODEL.prefill_seconds(prompt)
    warm = MODEL.prefill_seconds(prompt, cached_tokens=prompt - 64)
    assert warm < cold
    assert warm > MODEL.prefill_seconds(64)  # attention over the cached prefix still costs


@pytest.mark.parametrize("decodes", [16, 128])
def test_a_step_shared_by_prefill_and_decodes_is_slower_than_either(decodes: int) -> None:
    busy = [Chunk(1, 4096)] * decodes
    prefill = Chunk(2048, 0)
    both = MODEL.step_seconds([*busy, prefill])
    assert both > MODEL.step_seconds([prefill])
    assert both > MODEL.step_seconds(busy)


def test_empty_step_is_free() -> None:
    assert MODEL.step_seconds([]) == 0.0
