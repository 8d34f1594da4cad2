"""The codec's pure-Python parts (no torch: they run in the gateway's venv too): length-limited
canonical Huffman tables and the block container. The device steps are tested in the engine
venv by tests/e2e/test_kvcodec_e2e.py."""

from __future__ import annotations

import math
import random
import struct
from fractions import Fraction

import pytest

from kvgate.engines.kvcodec import container
from kvgate.engines.kvcodec.huffman import _huffman_lengths, canonical_codes, code_lengths

SEED = 20261125


def _histograms() -> list[tuple[str, list[int]]]:
    rng = random.Random(SEED)
    geometric = [max(1, 1 << max(0, 20 - s)) for s in range(256)]  # needs > 12 bits unlimited
    kv_like = [0] * 256
    for _ in range(6144):
        kv_like[min(255, max(0, round(rng.gauss(120, 1.5))))] += 1
    return [("one symbol", [0] * 7 + [5] + [0] * 248),
            ("two symbols", [3] + [0] * 254 + [9]),
            ("uniform 256", [1] * 256),
            ("geometric 256", geometric),
            ("kv-like", kv_like),
            ("random", [rng.randrange(0, 50) for _ in range(256)])]


@pytest.mark.parametrize(("name", "counts"), _histograms())
@pytest.mark.parametrize("max_len", [8, 12, 15])
def test_tables_are_complete_prefix_free_and_limited(name: str, counts: list[int],
                                                     max_len: int) -> None:
    lengths = code_lengths(counts, max_len)
    present = [s for s in range(256) if counts[s]]
    assert [s for s in range(256) if lengths[s]] == present, name
    assert max(lengths) <= max_len
    codes = canonical_codes(lengths)
    words = {format(codes[s], f"0{lengths[s]}b") for s in present}
    assert len(words) == len(present)
    assert not any(a != b and b.startswith(a) for a in words for b in words)  # prefix-free
    kraft = sum(Fraction(1, 1 << lengths[s]) for s in present)
    assert kraft == (Fraction(1, 2) if len(present) == 1 else 1)  # complete: no wasted code


def test_the_length_limit_binds_on_extreme_skew_and_costs_little() -> None:
    """Counts from 2**20 down to 1: plain Huffman wants 21-bit codes; halving the counts until
    the tree fits 12 bits costs a few percent of bits on this deliberately extreme histogram
    (5.1 %; deterministic), none on KV-like exponents (next test)."""
    counts = dict(_histograms())["geometric 256"]
    free, limited = _huffman_lengths(counts), code_lengths(counts, 12)
    assert max(free) == 21 and max(limited) == 12
    cost = [sum(c * n for c, n in zip(counts, ls, strict=True)) for ls in (free, limited)]
    assert cost[0] < cost[1] <= cost[0] * 1.06


def test_kv_like_exponents_cost_about_their_entropy() -> None:
    counts = dict(_histograms())["kv-like"]
    total = sum(counts)
    entropy = -sum(c / total * math.log2(c / total) for c in counts if c)
    bits = sum(c * n for c, n in zip(counts, code_lengths(counts, 12), strict=True)) / total
    assert entropy <= bits < entropy + 0.1


def _coded_blob() -> bytes:
    lengths = [0] * 256
    lengths[120], lengths[121], lengths[122] = 1, 2, 2
    return container.pack_coded(5, 4, 12, lengths, struct.pack("<2I", 1, 2), b"abcde", b"\x00\x80")


def test_container_round_trips_its_fields() -> None:
    block = container.parse(_coded_blob())
    assert (block.mode, block.n_values, block.chunk, block.max_len, block.n_chunks) == (
        container.MODE_CODED, 5, 4, 12, 2)
    assert block.lengths[120:123] == [1, 2, 2] and sum(block.lengths) == 5
    assert (block.sm, block.stream) == (b"abcde", b"\x00\x80")
    raw = container.parse(container.pack_raw(3, 512, b"\x01\x02" * 3))
    assert (raw.mode, raw.raw) == (container.MODE_RAW, b"\x01\x02" * 3)
    assert container.coded_size(5, 4, block.lengths, 2) == len(_coded_blob())


@pytest.mark.parametrize(("name", "blob"), [
    ("empty", b""),
    ("bad magic", b"XXXX" + _coded_blob()[4:]),
    ("truncated stream", _coded_blob()[:-1]),
    ("trailing byte", _coded_blob() + b"\x00"),
    ("short raw", container.pack_raw(3, 512, b"\x01\x02" * 2)),
    ("unknown mode", _coded_blob()[:4] + b"\x07" + _coded_blob()[5:]),
])
def test_container_rejects_what_it_did_not_write(name: str, blob: bytes) -> None:
    with pytest.raises(container.CodecFormatError):
        container.parse(blob)


def test_code_lengths_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="256 counts"):
        code_lengths([1] * 255, 12)
    with pytest.raises(ValueError, match="max_len"):
        code_lengths([1] * 256, 7)
