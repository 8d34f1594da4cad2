"""``python -m kvgate.engines.kvcodec.measure.speed``: encode and decode speed of the codec per
block size, against a device copy of the same bytes in the same run (engine side).

For each block size (``--block-values``, default 6,144 = one 16-token block of the benchmark's
model, all-MiniLM-L6-v2 with 384 K or V values per token, and 16,384 = one 16-token block of an
8B model with 8 KV heads x 128) the same BF16 values are cut into blocks and:

* **copy**: ``torch.clone`` of the blocks on the device (the bytes moved once; the ratios'
  denominator: what the codec costs compared with touching the same bytes);
* **encode**: :func:`kvgate.engines.kvcodec.codec.encode_blocks` (split, histograms, tables,
  chunk encode, packing into blobs on the host);
* **decode**: :func:`kvgate.engines.kvcodec.codec.decode_blocks` from the blobs back to a
  tensor on the device;
* **encode_device**: :func:`kvgate.engines.kvcodec.codec.encode_device`, the device part of
  encode (split, histograms, **tables**, canonical codes, chunk encode, raw-or-coded choice and
  packing into one device buffer; no copy to the host);
* **decode_device**: :func:`kvgate.engines.kvcodec.codec.run_decode` on a batch prepared once
  (lookup tables built on the device, chunk decode, merge; the host parsing of the blobs
  excluded).

The device rows are what the GPU targets are about (a kernel path against a device copy); the
whole-API rows add the host's share (one copy to the host and cutting blobs; parsing blobs).

Each is timed ``--repeats`` times (median; on a GPU with ``torch.cuda.synchronize`` around each)
after one warm-up. GB/s are raw BF16 bytes (2 per value) per second, 10^9 bytes. ``backend``
says what ran: the Triton kernels on a CUDA GPU, the torch reference on the CPU without one (the
kernels' interpreter is far too slow to time). ``--source real`` (default) reads real K/V
(:mod:`kvgate.engines.kvcodec.measure.realkv`); ``synthetic`` uses Gaussian values with K/V's
scale, seeded (a quick check of the report, not a saving to quote). The last stdout line is the
JSON report.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

DEFAULT_BLOCK_VALUES = (16 * 384, 16 * 8 * 128)


def _timed(fn: Callable[[], object], repeats: int, gpu: bool) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs, after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        if gpu:
            torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        if gpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def values(source: str, count: int, windows: int) -> Tensor:
    """A flat BF16 tensor of ``count`` values (0: all of the real K/V captured)."""
    if source == "real":
        from kvgate.engines.kvcodec.measure import realkv

        flat = torch.cat([x.reshape(-1) for x in realkv.capture(windows=windows).values()])
    else:
        gen = torch.Generator().manual_seed(20261128)
        flat = (torch.randn(count or 1 << 20, generator=gen) * 0.8).to(torch.bfloat16)
    return flat[:count] if count else flat


def measure(flat: Tensor, block_values: int, repeats: int, device: torch.device,
            backend_name: str) -> dict[str, Any]:
    from kvgate.engines.kvcodec.codec import Params, backend, decode_blocks, encode_blocks
    from kvgate.engines.kvcodec.measure.checks import same_bits

    n = flat.numel() // block_values
    if n == 0:
        raise ValueError(f"fewer than {block_values} values to cut into blocks")
    from kvgate.engines.kvcodec import container
    from kvgate.engines.kvcodec.codec import encode_device, prepare_decode, run_decode

    blocks = flat[:n * block_values].view(n, block_values).to(device)
    be, params, gpu = backend(backend_name), Params(), device.type == "cuda"
    blobs = encode_blocks(blocks, params, be)
    parsed = [container.parse(b) for b in blobs]
    coded = [p for p in parsed if p.mode == container.MODE_CODED]
    batch = prepare_decode(coded, device) if coded else None
    raw = 2 * blocks.numel()
    copy_s = _timed(blocks.clone, repeats, gpu)
    encode_s = _timed(lambda: encode_blocks(blocks, params, be), repeats, gpu)
    decode_s = _timed(lambda: decode_blocks(blobs, be, device), repeats, gpu)
    enc_dev_s = _timed(lambda: encode_device(blocks, params, be), repeats, gpu)
    dec_dev_s = (_timed(lambda: run_decode(batch, be), repeats, gpu) if batch is not None
                 else None)
    coded_raw = 2 * len(coded) * block_values
    stored = sum(len(b) for b in blobs)
    return {
        "block_values": block_values, "blocks": n, "raw_bytes": raw, "encoded_bytes": stored,
        "saving": 1 - stored / raw,
        "bit_exact": same_bits(decode_blocks(blobs, be, device).cpu(), blocks.cpu()),
        "copy_gbps": raw / copy_s / 1e9, "encode_gbps": raw / encode_s / 1e9,
        "decode_gbps": raw / decode_s / 1e9,
        "encode_vs_copy": copy_s / encode_s, "decode_vs_copy": copy_s / decode_s,
        "encode_device_gbps": raw / enc_dev_s / 1e9,
        "decode_device_gbps": coded_raw / dec_dev_s / 1e9 if dec_dev_s else None,
        "encode_device_vs_copy": copy_s / enc_dev_s,
        "decode_device_vs_copy": (copy_s * coded_raw / raw / dec_dev_s) if dec_dev_s else None,
        "coded_blocks": len(coded), "chunk": params.chunk, "format": f"KVC{params.version}",
        "seconds": {"copy": copy_s, "encode": encode_s, "decode": decode_s,
                    "encode_device": enc_dev_s, "decode_device": dec_dev_s},
    }


def _backend_label(name: str, gpu: bool) -> str:
    if name == "triton":
        return ("triton kernels (compiled, CUDA)" if gpu
                else "triton kernels (interpreter, CPU: a path check, not a speed)")
    return ("torch reference (CUDA)" if gpu
            else "torch reference (CPU; no GPU: GPU speed not measured)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    backend_name = args.backend if args.backend != "auto" else ("triton" if gpu else "torch")
    if backend_name == "triton" and not gpu:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: a path check only
    flat = values(args.source, args.values, args.windows)
    sizes = [int(v) for v in args.block_values.split(",")]
    rows = [measure(flat, size, args.repeats, device, backend_name) for size in sizes]
    return {
        "bit_exact": all(r["bit_exact"] for r in rows),
        "backend": _backend_label(backend_name, gpu),
        "device": torch.cuda.get_device_name() if gpu else "cpu",
        "gpu": gpu, "torch_threads": torch.get_num_threads(),
        "source": args.source, "values": flat.numel(), "repeats": args.repeats,
        "per_block_size": rows, "torch": torch.__version__,
    }


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvgate.engines.kvcodec.measure.speed")
    ap.add_argument("--source", choices=("real", "synthetic"), default="real")
    ap.add_argument("--values", type=int, default=0,
                    help="values used (0: every real K/V value; synthetic: 2^20)")
    ap.add_argument("--windows", type=int, default=4, help="256-token windows of real text")
    ap.add_argument("--block-values", default=",".join(map(str, DEFAULT_BLOCK_VALUES)),
                    help="comma-separated block sizes in values")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs (median)")
    ap.add_argument("--backend", choices=("auto", "torch", "triton"), default="auto",
                    help="auto: the Triton kernels on a CUDA GPU, the torch reference without")
    report = run(ap.parse_args(argv))
    for r in report["per_block_size"]:
        print(f"{r['block_values']:>6} values x {r['blocks']}: encode {r['encode_gbps']:.3f} "
              f"GB/s, decode {r['decode_gbps']:.3f} GB/s (device parts: encode "
              f"{r['encode_device_gbps']:.3f}, decode {r['decode_device_gbps'] or 0:.3f}), "
              f"copy {r['copy_gbps']:.2f} GB/s, "
              f"saving {r['saving']:.4f}, bit_exact {r['bit_exact']}", file=sys.stderr)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
