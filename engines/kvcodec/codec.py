"""Encode and decode a batch of equal-sized BF16 blocks with either backend.

The device steps come from a :class:`Backend`: the torch reference
(:mod:`kvgate.engines.kvcodec.reference`) or the Triton kernels
(:mod:`kvgate.engines.kvcodec.kernels`): split, code lengths, chunk encode, chunk decode, merge.
The rest is shared and runs on the blocks' device too, for all blocks at once: the histograms
(``torch.bincount``), the canonical codes (:func:`kvgate.engines.kvcodec.tables.canonical_codes`),
the raw-or-coded choice and the packing of every block's bytes into one device buffer
(:func:`encode_device`); :func:`encode_blocks` copies that buffer to the host once and cuts it
into blobs. Both backends write the same bytes, and the same bytes as the host oracle
(``huffman.py`` + ``container.pack_coded``), which the tests check.

Parameters: ``chunk`` exponents per independently decodable chunk (default 128: one GPU lane
each; KVC2's u8 chunk size costs 8 / 128 = 0.06 bit per value, byte alignment about 4 bits
per chunk more); ``max_len`` the longest code (default 12: a 4096-entry lookup table of
int32, 16 KiB, fits a GPU's L1/shared memory; real KV exponents need about 2.7 bits on
average, so the limit only touches very rare exponents); ``version`` the container written
(2: u8 chunk sizes; 1: KVC1's u32 chunk ends, still decoded).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from kvgate.engines.kvcodec import container
from kvgate.engines.kvcodec.huffman import canonical_codes, code_lengths
from kvgate.engines.kvcodec.tables import canonical_codes as device_codes
from kvgate.engines.kvcodec.tables import single_luts

#: Zero bytes after the concatenated streams: a lane's 3-byte peek never reads past the end.
STREAM_PAD = 4


@dataclass(frozen=True)
class Params:
    chunk: int = 128
    max_len: int = 12
    version: int = container.VERSION

    def __post_init__(self) -> None:
        if (not 1 <= self.chunk <= 65535 or not 8 <= self.max_len <= container.MAX_CODE_LEN
                or self.version not in container.MAGICS
                or not container.chunk_fits(self.version, self.chunk, self.max_len)):
            raise ValueError(f"bad codec parameters {self}")


class Backend(Protocol):
    def split(self, words: Tensor) -> tuple[Tensor, Tensor]: ...

    def merge(self, sm: Tensor, exp: Tensor) -> Tensor: ...

    def code_lengths(self, hist: Tensor, max_len: int) -> Tensor: ...

    def encode_chunks(self, exp: Tensor, codes: Tensor, lengths: Tensor, chunk: int,
                      max_len: int) -> tuple[Tensor, Tensor]: ...

    def decode_chunks(self, stream: Tensor, starts: Tensor, lengths: Tensor, codes: Tensor,
                      n: int, chunk: int, max_len: int) -> Tensor: ...


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
    """Per block: code lengths and canonical codes on the host (``huffman.py``: the oracle the
    device tables are tested against; the codec itself builds them on the device)."""
    lengths = [code_lengths(row, max_len) for row in hist.cpu().tolist()]
    return lengths, [canonical_codes(row) for row in lengths]


def build_luts(lengths: Tensor, codes: Tensor, max_len: int) -> Tensor:
    """(B, 2**max_len) int32 ``symbol | length << 8`` (:func:`tables.single_luts`)."""
    return single_luts(lengths, codes, max_len)


def _le_bytes(values: Tensor, width: int) -> Tensor:
    """(..., width) uint8: the little-endian bytes of int64 ``values``."""
    shifts = torch.arange(width, device=values.device) * 8
    return ((values.unsqueeze(-1) >> shifts) & 0xFF).to(torch.uint8)


def _put(out: Tensor, dest: Tensor, values: Tensor, keep: Tensor) -> None:
    """``out[dest] = values`` where ``keep``; elsewhere into ``out``'s last (spare) byte."""
    spare = out.numel() - 1
    where = torch.where(keep, dest, spare).reshape(-1)
    out.index_put_((where,), values.reshape(-1).to(torch.uint8))


