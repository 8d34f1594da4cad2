"""Shared-tier awareness: the credit derived from the link and prefill speed, and the tier
folded into the prefix match (nothing changes without a tier)."""

from __future__ import annotations

import pytest

from kvgate.plugins.common.state import PrefixMatch
from kvgate.plugins.prefix.shared_tier import TierLink, fold_shared


@pytest.mark.parametrize(("link", "credit"), [
    ({}, 1 - (131_072 / 25e9) / (263e-3 / 8192)),  # RDMA 25 GB/s: about 0.84
    ({"link_bytes_per_s": 6e9}, 1 - (131_072 / 6e9) / (263e-3 / 8192)),  # NVMe-class: 0.32
    ({"link_bytes_per_s": 1e9}, 0.0),  # slower than recomputing: worth nothing
    ({"link_bytes_per_s": 1e18}, pytest.approx(1.0)),
])
def test_credit_is_one_minus_load_over_prefill(link: dict[str, float], credit: float) -> None:
    assert TierLink(**link).credit == pytest.approx(credit)


def test_default_credit_sits_between_recompute_and_a_gpu_hit() -> None:
    assert 0.8 < TierLink().credit < 0.9


def _match() -> PrefixMatch:
    return PrefixMatch(1000, {"a": 512, "b": 0, "c": 0}, {"c": 256}, True,
                       frozenset({"a", "b", "c"}))


def test_no_tier_leaves_the_match_unchanged() -> None:
    m = _match()
    assert fold_shared(m, 0, ["a", "b", "c"]) is m


@pytest.mark.parametrize(("shared", "other"), [
    (768, {"a": 256, "b": 768, "c": 768, "d": 768}),
    (512, {"a": 0, "b": 512, "c": 512, "d": 512}),
    (128, {"a": 0, "b": 128, "c": 256, "d": 128}),  # c's own slower tier holds more
])
def test_the_tier_counts_beyond_each_engines_gpu(shared: int, other: dict[str, int]) -> None:
    folded = fold_shared(_match(), shared, ["a", "b", "c", "d"])  # d: no match of its own
    assert folded.other == other
    assert folded.device == _match().device and folded.precise
