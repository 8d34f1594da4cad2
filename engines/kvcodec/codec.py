"""Encode and decode a batch of equal-sized BF16 blocks with either backend.

The device steps (split, chunk encode, chunk decode, merge) come from a :class:`Backend`: the
torch reference (:mod:`kvgate.engines.kvcodec.reference`) or the Triton kernels
(:mod:`kvgate.engines.kvcodec.kernels`). The rest is shared, so both backends write the same bytes:
the per-block histogram (``torch.bincount``), the Huffman tables (host, 256 counts per block),
the decode lookup tables (``torch.searchsorted`` on the device), packing the chunks into
blocks and choosing raw storage when coding does not pay.

Parameters: ``chunk`` exponents per independently decodable chunk (default 512: one GPU lane
each; the chunk's u32 end offset costs 32 / 512 = 0.06 bit per value, byte alignment about
4 bits per chunk more); ``max_len`` the longest code (default 12: a 4096-entry lookup table
of int32, 16 KiB, fits a GPU's L1/shared memory; real KV exponents need about 2.7 bits on
average, so the limit only touches very rare exponents).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from kvgate.engines.kvcodec import container
from kvgate.engines.kvcodec.huffman import canonical_codes, code_lengths

#: Zero bytes after the concatenated streams: a lane's 3-byte peek never reads past the end.
STREAM_PAD = 4


@dataclass(frozen=True)
class Params:
    chunk: int = 512
    max_len: int = 12

    def __post_init__(self) -> None:
        if not 1 <= self.chunk <= 65535 or not 8 <= self.max_len <= container.MAX_CODE_LEN:
            raise ValueError(f"bad codec parameters {self}")


class Backend(Protocol):
    def split(self, words: Tensor) -> tuple[Tensor, Tensor]: ...

    def merge(self, sm: Tensor, exp: Tensor) -> Tensor: ...

    def encode_chunks(self, exp: Tensor, codes: Tensor, lengths: Tensor, chunk: int,
                      max_len: int) -> tuple[Tensor, Tensor]: ...

    def decode_chunks(self, stream: Tensor, starts: Tensor, luts: Tensor, n: int, chunk: int,
                      max_len: int) -> Tensor: ...


def backend(name: str) -> Backend:
    """``"torch"`` (reference) or ``"triton"`` (kernels; imports Triton)."""
    if name == "torch":
        from kvgate.engines.kvcodec import reference
        return reference
    if name == "triton":
        from kvgate.engines.kvcodec import kernels
        return kernels
    raise ValueError(f"unknown codec backend {name!r} (torch, triton)")


def histogram(exp: Tensor) -> Tensor:
    """(B, 256) int64 counts of each block's exponents."""
    b = exp.shape[0]
    offset = torch.arange(b, device=exp.device).unsqueeze(1) * 256
    return torch.bincount((exp.to(torch.int64) + offset).reshape(-1),
                          minlength=256 * b).view(b, 256)


def tables(hist: Tensor, max_len: int) -> tuple[list[list[int]], list[list[int]]]:
    """Per block: code lengths and canonical codes (host)."""
    lengths = [code_lengths(row, max_len) for row in hist.cpu().tolist()]
    return lengths, [canonical_codes(row) for row in lengths]


def build_luts(lengths: Tensor, codes: Tensor, max_len: int) -> Tensor:
    """(B, 2**max_len) int32 ``symbol | length << 8``: the entry of every ``max_len``-bit window.

    A window's symbol is the one whose left-justified code is the largest not above it.
    """
    size = 1 << max_len
    present = lengths > 0
    left = torch.where(present, codes << (max_len - lengths).clamp(min=0), size)
    order = torch.argsort(left, dim=1, stable=True)
    windows = torch.arange(size, device=lengths.device).expand(lengths.shape[0], size)
    at = torch.searchsorted(torch.gather(left, 1, order), windows.contiguous(), right=True) - 1
    symbol = torch.gather(order, 1, at.clamp(min=0))
    return (symbol | (torch.gather(lengths, 1, symbol) << 8)).to(torch.int32)


def _u32(values: list[int]) -> bytes:
    return struct.pack(f"<{len(values)}I", *values)


