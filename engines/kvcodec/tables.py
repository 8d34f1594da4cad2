"""Huffman tables for a whole batch of blocks on the device (torch; any device, no per-block
Python). Same code lengths as :mod:`kvgate.engines.kvcodec.huffman` (the host oracle), bit for bit.

* :func:`huffman_lengths`: plain Huffman code lengths of every block at once, by the two-queue
  construction (leaves sorted by (count, symbol), internal nodes in creation order, a leaf
  taken before a node of equal weight). This is exactly the order in which ``huffman.py``'s
  heap of ``(weight, tie, ...)`` items pops (a leaf's tie is its symbol, < 256; a node's tie is
  256 + its creation index, and nodes are created in non-decreasing weight), so the trees and
  the lengths are the same. The loop runs the fullest block's merge steps (present symbols - 1:
  about 15 for real K/V, 255 at most) over all blocks together (tensors of shape (B,)); masked
  writes go to a spare column instead of branching.
* :func:`limited_lengths`: the length limit as ``huffman.py`` does it: blocks whose longest code
  exceeds ``max_len`` get their counts halved (rounding up) and are rebuilt, until all fit.
  One host synchronisation per round (real K/V needs one round); ``build`` is the plain
  builder (this module's, or the Triton kernel's).
* :func:`canonical_codes`: canonical codes from lengths: in (length, symbol) order, a symbol's
  code is the Kraft sum of the codes before it, ``sum(2**(15 - l_t)) >> (15 - l_s)``.
* :func:`single_luts` / :func:`multi_luts`: decode lookup tables of ``2**max_len`` entries per
  block: one symbol per entry (``symbol | length << 8``, the reference decoder's) or up to
  :data:`MULTI` whole symbols per entry (the Triton decoder's).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

SYMBOLS = 256
#: Symbols per multi-symbol table entry: 3 x 8 bits of symbols, a 2-bit count and a 4-bit bit
#: count fit an int32; a 12-bit window holds ~4 symbols of real K/V (2.7 bits each on average).
MULTI = 3
#: Bit positions of an int32 multi-symbol entry: symbols at 0, 8, 16; count; bits used.
COUNT_SHIFT, USED_SHIFT = 24, 26
_BIG = (1 << 62)


def _sorted_leaves(counts: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Symbols in (count, symbol) order, their counts, and each block's number present."""
    sym = torch.arange(SYMBOLS, device=counts.device)
    order = torch.argsort(counts * SYMBOLS + sym, dim=1)
    return order, torch.gather(counts, 1, order), (counts > 0).sum(dim=1)


def huffman_lengths(counts: Tensor) -> Tensor:
    """(B, 256) int64 plain Huffman code lengths of (B, 256) counts (a lone symbol gets 1)."""
    counts = counts.to(torch.int64)
    b, dev = counts.shape[0], counts.device
    order, w, m = _sorted_leaves(counts)
    rows = torch.arange(b, device=dev)
    nodes = torch.zeros((b, SYMBOLS), dtype=torch.int64, device=dev)  # column 255: spare
    leaf_parent = torch.zeros((b, SYMBOLS + 1), dtype=torch.int64, device=dev)  # 256: spare
    node_parent = torch.zeros((b, SYMBOLS), dtype=torch.int64, device=dev)  # 255: spare
    li = SYMBOLS - m  # next leaf (sorted position); absent symbols sort first (count 0)
    ni = torch.zeros_like(m)  # next unmerged node
    steps = int(m.max()) - 1 if b else 0  # merges of the fullest block (real K/V: ~15)
    for k in range(steps):
        live = k < m - 1
        total = torch.zeros_like(m)
        for _ in range(2):
            lw = torch.where(li < SYMBOLS, w[rows, li.clamp(max=SYMBOLS - 1)], _BIG)
            nw = torch.where(ni < k, nodes[rows, ni.clamp(max=SYMBOLS - 2)], _BIG)
            leaf = lw <= nw  # a leaf wins a tie (its heap tie-breaker is smaller)
            leaf_parent[rows, torch.where(live & leaf, li, SYMBOLS)] = k
            node_parent[rows, torch.where(live & ~leaf, ni, SYMBOLS - 1)] = k
            total = total + torch.where(leaf, lw, nw)
            li = li + (live & leaf).to(li.dtype)
            ni = ni + (live & ~leaf).to(ni.dtype)
        nodes[rows, torch.where(live, k, SYMBOLS - 1)] = total
    depth = torch.zeros((b, SYMBOLS), dtype=torch.int64, device=dev)  # the root (m - 2) is 0
    for k in range(steps - 2, -1, -1):
        live = k <= m - 3
        depth[:, k] = torch.where(live, depth[rows, node_parent[:, k]] + 1, depth[:, k])
    return lengths_from_tree(order, m, leaf_parent[:, :SYMBOLS], depth)