@dataclass(frozen=True)
class EncodedBatch:
    """Every block's bytes in one device buffer: block ``i`` is
    ``data[offsets[i]:offsets[i + 1]]`` (``data`` is longer than ``offsets[-1]``: its size is
    the all-raw bound, so no host synchronisation is needed to allocate it)."""

    data: Tensor
    offsets: Tensor


def _put_headers(out: Tensor, at: Tensor, raw: Tensor, lo: Tensor, hi: Tensor, n: int,
                 params: Params) -> None:
    """Each block's 16-byte header at ``at``: magic | mode | lo | hi | max_len | n u32 |
    chunk u16 | reserved u16 (lo, hi and max_len 0 for a raw block)."""
    b, head, dev = raw.shape[0], container.HEADER.size, out.device
    coded = ~raw
    header = torch.zeros((b, head), dtype=torch.int64, device=dev)
    header[:, :4] = torch.tensor(list(container.MAGICS[params.version]), device=dev)
    header[:, 4] = raw.to(torch.int64) * container.MODE_RAW
    header[:, 5] = torch.where(coded, lo, 0)
    header[:, 6] = torch.where(coded, hi, 0)
    header[:, 7] = torch.where(coded, params.max_len, 0)
    header[:, 8:12] = _le_bytes(torch.tensor(n, device=dev), 4).to(torch.int64)
    header[:, 12:14] = _le_bytes(torch.tensor(params.chunk, device=dev), 2).to(torch.int64)
    every = torch.ones((b, head), dtype=torch.bool, device=dev)
    _put(out, at + torch.arange(head, device=dev), header, every)


def _put_table(out: Tensor, at: Tensor, lengths: Tensor, lo: Tensor, hi: Tensor,
               coded: Tensor, tsize: Tensor) -> None:
    """The code length of exponents lo..hi at ``at``, two per byte, low nibble first (coded
    blocks only)."""
    t = torch.arange(128, device=out.device)
    first, second = lo.unsqueeze(1) + 2 * t, lo.unsqueeze(1) + 2 * t + 1
    nib0 = torch.gather(lengths, 1, first.clamp(max=255))
    nib1 = torch.where(second <= hi.unsqueeze(1), torch.gather(lengths, 1, second.clamp(max=255)),
                       0)
    _put(out, at + t, nib0 | (nib1 << 4), coded.unsqueeze(1) & (t < tsize.unsqueeze(1)))


