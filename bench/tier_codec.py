"""The KV codec's measured time in the shared-tier replay (``bench.tier_sim --codec-speed``).

A ``kvgate codec bench --speed`` JSON (``kvgate.engines.kvcodec.measure.speed``) gives encode and
decode GB/s (raw BF16 bytes per second, 10^9) per codec block size, and the ``backend`` that ran:
the torch reference on a CPU, or the Triton kernels on a CUDA GPU. :func:`load_speed` reads the
row whose block size is closest to the modelled model's codec block (:data:`MODEL_BLOCK_VALUES`)
and :class:`CodecTier` charges it in the replay:

* **load** of ``n`` blocks from the tier: ``load_setup_s`` + the link time of the *encoded*
  bytes (raw / capacity factor: the saving that also sized the tier) + the decode time of the
  raw bytes at the measured decode GB/s. It is part of the admitting step, so of the TTFT.
* **write**: each block newly stored is encoded at the measured encode GB/s. Writes are
  asynchronous in the model (write-through in the background, off the critical path), so their
  encode time is **not** in the TTFT: it is totalled and reported separately.

A CPU reference speed is orders of magnitude below the GPU kernels'; it exercises the mechanics,
and every label built here says which backend the figure came from.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvgate.engines.sim.core.shared_tier import SharedTier, TierParams

#: The codec block of the modelled 8B (Llama-3.1-8B-shaped: 8 KV heads x 128): one vLLM block
#: of 16 tokens of one layer's K or V, the LMCache plugin's default ``kvcodec_block_values``.
MODEL_BLOCK_VALUES = 16 * 8 * 128

#: What a row of the replay says when no speed file was given.
NOT_CHARGED = ("codec time not charged (no --codec-speed): tier loads move raw bytes at link "
               "speed, no encode or decode time")
NOT_CHARGED_SHORT = "codec time not charged"


@dataclass(frozen=True, slots=True)
class CodecSpeed:
    """One row of a speed report and where it came from."""

    path: str
    backend: str
    gpu: bool
    device: str
    block_values: int
    target_block_values: int
    encode_gbps: float
    decode_gbps: float

    @property
    def short(self) -> str:
        """Backend in a few words, for table rows."""
        if self.gpu:
            return f"decode charged: GPU {self.device}"
        return "decode charged: CPU torch reference, not GPU"

    @property
    def label(self) -> str:
        """The full statement of what was charged and from where."""
        kind = (f"GPU ({self.device})" if self.gpu else
                "CPU REFERENCE: torch on the CPU, not the GPU kernels; a GPU figure is unmeasured")
        return (f"codec time charged from {self.path} [{self.backend}] - {kind}; "
                f"block row {self.block_values} values (closest to the model's "
                f"{self.target_block_values}); decode {self.decode_gbps:.4g} GB/s on every "
                f"tier load (in TTFT); encode {self.encode_gbps:.4g} GB/s on every tier write "
                f"(writes are asynchronous in the model: encode time reported separately, "
                f"not in TTFT)")


def load_speed(path: Path, target: int = MODEL_BLOCK_VALUES) -> CodecSpeed:
    """The row of ``path``'s ``per_block_size`` closest to ``target`` values (ties: the larger
    block); exits with a message when the file is missing or malformed."""
    try:
        doc: dict[str, Any] = json.loads(path.read_text())
        rows: list[dict[str, Any]] = doc["per_block_size"]
        row = min(rows, key=lambda r: (abs(math.log(int(r["block_values"]) / target)),
                                       -int(r["block_values"])))
        speed = CodecSpeed(
            path=str(path), backend=str(doc["backend"]), gpu=bool(doc["gpu"]),
            device=str(doc.get("device", "?")), block_values=int(row["block_values"]),
            target_block_values=target, encode_gbps=float(row["encode_gbps"]),
            decode_gbps=float(row["decode_gbps"]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"--codec-speed {path}: not a `kvgate codec bench --speed` report "
                         f"({exc!r})") from exc
    if not (speed.encode_gbps > 0 and speed.decode_gbps > 0):
        raise SystemExit(f"--codec-speed {path}: GB/s must be positive")
    return speed


class CodecTier(SharedTier):
    """A shared tier whose loads move encoded bytes and pay the measured decode time."""

    def __init__(self, params: TierParams, speed: CodecSpeed) -> None:
        super().__init__(params)
        self.speed = speed
        self.decode_seconds = 0.0

    @property
    def block_bytes(self) -> int:
        """Raw (BF16) bytes of one tier block."""
        return self.params.block_size * self.params.kv_bytes_per_token

    def decode_time(self, blocks: int) -> float:
        """Seconds to decode ``blocks`` tier blocks at the measured GB/s."""
        return blocks * self.block_bytes / (self.speed.decode_gbps * 1e9)

    def load_seconds(self, blocks: int) -> float:
        if blocks <= 0:
            return 0.0
        p = self.params
        encoded = blocks * self.block_bytes / p.capacity_factor
        return p.load_setup_s + encoded / p.link_bytes_per_s + self.decode_time(blocks)

    def load(self, hashes: Sequence[int]) -> float:
        self.decode_seconds += self.decode_time(len(hashes))
        return super().load(hashes)

    def figures(self) -> dict[str, Any]:
        """What the codec cost over a run: decode (in TTFT) and encode (asynchronous)."""
        raw = self.stats.loaded * self.block_bytes
        return {
            "charged": True, "label": self.speed.label, "short": self.speed.short,
            "backend": self.speed.backend,
            "gpu": self.speed.gpu, "speed_file": self.speed.path,
            "block_values": self.speed.block_values,
            "decode_gbps": self.speed.decode_gbps, "encode_gbps": self.speed.encode_gbps,
            "loaded_raw_bytes": raw,
            "loaded_encoded_bytes": raw / self.params.capacity_factor,
            "decode_seconds_in_ttft": self.decode_seconds,
            "encode_seconds_async_not_in_ttft": (self.stats.stored * self.block_bytes
                                                 / (self.speed.encode_gbps * 1e9)),
        }


def row_label(row: dict[str, Any]) -> str:
    """A result row's setup name, with what codec time it carries for the codec's setup (rows of
    older results have no ``codec_time``: none was charged then)."""
    if not row["name"].startswith("tier-aware-codec"):
        return str(row["name"])
    return f"{row['name']} [{row.get('codec_time', {}).get('short', NOT_CHARGED_SHORT)}]"


def make_tier(params: TierParams, speed: CodecSpeed | None) -> SharedTier:
    """A plain tier, or one charging ``speed`` when given."""
    return SharedTier(params) if speed is None else CodecTier(params, speed)