def lengths_from_tree(order: Tensor, m: Tensor, leaf_parent: Tensor, depth: Tensor) -> Tensor:
    """(B, 256) int64 lengths by symbol: a present leaf (the last ``m`` sorted positions) is one
    deeper than the node that took it; a lone symbol (no merge) gets length 1."""
    pos = torch.arange(SYMBOLS, device=order.device)
    present = pos >= (SYMBOLS - m).unsqueeze(1)
    deep = torch.gather(depth, 1, leaf_parent) + 1
    sorted_len = torch.where(present, torch.where((m >= 2).unsqueeze(1), deep, 1), 0)
    return torch.zeros_like(order).scatter_(1, order, sorted_len)


def limited_lengths(hist: Tensor, max_len: int,
                    build: Callable[[Tensor], Tensor] = huffman_lengths) -> Tensor:
    """(B, 256) int64 code lengths, none above ``max_len`` (``huffman.code_lengths``'s rule)."""
    if hist.dim() != 2 or hist.shape[1] != SYMBOLS or max_len < 8:
        raise ValueError("limited_lengths needs (B, 256) counts and max_len >= 8")
    work = hist.to(torch.int64, copy=True)  # halved in place below
    out = torch.zeros_like(work)
    todo = torch.arange(work.shape[0], device=work.device)
    while todo.numel():
        lengths = build(work[todo]).to(torch.int64)
        fits = lengths.max(dim=1).values <= max_len
        out[todo[fits]] = lengths[fits]
        todo = todo[~fits]
        work[todo] = (work[todo] + 1) // 2
    return out


def canonical_codes(lengths: Tensor) -> Tensor:
    """(B, 256) int64 canonical codes (``huffman.canonical_codes``; 0 where absent)."""
    lengths = lengths.to(torch.int64)
    sym = torch.arange(SYMBOLS, device=lengths.device)
    present = lengths > 0
    order = torch.argsort(torch.where(present, lengths * SYMBOLS, 16 * SYMBOLS) + sym, dim=1)
    ln = torch.gather(lengths, 1, order)
    weight = torch.where(ln > 0, 1 << (15 - ln).clamp(min=0), 0)
    before = torch.cumsum(weight, dim=1) - weight
    code = torch.where(ln > 0, before >> (15 - ln).clamp(min=0), 0)
    return torch.zeros_like(lengths).scatter_(1, order, code)


def single_luts(lengths: Tensor, codes: Tensor, max_len: int) -> Tensor:
    """(B, 2**max_len) int32 ``symbol | length << 8``: the entry of every ``max_len``-bit window.

    A window's symbol is the one whose left-justified code is the largest not above it.
    """
    lengths, codes = lengths.to(torch.int64), codes.to(torch.int64)
    size = 1 << max_len
    present = lengths > 0
    left = torch.where(present, codes << (max_len - lengths).clamp(min=0), size)
    order = torch.argsort(left, dim=1, stable=True)
    windows = torch.arange(size, device=lengths.device).expand(lengths.shape[0], size)
    at = torch.searchsorted(torch.gather(left, 1, order), windows.contiguous(), right=True) - 1
    symbol = torch.gather(order, 1, at.clamp(min=0))
    return (symbol | (torch.gather(lengths, 1, symbol) << 8)).to(torch.int32)


def multi_luts(lengths: Tensor, codes: Tensor, max_len: int) -> Tensor:
    """(B, 2**max_len) int32 entries: the whole symbols (up to :data:`MULTI`) a ``max_len``-bit
    window starts with, ``s0 | s1 << 8 | s2 << 16 | count << 24 | bits << 26``.

    The first symbol always fits (no code is longer than the window); each next one is read
    from the window shifted past the previous ones and kept only if its code ends inside the
    window. Bits past the window's end are unknown, so a symbol that needs them is left for
    the next lookup.
    """
    single = single_luts(lengths, codes, max_len).to(torch.int64)
    mask = (1 << max_len) - 1
    window = torch.arange(1 << max_len, device=single.device).expand_as(single)
    entry = torch.zeros_like(single)
    used = torch.zeros_like(single)
    count = torch.zeros_like(single)
    going = torch.ones_like(single, dtype=torch.bool)
    for j in range(MULTI):
        e = torch.gather(single, 1, (window << used) & mask)
        ln = e >> 8
        going = going & (used + ln <= max_len)
        entry = entry | torch.where(going, (e & 0xFF) << (8 * j), 0)
        used = used + torch.where(going, ln, 0)
        count = count + going.to(torch.int64)
    return (entry | (count << COUNT_SHIFT) | (used << USED_SHIFT)).to(torch.int32)