def encode_blocks(blocks: Tensor, params: Params, be: Backend) -> list[bytes]:
    """One blob per row of a (B, N) BF16 tensor."""
    if blocks.dtype != torch.bfloat16 or blocks.dim() != 2 or blocks.shape[1] == 0:
        raise ValueError("encode_blocks wants a non-empty (blocks, values) bfloat16 tensor")
    n, dev = blocks.shape[1], blocks.device
    sm, exp = be.split(blocks.contiguous())
    lengths, codes = tables(histogram(exp), params.max_len)
    ln_t = torch.tensor(lengths, dtype=torch.int32, device=dev)
    cd_t = torch.tensor(codes, dtype=torch.int32, device=dev)
    buf, nbytes = be.encode_chunks(exp, cd_t, ln_t, params.chunk, params.max_len)
    keep = torch.arange(buf.shape[2], device=dev) < nbytes.unsqueeze(2)
    flat = buf[keep].cpu().numpy().tobytes()
    ends = torch.cumsum(nbytes.to(torch.int64), dim=1).cpu().tolist()
    sm_host = sm.cpu().numpy()
    raw = blocks.contiguous().view(torch.int16).cpu().numpy()
    out, at = [], 0
    for i, row_ends in enumerate(ends):
        total = row_ends[-1]
        size = container.coded_size(n, params.chunk, lengths[i], total)
        if size >= container.HEADER.size + 2 * n:
            out.append(container.pack_raw(n, params.chunk, raw[i].tobytes()))
        else:
            out.append(container.pack_coded(n, params.chunk, params.max_len, lengths[i],
                                            _u32(row_ends), sm_host[i].tobytes(),
                                            flat[at:at + total]))
        at += total
    return out


def _frombytes(data: bytes, dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.frombuffer(bytearray(data), dtype=dtype).to(device)


@dataclass(frozen=True)
class DecodeBatch:
    """Device inputs of one decode launch (coded blocks of one size): built once, decoded
    by :func:`run_decode` (the part a GPU timing measures)."""

    stream: Tensor
    starts: Tensor
    luts: Tensor
    sm: Tensor
    n: int
    chunk: int
    max_len: int


def prepare_decode(parsed: list[container.Block], device: torch.device) -> DecodeBatch:
    first = parsed[0]
    ln_t = torch.tensor([p.lengths for p in parsed], dtype=torch.int64, device=device)
    cd_t = torch.tensor([canonical_codes(p.lengths) for p in parsed], dtype=torch.int64,
                        device=device)
    ends = torch.stack([_frombytes(p.ends, torch.int32, device) for p in parsed]).to(torch.int64)
    block_at = torch.cumsum(ends[:, -1], 0) - ends[:, -1]
    starts = ends.roll(1, dims=1)
    starts[:, 0] = 0
    stream = _frombytes(b"".join(p.stream for p in parsed) + bytes(STREAM_PAD), torch.uint8,
                        device)
    sm = torch.stack([_frombytes(p.sm, torch.uint8, device) for p in parsed])
    return DecodeBatch(stream, starts + block_at.unsqueeze(1),
                       build_luts(ln_t, cd_t, first.max_len), sm, first.n_values, first.chunk,
                       first.max_len)


def run_decode(batch: DecodeBatch, be: Backend) -> Tensor:
    exp = be.decode_chunks(batch.stream, batch.starts, batch.luts, batch.n, batch.chunk,
                           batch.max_len)
    return be.merge(batch.sm, exp)


def decode_blocks(blobs: list[bytes], be: Backend, device: torch.device | None = None) -> Tensor:
    """The (B, N) BF16 tensor the blobs were encoded from (all with the same N and chunk)."""
    dev = device or torch.device("cpu")
    parsed = [container.parse(b) for b in blobs]
    if not parsed or len({(p.n_values, p.chunk) for p in parsed}) != 1:
        raise container.CodecFormatError("decode_blocks needs blocks of one size and chunk")
    if len({p.max_len for p in parsed if p.mode == container.MODE_CODED}) > 1:
        raise container.CodecFormatError("decode_blocks needs one max_len for coded blocks")
    out = torch.empty((len(parsed), parsed[0].n_values), dtype=torch.bfloat16, device=dev)
    coded = [i for i, p in enumerate(parsed) if p.mode == container.MODE_CODED]
    for i, p in enumerate(parsed):
        if p.mode == container.MODE_RAW:
            out[i] = _frombytes(p.raw, torch.int16, dev).view(torch.bfloat16)
    if coded:
        out[coded] = run_decode(prepare_decode([parsed[i] for i in coded], dev), be)
    return out