def encode_device(blocks: Tensor, params: Params, be: Backend) -> EncodedBatch:
    """Encode a (B, N) BF16 tensor on its device: split, histograms, code lengths, canonical
    codes, chunk encode, the raw-or-coded choice and the packing of every block's header,
    table, chunk sizes, sign+mantissa bytes and stream (or raw words), all blocks at once.
    The only host synchronisations are the length limit's rounds (one for real K/V)."""
    if blocks.dtype != torch.bfloat16 or blocks.dim() != 2 or blocks.shape[1] == 0:
        raise ValueError("encode_blocks wants a non-empty (blocks, values) bfloat16 tensor")
    b, n = blocks.shape
    if n >= 1 << 31:
        raise ValueError("a block must hold fewer than 2**31 values")
    dev, chunk, max_len, version = blocks.device, params.chunk, params.max_len, params.version
    c = -(-n // chunk)
    sm, exp = be.split(blocks.contiguous())
    sm, exp = sm.view(b, n), exp.view(b, n)
    lengths = be.code_lengths(histogram(exp), max_len).to(torch.int64)
    codes = device_codes(lengths)
    buf, nbytes = be.encode_chunks(exp, codes, lengths, chunk, max_len)
    nbytes = nbytes.to(torch.int64)
    sym = torch.arange(256, device=dev)
    present = lengths > 0
    lo = torch.where(present, sym, 256).min(dim=1).values
    hi = torch.where(present, sym, -1).max(dim=1).values
    tsize = (hi - lo + 2) // 2
    ends = torch.cumsum(nbytes, dim=1)
    field = container.sizes_bytes(version, c)
    head = container.HEADER.size
    coded_size = head + tsize + field + n + ends[:, -1]
    raw = coded_size >= head + 2 * n
    coded = ~raw
    size = torch.where(raw, head + 2 * n, coded_size)
    offsets = torch.zeros(b + 1, dtype=torch.int64, device=dev)
    offsets[1:] = torch.cumsum(size, dim=0)
    at = offsets[:-1].unsqueeze(1)
    out = torch.zeros(b * (head + 2 * n) + 1, dtype=torch.uint8, device=dev)
    _put_headers(out, at, raw, lo, hi, n, params)
    # raw blocks: the words as they were (little-endian)
    words = blocks.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    raw_bytes = _le_bytes(words, 2).view(b, 2 * n)
    _put(out, at + head + torch.arange(2 * n, device=dev), raw_bytes, raw.unsqueeze(1))
    _put_table(out, at + head, lengths, lo, hi, coded, tsize)
    # chunk sizes: u8 byte counts (KVC2) or u32 end offsets (KVC1)
    body = at + head + tsize.unsqueeze(1)
    sizes = nbytes if version == 2 else _le_bytes(ends, 4).view(b, field)
    _put(out, body + torch.arange(field, device=dev), sizes, coded.unsqueeze(1))
    # sign+mantissa bytes, then each chunk's code bytes
    _put(out, body + field + torch.arange(n, device=dev), sm, coded.unsqueeze(1))
    j = torch.arange(buf.shape[2], device=dev)
    stream_at = (body + field + n + ends - nbytes).unsqueeze(2) + j
    _put(out, stream_at, buf, coded.view(b, 1, 1) & (j < nbytes.unsqueeze(2)))
    return EncodedBatch(out, offsets)


def encode_blocks(blocks: Tensor, params: Params, be: Backend) -> list[bytes]:
    """One blob per row of a (B, N) BF16 tensor (:func:`encode_device`, one copy to the host)."""
    batch = encode_device(blocks, params, be)
    offsets = batch.offsets.cpu().tolist()
    data = batch.data[:offsets[-1]].cpu().numpy().tobytes()
    return [data[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]


def _frombytes(data: bytes, dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.frombuffer(bytearray(data), dtype=dtype).to(device)


@dataclass(frozen=True)
class DecodeBatch:
    """Device inputs of one decode launch (coded blocks of one size): built once, decoded
    by :func:`run_decode` (the part a GPU timing measures)."""

    stream: Tensor
    starts: Tensor
    lengths: Tensor
    codes: Tensor
    sm: Tensor
    n: int
    chunk: int
    max_len: int


def _ends(p: container.Block, device: torch.device) -> Tensor:
    if p.version == 2:  # u8 chunk sizes
        return torch.cumsum(_frombytes(p.ends, torch.uint8, device).to(torch.int64), 0)
    return _frombytes(p.ends, torch.int32, device).to(torch.int64)


def prepare_decode(parsed: list[container.Block], device: torch.device) -> DecodeBatch:
    """The device inputs of coded blocks (host parsing done; KVC1 and KVC2 alike): the chunks'
    start bytes, each block's code lengths and canonical codes (on the device)."""
    first = parsed[0]
    ln_t = torch.tensor([p.lengths for p in parsed], dtype=torch.int64, device=device)
    cd_t = device_codes(ln_t)
    ends = torch.stack([_ends(p, device) for p in parsed])
    block_at = torch.cumsum(ends[:, -1], 0) - ends[:, -1]
    starts = ends.roll(1, dims=1)
    starts[:, 0] = 0
    stream = _frombytes(b"".join(p.stream for p in parsed) + bytes(STREAM_PAD), torch.uint8,
                        device)
    sm = torch.stack([_frombytes(p.sm, torch.uint8, device) for p in parsed])
    return DecodeBatch(stream, starts + block_at.unsqueeze(1), ln_t, cd_t, sm, first.n_values,
                       first.chunk, first.max_len)


def run_decode(batch: DecodeBatch, be: Backend) -> Tensor:
    """The device part of decoding: the backend's lookup tables, chunk decode, merge."""
    exp = be.decode_chunks(batch.stream, batch.starts, batch.lengths, batch.codes, batch.n,
                           batch.chunk, batch.max_len)
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
