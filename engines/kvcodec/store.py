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

import math
import struct
from typing import Protocol

import torch
from torch import Tensor

from kvgate.engines.kvcodec.codec import Backend, Params, backend, decode_blocks, encode_blocks
from kvgate.engines.kvcodec.container import CodecFormatError

MAGIC = b"KVT1"
HEAD = struct.Struct("<4sB3xII")
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
