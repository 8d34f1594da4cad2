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

from kvgate.engines.kvcodec import tables

LANES = 64
ELEMS = 1024
#: Blocks (lanes) per program of the table kernel: one warp, so a batch spreads over more SMs.
TABLE_LANES = 32


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


@triton.jit  # type: ignore[untyped-decorator]
def _lengths_kernel(weights_ptr: tl.tensor, present_ptr: tl.tensor, nodes_ptr: tl.tensor,
                    leaf_parent_ptr: tl.tensor, node_parent_ptr: tl.tensor,
                    depth_ptr: tl.tensor, n_blocks: tl.tensor,
                    lanes: tl.constexpr) -> None:
    """Plain Huffman code lengths, one lane per block (``tables.huffman_lengths``'s algorithm).

    ``weights``: each block's 256 counts in (count, symbol) order (int32), ``present`` the
    number of non-zero counts; 256 int32 per block of ``nodes`` (scratch), ``leaf_parent`` (the
    merge step that took each sorted leaf), ``node_parent`` (scratch) and ``depth`` (of each
    internal node, the root 0). The launcher turns ``depth[leaf_parent] + 1`` into lengths.
    """
    lane = tl.program_id(0) * lanes + tl.arange(0, lanes)
    ok = lane < n_blocks
    row = lane.to(tl.int64) * 256
    m = tl.load(present_ptr + lane, mask=ok, other=0)
    li = 256 - m
    ni = tl.zeros([lanes], tl.int32)
    big = tl.full([lanes], 2147483647, tl.int32)
    steps = tl.max(m, axis=0) - 1  # merges of the program's fullest block (real K/V: ~15)
    for k in range(0, steps):
        live = ok & (k < m - 1)
        total = tl.zeros([lanes], tl.int32)
        for _ in tl.static_range(2):
            lw = tl.load(weights_ptr + row + li, mask=live & (li < 256), other=2147483647)
            nw = tl.load(nodes_ptr + row + ni, mask=live & (ni < k), other=2147483647)
            lw = tl.where(li < 256, lw, big)
            nw = tl.where(ni < k, nw, big)
            leaf = lw <= nw  # a leaf wins a tie (its heap tie-breaker is smaller)
            tl.store(leaf_parent_ptr + row + li, k + ni * 0, mask=live & leaf)
            tl.store(node_parent_ptr + row + ni, k + ni * 0, mask=live & (lw > nw))
            total = total + tl.where(leaf, lw, nw)
            li = li + (live & leaf).to(tl.int32)
            ni = ni + (live & (lw > nw)).to(tl.int32)
        tl.store(nodes_ptr + row + k, total, mask=live)
    tl.store(depth_ptr + row + m - 2, ni * 0, mask=ok & (m >= 2))  # the root
    for t in range(0, steps - 1):
        k = steps - 2 - t
        live = ok & (k <= m - 3)
        parent = tl.load(node_parent_ptr + row + k, mask=live, other=0)
        d = tl.load(depth_ptr + row + parent, mask=live, other=0)
        tl.store(depth_ptr + row + k, d + 1, mask=live)


@triton.jit  # type: ignore[untyped-decorator]
def _decode_multi_kernel(stream_ptr: tl.tensor, starts_ptr: tl.tensor, luts_ptr: tl.tensor,
                         out_ptr: tl.tensor, n: tl.tensor, n_chunks: tl.tensor,
                         n_lanes: tl.tensor, chunk: tl.constexpr, max_len: tl.constexpr,
                         lanes: tl.constexpr) -> None:
    """One lane per chunk, up to three symbols per table lookup (``tables.multi_luts``).

    Per step: a 24-bit window from three byte loads, its ``max_len`` bits at the lane's bit
    position index the block's table, whose entry gives up to three whole symbols, their
    count and the bits they use; the symbols are stored (masked past the chunk's end) and the
    lane advances. The loop runs while any lane of the program has symbols left.
    """
    lane = tl.program_id(0) * lanes + tl.arange(0, lanes)
    ok = lane < n_lanes
    block = lane // n_chunks
    first = (lane % n_chunks) * chunk
    count = tl.where(ok, tl.minimum(n - first, chunk), 0)
    base = tl.load(starts_ptr + lane, mask=ok, other=0)
    lut = luts_ptr + block.to(tl.int64) * (1 << max_len)
    dst = out_ptr + block.to(tl.int64) * n + first
    pos = tl.zeros([lanes], tl.int32)
    done = tl.zeros([lanes], tl.int32)
    while tl.max(count - done, axis=0) > 0:
        live = done < count
        at = stream_ptr + base + (pos >> 3)
        b0 = tl.load(at, mask=live, other=0).to(tl.int32)
        b1 = tl.load(at + 1, mask=live, other=0).to(tl.int32)
        b2 = tl.load(at + 2, mask=live, other=0).to(tl.int32)
        window = (b0 << 16) | (b1 << 8) | b2
        index = (window >> (24 - max_len - (pos & 7))) & ((1 << max_len) - 1)
        entry = tl.load(lut + index, mask=live, other=0)
        got = (entry >> 24) & 3
        for j in tl.static_range(3):
            sym = (entry >> (8 * j)) & 0xFF
            tl.store(dst + done + j, sym.to(tl.uint8), mask=live & (j < got) & (done + j < count))
        done = done + tl.where(live, got, 0)
        pos = pos + tl.where(live, (entry >> 26) & 15, 0)


