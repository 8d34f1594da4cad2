"""A Mooncake Store put/get wrapper that encodes KV tensors on put and decodes them on get.

:class:`CodecStore` wraps any object with Mooncake's ``put(key, bytes) -> int`` and
``get(key) -> bytes`` (``mooncake.store.MooncakeDistributedStore`` configured from the
``extra_config`` that ``kvgate deploy render`` writes into ``lmcache-<engine>.yaml``). It sits
where KV leaves the GPU for the shared tier: the engine side calls ``put(key, tensor)`` with a
BF16 KV tensor (any shape) and the store holds the encoded frame; ``get(key)`` gives back a
tensor with the same shape and the same bits, or ``None`` for an absent key.

Frame (little-endian)::

    "KVT1" | ndim u8 | 3 reserved bytes | block_values u32 | blobs u32
    | shape: ndim x u64 | blob sizes: blobs x u32 | blobs (kvgate.engines.kvcodec.container blocks)

The flattened tensor is cut into blocks of ``block_values`` values (the last may be shorter);
each block is one container block, raw when coding does not pay. ``block_values`` defaults to
one vLLM block of one layer (16 tokens x 8 KV heads x 128 head_dim = 16,384 values) and should
be set to the engine's block.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from kvgate.engines.kvcodec.codec import Backend, Params, backend, decode_blocks, encode_blocks
from kvgate.engines.kvcodec.container import CodecFormatError

MAGIC = b"KVT1"
HEAD = struct.Struct("<4sB3xII")
OBJECT_MAGIC = b"KVO1"
OBJECT_HEAD = struct.Struct("<4sBxxxI")  # magic, mode (0 codec, 1 raw), header JSON length
MODE_CODEC, MODE_RAW = 0, 1
DEFAULT_BLOCK_VALUES = 16 * 8 * 128


class KvStore(Protocol):
    def put(self, key: str, value: bytes) -> int: ...

    def get(self, key: str) -> bytes: ...


def encode_tensor(t: Tensor, block_values: int, params: Params, be: Backend) -> bytes:
    flat = t.contiguous().reshape(-1)
    full = flat.numel() // block_values
    blobs: list[bytes] = []
    if full:
        blobs += encode_blocks(flat[:full * block_values].view(full, block_values), params, be)
    if flat.numel() > full * block_values:
        blobs += encode_blocks(flat[full * block_values:].view(1, -1), params, be)
    head = HEAD.pack(MAGIC, t.dim(), block_values, len(blobs))
    dims = struct.pack(f"<{t.dim()}Q", *t.shape)
    sizes = struct.pack(f"<{len(blobs)}I", *(len(b) for b in blobs))
    return b"".join([head, dims, sizes, *blobs])


def decode_tensor(data: bytes, be: Backend, device: torch.device | None = None) -> Tensor:
    magic, ndim, block_values, count = HEAD.unpack_from(data)
    if magic != MAGIC:
        raise CodecFormatError(f"not a KVT1 frame (magic {magic!r})")
    at = HEAD.size
    shape = struct.unpack_from(f"<{ndim}Q", data, at)
    at += 8 * ndim
    sizes = struct.unpack_from(f"<{count}I", data, at)
    at += 4 * count
    blobs = []
    for size in sizes:
        blobs.append(bytes(data[at:at + size]))
        at += size
    n = math.prod(shape)
    full = n // block_values
    parts = [decode_blocks(blobs[:full], be, device).reshape(-1)] if full else []
    if n > full * block_values:
        parts.append(decode_blocks(blobs[full:], be, device).reshape(-1))
    if at != len(data) or len(blobs) != full + (n > full * block_values):
        raise CodecFormatError("KVT1 frame size or block count inconsistent")
    return torch.cat(parts).view(shape)


class CodecStore:
    """Encode on put, decode on get; counts the bytes it was given and the bytes it stored."""

    def __init__(self, store: KvStore, block_values: int = DEFAULT_BLOCK_VALUES,
                 params: Params | None = None, backend_name: str = "torch",
                 device: torch.device | None = None) -> None:
        self.store = store
        self.block_values = block_values
        self.params = params or Params()
        self.backend = backend(backend_name)
        self.device = device
        self.bytes_in = 0
        self.bytes_stored = 0

    def put(self, key: str, tensor: Tensor) -> int:
        """Mooncake's return code (0 = stored)."""
        if tensor.dtype != torch.bfloat16:
            raise TypeError(f"CodecStore stores bfloat16 KV, not {tensor.dtype}")
        frame = encode_tensor(tensor, self.block_values, self.params, self.backend)
        rc = int(self.store.put(key, frame))
        if rc == 0:
            self.bytes_in += 2 * tensor.numel()
            self.bytes_stored += len(frame)
        return rc

    def get(self, key: str) -> Tensor | None:
        data = bytes(self.store.get(key))
        return decode_tensor(data, self.backend, self.device) if data else None


@dataclass(frozen=True)
class ObjectHeader:
    """What a reader needs to rebuild a cache object: its shapes, dtype names (torch's, e.g.
    ``"bfloat16"``), an opaque ``fmt`` integer (LMCache's ``MemoryFormat`` value) and the
    byte count."""

    shapes: list[list[int]]
    dtypes: list[str]
    fmt: int
    nbytes: int


def encode_object(data: Tensor, header: ObjectHeader, block_values: int, params: Params,
                  be: Backend) -> bytes:
    """A ``KVO1`` frame of a cache object's bytes (``data``: uint8, ``header.nbytes`` long).

    ``"KVO1" | mode u8 | 3 reserved | header length u32 | header JSON | payload``: when every
    dtype is bfloat16 (and the bytes are whole words) the payload is the ``KVT1`` frame of the
    bytes viewed as BF16 values (mode 0); otherwise the bytes as they are (mode 1).
    """
    if data.dtype != torch.uint8 or data.numel() != header.nbytes:
        raise ValueError("encode_object wants the object's bytes as a uint8 tensor")
    meta = json.dumps(header.__dict__, separators=(",", ":")).encode()
    coded = header.dtypes and all(d == "bfloat16" for d in header.dtypes) \
        and header.nbytes % 2 == 0 and header.nbytes > 0
    if coded:
        payload = encode_tensor(data.contiguous().view(torch.bfloat16), block_values, params, be)
    else:
        payload = data.contiguous().numpy().tobytes()
    return b"".join([OBJECT_HEAD.pack(OBJECT_MAGIC, MODE_CODEC if coded else MODE_RAW,
                                      len(meta)), meta, payload])


def decode_object(frame: bytes, be: Backend) -> tuple[ObjectHeader, Tensor]:
    """The header and the object's bytes (uint8) of a ``KVO1`` frame."""
    magic, mode, length = OBJECT_HEAD.unpack_from(frame)
    if magic != OBJECT_MAGIC or mode not in (MODE_CODEC, MODE_RAW):
        raise CodecFormatError(f"not a KVO1 frame (magic {magic!r}, mode {mode})")
    at = OBJECT_HEAD.size
    fields: dict[str, Any] = json.loads(bytes(frame[at:at + length]))
    header = ObjectHeader(**fields)
    payload = bytes(frame[at + length:])
    if mode == MODE_CODEC:
        data = decode_tensor(payload, be).view(torch.uint8)
    else:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    if data.numel() != header.nbytes:
        raise CodecFormatError(f"KVO1 frame holds {data.numel()} bytes, not {header.nbytes}")
    return header, data
