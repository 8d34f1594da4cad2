"""Length-limited canonical Huffman codes over the 256 exponent values (host side, pure Python).

Algorithm: plain Huffman (a heap of subtree weights) gives each present symbol a code length;
when the longest exceeds ``max_len`` the counts are halved (rounding up, so a present symbol
stays present) and the tree is rebuilt, until it fits. Halving flattens the distribution, and
with ``max_len >= 8`` it always terminates: equal counts give lengths <= 8 for 256 symbols.
The loss against an optimal length-limited code (package-merge) is tiny here because real KV
exponents need far fewer than ``max_len`` bits except for rare symbols.
Canonical codes: symbols sorted by (length, symbol) get consecutive codes, shifted left when
the length grows, so the lengths alone describe the code (the block's table stores only them).
A block with a single distinct exponent gives it a 1-bit code.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

SYMBOLS = 256


def _huffman_lengths(counts: Sequence[int]) -> list[int]:
    present = [s for s in range(SYMBOLS) if counts[s] > 0]
    lengths = [0] * SYMBOLS
    if len(present) == 1:
        lengths[present[0]] = 1
        return lengths
    # Heap items: (weight, tie-breaker, symbols in the subtree); each merge deepens its symbols.
    heap = [(counts[s], s, [s]) for s in present]
    heapq.heapify(heap)
    tie = SYMBOLS
    while len(heap) > 1:
        w1, _, s1 = heapq.heappop(heap)
        w2, _, s2 = heapq.heappop(heap)
        for s in s1 + s2:
            lengths[s] += 1
        heapq.heappush(heap, (w1 + w2, tie, s1 + s2))
        tie += 1
    return lengths


def code_lengths(counts: Sequence[int], max_len: int) -> list[int]:
    """Code length per symbol (0 = absent) for a histogram of 256 counts, none > ``max_len``."""
    if len(counts) != SYMBOLS or max_len < 8:
        raise ValueError("code_lengths needs 256 counts and max_len >= 8")
    if not any(counts):
        return [0] * SYMBOLS
    work = list(counts)
    while True:
        lengths = _huffman_lengths(work)
        if max(lengths) <= max_len:
            return lengths
        work = [(c + 1) // 2 for c in work]


def canonical_codes(lengths: Sequence[int]) -> list[int]:
    """The canonical code of each symbol (MSB first, ``lengths[s]`` bits; 0 where absent)."""
    codes = [0] * SYMBOLS
    code, prev = 0, 0
    for length, symbol in sorted((n, s) for s, n in enumerate(lengths) if n > 0):
        code <<= length - prev
        codes[symbol] = code
        code += 1
        prev = length
    return codes