#: When a list, every launch appends ``(kernel name, argument types, constexprs, grid)``: the
#: types as :mod:`kvgate.engines.kvcodec.aot` spells them (``*u8``, ``i32``...), so a test can
#: check that what the launchers pass is what the ahead-of-time compile was given.
LAUNCHES: list[tuple[str, list[str], dict[str, int], tuple[int, ...]]] | None = None
_POINTER = {torch.uint8: "*u8", torch.int16: "*i16", torch.int32: "*i32", torch.int64: "*i64"}


def _type_of(arg: object) -> str:
    if isinstance(arg, Tensor):
        return _POINTER[arg.dtype]
    if isinstance(arg, int):
        return "i32" if -(1 << 31) <= arg < (1 << 31) else "i64"
    raise TypeError(f"unexpected kernel argument {arg!r}")


def _launch(kernel: object, grid: tuple[int, ...], *args: object, **constexprs: int) -> None:
    if LAUNCHES is not None:
        name = kernel.fn.__name__  # type: ignore[attr-defined]
        LAUNCHES.append((name, [_type_of(a) for a in args], dict(constexprs), grid))
    kernel[grid](*args, **constexprs)  # type: ignore[index]


def split(words: Tensor) -> tuple[Tensor, Tensor]:
    flat = words.contiguous().view(torch.int16)
    sm = torch.empty(flat.shape, dtype=torch.uint8, device=flat.device)
    exp = torch.empty_like(sm)
    total = flat.numel()
    _launch(_split_kernel, (triton.cdiv(total, ELEMS),), flat, sm, exp, total, elems=ELEMS)
    return sm, exp


def merge(sm: Tensor, exp: Tensor) -> Tensor:
    words = torch.empty(sm.shape, dtype=torch.int16, device=sm.device)
    total = sm.numel()
    _launch(_merge_kernel, (triton.cdiv(total, ELEMS),), sm.contiguous(), exp.contiguous(),
            words, total, elems=ELEMS)
    return words.view(torch.bfloat16)


def huffman_lengths(counts: Tensor) -> Tensor:
    """(B, 256) int32 plain Huffman code lengths (``tables.huffman_lengths``), one lane per
    block; the (count, symbol) sort is ``torch.argsort`` on the device. A block's counts must
    sum below 2**31 (int32 weights; :func:`kvgate.engines.kvcodec.codec.encode_device` checks)."""
    b = counts.shape[0]
    counts = counts.to(torch.int64)
    order = torch.argsort(counts * 256 + torch.arange(256, device=counts.device), dim=1)
    weights = torch.gather(counts, 1, order).to(torch.int32).contiguous()
    present = (counts > 0).sum(dim=1).to(torch.int32)
    nodes, leaf_parent, node_parent, depth = (
        torch.zeros((b, 256), dtype=torch.int32, device=counts.device) for _ in range(4))
    _launch(_lengths_kernel, (triton.cdiv(b, TABLE_LANES),), weights, present, nodes,
            leaf_parent, node_parent, depth, b, lanes=TABLE_LANES)
    return tables.lengths_from_tree(order, present.to(torch.int64), leaf_parent.to(torch.int64),
                                    depth.to(torch.int64))


def code_lengths(hist: Tensor, max_len: int) -> Tensor:
    """(B, 256) int64 length-limited code lengths (``huffman.code_lengths``'s, bit for bit)."""
    return tables.limited_lengths(hist, max_len, huffman_lengths)


def encode_chunks(exp: Tensor, codes: Tensor, lengths: Tensor, chunk: int,
                  max_len: int) -> tuple[Tensor, Tensor]:
    b, n = exp.shape
    c = -(-n // chunk)
    cap = -(-chunk * max_len // 8)
    out = torch.zeros((b, c, cap), dtype=torch.uint8, device=exp.device)
    nbytes = torch.empty((b, c), dtype=torch.int32, device=exp.device)
    lanes = b * c
    _launch(_encode_kernel, (triton.cdiv(lanes, LANES),), exp.contiguous(),
            codes.to(torch.int32).contiguous(), lengths.to(torch.int32).contiguous(), out,
            nbytes, n, c, lanes, cap, chunk=chunk, lanes=LANES)
    return out, nbytes


def decode_chunks(stream: Tensor, starts: Tensor, lengths: Tensor, codes: Tensor, n: int,
                  chunk: int, max_len: int) -> Tensor:
    """(B, N) uint8 exponents: the multi-symbol tables built on the device, then one lane per
    chunk (``_decode_multi_kernel``)."""
    luts = tables.multi_luts(lengths, codes, max_len)
    return _decode(_decode_multi_kernel, luts, stream, starts, n, chunk, max_len)


def decode_chunks_single(stream: Tensor, starts: Tensor, lengths: Tensor, codes: Tensor,
                         n: int, chunk: int, max_len: int) -> Tensor:
    """The previous decoder (one symbol per lookup, ``_decode_kernel``), kept to compare."""
    luts = tables.single_luts(lengths, codes, max_len)
    return _decode(_decode_kernel, luts, stream, starts, n, chunk, max_len)


def _decode(kernel: object, luts: Tensor, stream: Tensor, starts: Tensor, n: int, chunk: int,
            max_len: int) -> Tensor:
    """One lane per chunk of ``kernel`` over the lookup tables ``luts``."""
    b, c = starts.shape
    out = torch.empty((b, n), dtype=torch.uint8, device=stream.device)
    lanes = b * c
    _launch(kernel, (triton.cdiv(lanes, LANES),), stream.contiguous(),
            starts.to(torch.int64).contiguous(), luts.contiguous(), out, n, c, lanes,
            chunk=chunk, max_len=max_len, lanes=LANES)
    return out
