"""The torch reference of the codec's four device steps (any torch device; the CPU in CI).

Same algorithm and same bytes as the Triton kernels (:mod:`kvgate.engines.kvcodec.kernels`), written
with whole-tensor torch operations:

* :func:`split` / :func:`merge`: BF16 word <-> (sign+mantissa byte, exponent byte).
* :func:`encode_chunks`: every chunk's Huffman bits, MSB first, from a byte boundary: each
  symbol's bit offset in its chunk is an exclusive prefix sum of code lengths, its code's bits
  are scattered to a zeroed bit buffer and the bits are packed eight to a byte.
* :func:`decode_chunks`: one lane per chunk, all lanes advancing together: peek ``max_len``
  bits at the lane's bit position, look the window up in the block's table (symbol and code
  length, :func:`kvgate.engines.kvcodec.tables.single_luts`), advance by the length. One symbol
  per lookup: the plain algorithm, the oracle of the kernels' multi-symbol one.
* :func:`code_lengths`: the blocks' length-limited Huffman code lengths, all blocks at once
  (:mod:`kvgate.engines.kvcodec.tables`; the same lengths as ``huffman.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvgate.engines.kvcodec import tables


def split(words: Tensor) -> tuple[Tensor, Tensor]:
    """(sign+mantissa, exponent) uint8 tensors of a BF16 tensor's words."""
    w = words.view(torch.int16).to(torch.int32) & 0xFFFF
    sm = ((w >> 8) & 0x80) | (w & 0x7F)
    return sm.to(torch.uint8), ((w >> 7) & 0xFF).to(torch.uint8)


def merge(sm: Tensor, exp: Tensor) -> Tensor:
    """The BF16 tensor whose words have these sign+mantissa and exponent bytes."""
    s, e = sm.to(torch.int32), exp.to(torch.int32)
    w = ((s & 0x80) << 8) | (e << 7) | (s & 0x7F)
    return w.to(torch.int16).view(torch.bfloat16)  # int32 -> int16 keeps the low 16 bits


def _chunked(x: Tensor, chunk: int) -> Tensor:
    """(B, N) -> (B, C, chunk), zero-padded."""
    b, n = x.shape
    c = -(-n // chunk)
    out = torch.zeros((b, c * chunk), dtype=x.dtype, device=x.device)
    out[:, :n] = x
    return out.view(b, c, chunk)


def encode_chunks(exp: Tensor, codes: Tensor, lengths: Tensor, chunk: int,
                  max_len: int) -> tuple[Tensor, Tensor]:
    """(B, C, cap) uint8 chunk buffers and (B, C) int32 byte counts; cap = chunk*max_len/8."""
    e = exp.to(torch.int64)
    ln = _chunked(torch.gather(lengths.to(torch.int64), 1, e), chunk)  # padding: length 0
    cd = _chunked(torch.gather(codes.to(torch.int64), 1, e), chunk)
    b, c, _ = ln.shape
    cap = -(-chunk * max_len // 8)
    start = torch.cumsum(ln, dim=2) - ln
    bits = torch.zeros((b, c, cap * 8 + max_len), dtype=torch.uint8, device=exp.device)
    for j in range(max_len):
        live = j < ln
        value = ((cd >> (ln - 1 - j).clamp(min=0)) & 1).to(torch.uint8) * live
        pos = torch.where(live, start + j, cap * 8 + j)  # dead bits land in the spare tail
        bits.scatter_(2, pos, value)
    weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.int32, device=exp.device)
    packed = (bits[:, :, :cap * 8].view(b, c, cap, 8).to(torch.int32) * weights).sum(dim=3)
    nbytes = (ln.sum(dim=2) + 7) // 8
    return packed.to(torch.uint8), nbytes.to(torch.int32)


def code_lengths(hist: Tensor, max_len: int) -> Tensor:
    """(B, 256) int64 code lengths of (B, 256) exponent counts, none above ``max_len``."""
    return tables.limited_lengths(hist, max_len)


def decode_chunks(stream: Tensor, starts: Tensor, lengths: Tensor, codes: Tensor, n: int,
                  chunk: int, max_len: int) -> Tensor:
    """(B, N) uint8 exponents from the flat stream (padded with >= 3 zero bytes).

    ``starts``: (B, C) int64 byte offset of each chunk in ``stream``; ``lengths`` / ``codes``:
    (B, 256) each block's code lengths and canonical codes.
    """
    luts = tables.single_luts(lengths, codes, max_len)
    b, c = starts.shape
    lane_block = torch.arange(b, device=stream.device).repeat_interleave(c)
    base = starts.reshape(-1)
    count = (n - torch.arange(c, device=stream.device) * chunk).clamp(max=chunk).repeat(b)
    pos = torch.zeros_like(base)
    s = stream.to(torch.int64)
    out = torch.zeros((b * c, chunk), dtype=torch.uint8, device=stream.device)
    mask = (1 << max_len) - 1
    for i in range(chunk):
        at = base + (pos >> 3)
        window = (s[at] << 16) | (s[at + 1] << 8) | s[at + 2]
        index = (window >> (24 - max_len - (pos & 7))) & mask
        entry = luts[lane_block, index].to(torch.int64)
        live = i < count
        out[:, i] = torch.where(live, entry & 0xFF, 0).to(torch.uint8)
        pos = pos + torch.where(live, entry >> 8, 0)
    return out.view(b, c * chunk)[:, :n]
