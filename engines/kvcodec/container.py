"""The byte format of one encoded block (little-endian; pure Python).

::

    header   16 B  magic "KVC2" (or "KVC1") | mode u8 (0 coded, 1 raw) | lo u8 | hi u8 | max_len u8
                   | n_values u32 | chunk u16 (exponents per chunk) | reserved u16 (0)
    raw:     2 * n_values B   the BF16 words as they were (little-endian), when coding
                              does not pay (e.g. random bits: 8 bits of exponent entropy)
    coded:   table   ceil((hi - lo + 1) / 2) B   code length of exponents lo..hi, 4 bits each
                                                 (low nibble first); others are absent
             sizes   KVC2: ceil(n_values / chunk) B  u8 byte count of each chunk's bits
                     KVC1: 4 * ceil(n_values / chunk) B  u32 end byte of each chunk in the stream
             sm      n_values B   sign (bit 7) + mantissa (bits 0-6) of each value, raw
             stream  ends[-1] B   the chunks' Huffman bits, MSB first, each chunk starting
                                  on a byte boundary (so lanes never share a byte)

A block is any run of BF16 values (the benchmark uses one engine KV block of one layer:
block_size tokens x KV heads x head_dim). Lengths are <= 15 (a nibble); ``max_len`` tells the
decoder its lookup-table width (``2 ** max_len`` entries).

KVC2 differs from KVC1 only in the chunk sizes: one byte per chunk (its bits' byte count)
instead of a u32 end offset, so chunks can be smaller (more GPU lanes) for the same overhead;
it needs ``ceil(chunk * max_len / 8) <= 255`` (chunk <= 170 at max_len 12). Both are parsed;
:data:`VERSION` (2) is what the encoder writes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

MAGICS = {1: b"KVC1", 2: b"KVC2"}
VERSIONS = {magic: version for version, magic in MAGICS.items()}
VERSION = 2
MAGIC = MAGICS[1]  # KVC1's, as before
#: KVC2's largest chunk, in bytes of code bits (a u8 size).
MAX_CHUNK_BYTES = 255
HEADER = struct.Struct("<4sBBBBIHH")
MODE_CODED, MODE_RAW = 0, 1
MAX_CODE_LEN = 15


class CodecFormatError(ValueError):
    """A blob is not a block this codec wrote (bad magic, mode, sizes or table)."""


@dataclass(frozen=True)
class Block:
    """A parsed block: views into the blob, nothing decoded."""

    mode: int
    version: int
    n_values: int
    chunk: int
    max_len: int
    lengths: list[int]
    ends: bytes  # KVC1: u32 end offsets; KVC2: u8 chunk sizes (see ``version``)
    sm: bytes
    stream: bytes
    raw: bytes

    @property
    def n_chunks(self) -> int:
        return -(-self.n_values // self.chunk)


def sizes_bytes(version: int, n_chunks: int) -> int:
    """Bytes of the chunk-size field of a coded block."""
    return n_chunks if version == 2 else 4 * n_chunks


def chunk_fits(version: int, chunk: int, max_len: int) -> bool:
    """Whether a chunk's bits always fit the version's size field."""
    return version == 1 or -(-chunk * max_len // 8) <= MAX_CHUNK_BYTES


def pack_raw(n_values: int, chunk: int, raw: bytes, version: int = 1) -> bytes:
    return HEADER.pack(MAGICS[version], MODE_RAW, 0, 0, 0, n_values, chunk, 0) + raw


def _pack_table(lengths: list[int]) -> tuple[int, int, bytes]:
    present = [s for s, n in enumerate(lengths) if n > 0]
    lo, hi = present[0], present[-1]
    span = [*lengths[lo:hi + 1], 0]
    return lo, hi, bytes(span[i] | (span[i + 1] << 4) for i in range(0, hi - lo + 1, 2))


def pack_coded(n_values: int, chunk: int, max_len: int, lengths: list[int], ends: bytes,
               sm: bytes, stream: bytes, version: int = 1) -> bytes:
    """One coded block; ``ends`` is the u32 end-offset array's bytes (KVC1) or the u8 chunk
    sizes (KVC2)."""
    if not 0 < max(lengths) <= max_len <= MAX_CODE_LEN:
        raise CodecFormatError(f"code lengths must be in 1..{max_len} (max {MAX_CODE_LEN})")
    lo, hi, table = _pack_table(lengths)
    head = HEADER.pack(MAGICS[version], MODE_CODED, lo, hi, max_len, n_values, chunk, 0)
    return b"".join((head, table, ends, sm, stream))


def coded_size(n_values: int, chunk: int, lengths: list[int], stream_bytes: int,
               version: int = 1) -> int:
    """The size :func:`pack_coded` would give, to choose raw before packing."""
    present = [s for s, n in enumerate(lengths) if n > 0]
    table = (present[-1] - present[0] + 2) // 2
    return (HEADER.size + table + sizes_bytes(version, -(-n_values // chunk)) + n_values
            + stream_bytes)


def parse(blob: bytes) -> Block:
    if len(blob) < HEADER.size:
        raise CodecFormatError("blob shorter than the header")
    magic, mode, lo, hi, max_len, n, chunk, _ = HEADER.unpack_from(blob)
    version = VERSIONS.get(magic, 0)
    if not version or mode not in (MODE_CODED, MODE_RAW) or chunk == 0:
        raise CodecFormatError(f"not a KVC1/KVC2 block (magic {magic!r}, mode {mode})")
    body = memoryview(blob)[HEADER.size:]
    if mode == MODE_RAW:
        if len(body) != 2 * n:
            raise CodecFormatError(f"raw block of {n} values has {len(body)} bytes")
        return Block(mode, version, n, chunk, 0, [], b"", b"", b"", bytes(body))
    tsize = (hi - lo + 2) // 2
    nibbles = [v for b in body[:tsize] for v in (b & 15, b >> 4)][:hi - lo + 1]
    lengths = [0] * lo + nibbles + [0] * (255 - hi)
    n_chunks = -(-n // chunk)
    field = sizes_bytes(version, n_chunks)
    ends = bytes(body[tsize:tsize + field])
    sm = bytes(body[tsize + field:tsize + field + n])
    stream = bytes(body[tsize + field + n:])
    if len(ends) != field:
        raise CodecFormatError("coded block truncated")
    if version == 2:
        total = sum(ends)
    else:
        total = struct.unpack_from("<I", ends, 4 * (n_chunks - 1))[0] if n_chunks else 0
    if len(sm) != n or len(stream) != total or max(lengths, default=0) > max_len:
        raise CodecFormatError("coded block truncated or inconsistent")
    return Block(mode, version, n, chunk, max_len, lengths, ends, sm, stream, b"")
