"""Triton kernels of the codec's device steps (GPU; CPU through ``TRITON_INTERPRET=1``).

Same contract and bytes as :mod:`kvgate.engines.kvcodec.reference`:

* ``_split_kernel`` / ``_merge_kernel``: elementwise, ``ELEMS`` words per program.
* ``_encode_kernel``: one lane per chunk, ``LANES`` lanes per program. A lane walks its chunk
  keeping a bit accumulator (< 2**22: at most 7 pending bits plus a 15-bit code) and writes each
  completed byte; a code adds at most 15 bits, so at most two bytes complete per symbol (two
  masked stores). Chunks start on byte boundaries: lanes never write the same byte, no atomics.
* ``_decode_kernel``: one lane per chunk. Per symbol: three byte loads give a 24-bit window
  (``max_len + 7 <= 22`` bits are needed), its ``max_len`` bits at the lane's bit position
  index the block's lookup table (``symbol | length << 8``), the lane advances by ``length``.
  The table (4096 int32 at ``max_len = 12``) is shared by all lanes of a block and stays in
  cache; the loop is a dependent chain per lane, so throughput comes from many lanes (chunks).

Arguments are annotated ``tl.tensor`` (pointers and scalars) or ``tl.constexpr``: Triton's
code generator evaluates annotations and refuses a global such as ``typing.Any`` (the
interpreter does not; :mod:`kvgate.engines.kvcodec.aot` compiles the kernels to catch this).

``LANES = 64`` and ``ELEMS = 1024`` are ordinary Triton block sizes (powers of two, a few
warps); they change the schedule, never the bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

LANES = 64
ELEMS = 1024


@triton.jit  # type: ignore[untyped-decorator]
def _split_kernel(words_ptr: tl.tensor, sm_ptr: tl.tensor, exp_ptr: tl.tensor, total: tl.tensor,
                  elems: tl.constexpr) -> None:
    at = tl.program_id(0).to(tl.int64) * elems + tl.arange(0, elems)
    ok = at < total
    w = tl.load(words_ptr + at, mask=ok, other=0).to(tl.int32) & 0xFFFF
    tl.store(sm_ptr + at, (((w >> 8) & 0x80) | (w & 0x7F)).to(tl.uint8), mask=ok)
    tl.store(exp_ptr + at, ((w >> 7) & 0xFF).to(tl.uint8), mask=ok)


@triton.jit  # type: ignore[untyped-decorator]
def _merge_kernel(sm_ptr: tl.tensor, exp_ptr: tl.tensor, words_ptr: tl.tensor, total: tl.tensor,
                  elems: tl.constexpr) -> None:
    at = tl.program_id(0).to(tl.int64) * elems + tl.arange(0, elems)
    ok = at < total
    s = tl.load(sm_ptr + at, mask=ok, other=0).to(tl.int32)
    e = tl.load(exp_ptr + at, mask=ok, other=0).to(tl.int32)
    w = ((s & 0x80) << 8) | (e << 7) | (s & 0x7F)
    tl.store(words_ptr + at, w.to(tl.int16), mask=ok)


@triton.jit  # type: ignore[untyped-decorator]
def _encode_kernel(exp_ptr: tl.tensor, codes_ptr: tl.tensor, lens_ptr: tl.tensor,
                   out_ptr: tl.tensor, nbytes_ptr: tl.tensor, n: tl.tensor,
                   n_chunks: tl.tensor, n_lanes: tl.tensor, cap: tl.tensor,
                   chunk: tl.constexpr, lanes: tl.constexpr) -> None:
    lane = tl.program_id(0) * lanes + tl.arange(0, lanes)
    ok = lane < n_lanes
    block = lane // n_chunks
    first = (lane % n_chunks) * chunk
    count = tl.minimum(n - first, chunk)
    src = exp_ptr + block.to(tl.int64) * n + first
    table = block * 256
    dst = out_ptr + lane.to(tl.int64) * cap
    one = tl.full([lanes], 1, tl.int32)
    acc = tl.zeros([lanes], tl.int32)
    nb = tl.zeros([lanes], tl.int32)
    opos = tl.zeros([lanes], tl.int32)
    for i in range(chunk):
        live = ok & (i < count)
        sym = tl.load(src + i, mask=live, other=0).to(tl.int32)
        code = tl.load(codes_ptr + table + sym, mask=live, other=0)
        ln = tl.load(lens_ptr + table + sym, mask=live, other=0)
        acc = (acc << ln) | code
        nb = nb + ln
        for _ in tl.static_range(2):
            full = nb >= 8
            byte = (acc >> tl.maximum(nb - 8, 0)) & 0xFF
            tl.store(dst + opos, byte.to(tl.uint8), mask=full & ok)
            opos = opos + full.to(tl.int32)
            nb = nb - 8 * full.to(tl.int32)
        acc = acc & ((one << nb) - 1)
    tail = ok & (nb > 0)
    tl.store(dst + opos, ((acc << (8 - nb)) & 0xFF).to(tl.uint8), mask=tail)
    tl.store(nbytes_ptr + lane, opos + tail.to(tl.int32), mask=ok)


@triton.jit  # type: ignore[untyped-decorator]
def _decode_kernel(stream_ptr: tl.tensor, starts_ptr: tl.tensor, luts_ptr: tl.tensor,
                   out_ptr: tl.tensor, n: tl.tensor, n_chunks: tl.tensor, n_lanes: tl.tensor,
                   chunk: tl.constexpr, max_len: tl.constexpr, lanes: tl.constexpr) -> None:
    lane = tl.program_id(0) * lanes + tl.arange(0, lanes)
    ok = lane < n_lanes
    block = lane // n_chunks
    first = (lane % n_chunks) * chunk
    count = tl.minimum(n - first, chunk)
    base = tl.load(starts_ptr + lane, mask=ok, other=0)
    lut = luts_ptr + block.to(tl.int64) * (1 << max_len)
    dst = out_ptr + block.to(tl.int64) * n + first
    pos = tl.zeros([lanes], tl.int32)
    for i in range(chunk):
        live = ok & (i < count)
        at = stream_ptr + base + (pos >> 3)
        b0 = tl.load(at, mask=live, other=0).to(tl.int32)
        b1 = tl.load(at + 1, mask=live, other=0).to(tl.int32)
        b2 = tl.load(at + 2, mask=live, other=0).to(tl.int32)
        window = (b0 << 16) | (b1 << 8) | b2
        index = (window >> (24 - max_len - (pos & 7))) & ((1 << max_len) - 1)
        entry = tl.load(lut + index, mask=live, other=0)
        tl.store(dst + i, (entry & 0xFF).to(tl.uint8), mask=live)
        pos = pos + (entry >> 8)


def split(words: Tensor) -> tuple[Tensor, Tensor]:
    flat = words.contiguous().view(torch.int16)
    sm = torch.empty(flat.shape, dtype=torch.uint8, device=flat.device)
    exp = torch.empty_like(sm)
    total = flat.numel()
    _split_kernel[(triton.cdiv(total, ELEMS),)](flat, sm, exp, total, elems=ELEMS)
    return sm, exp


def merge(sm: Tensor, exp: Tensor) -> Tensor:
    words = torch.empty(sm.shape, dtype=torch.int16, device=sm.device)
    total = sm.numel()
    _merge_kernel[(triton.cdiv(total, ELEMS),)](sm.contiguous(), exp.contiguous(), words, total,
                                                 elems=ELEMS)
    return words.view(torch.bfloat16)


def encode_chunks(exp: Tensor, codes: Tensor, lengths: Tensor, chunk: int,
                  max_len: int) -> tuple[Tensor, Tensor]:
    b, n = exp.shape
    c = -(-n // chunk)
    cap = -(-chunk * max_len // 8)
    out = torch.zeros((b, c, cap), dtype=torch.uint8, device=exp.device)
    nbytes = torch.empty((b, c), dtype=torch.int32, device=exp.device)
    lanes = b * c
    _encode_kernel[(triton.cdiv(lanes, LANES),)](
        exp.contiguous(), codes.to(torch.int32).contiguous(),
        lengths.to(torch.int32).contiguous(), out, nbytes, n, c, lanes, cap,
        chunk=chunk, lanes=LANES)
    return out, nbytes


def decode_chunks(stream: Tensor, starts: Tensor, luts: Tensor, n: int, chunk: int,
                  max_len: int) -> Tensor:
    b, c = starts.shape
    out = torch.empty((b, n), dtype=torch.uint8, device=stream.device)
    lanes = b * c
    _decode_kernel[(triton.cdiv(lanes, LANES),)](
        stream.contiguous(), starts.to(torch.int64).contiguous(),
        luts.to(torch.int32).contiguous(), out, n, c, lanes,
        chunk=chunk, max_len=max_len, lanes=LANES)
    return out
