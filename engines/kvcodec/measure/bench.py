"""``python -m kvgate.engines.kvcodec.measure.bench [--json]``: the codec on real K/V (engine side).

Steps: capture all-MiniLM-L6-v2's K and V on its model card
(:mod:`kvgate.engines.kvcodec.measure.realkv`); cut each (layer, kind) tensor into engine KV blocks
of ``--block-tokens`` tokens x 384 values; encode and decode every block with the torch reference
(bit-exact check, bytes saved, ideal saving from each block's exponent entropy); encode
``--triton-blocks`` blocks per tensor with the Triton kernels (through the interpreter when there is
no GPU) and check that they write the reference's bytes and decode them bit-exactly; run the edge
cases (:mod:`kvgate.engines.kvcodec.measure.checks`). With a CUDA GPU, time the Triton decode of
every block (``gpu_decode_gbps``: decoded BF16 bytes per second, kernel launches only, median of
``--repeats``); without one it is ``null``. ``triton_compile``: the kernels compiled ahead of
time for sm_90 (:mod:`kvgate.engines.kvcodec.aot`), with or without a GPU. The last stdout line is
one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
from torch import Tensor

VALUES_PER_TOKEN = 384  # MiniLM: 12 heads x 32 head_dim


def _entropy_bits(exp: Tensor) -> Tensor:
    """Per block (row): Shannon entropy of its exponent bytes, bits per value."""
    from kvgate.engines.kvcodec.codec import histogram

    p = histogram(exp).double()
    p = p / p.sum(dim=1, keepdim=True)
    return -(torch.where(p > 0, p * p.log2(), 0.0)).sum(dim=1)


def measure_tensor(blocks: Tensor, params: Any) -> dict[str, Any]:
    from kvgate.engines.kvcodec import reference
    from kvgate.engines.kvcodec.codec import decode_blocks, encode_blocks
    from kvgate.engines.kvcodec.measure.checks import same_bits

    blobs = encode_blocks(blocks, params, reference)
    raw = 2 * blocks.numel()
    encoded = sum(len(b) for b in blobs)
    _, exp = reference.split(blocks)
    h = _entropy_bits(exp)
    return {"bit_exact": same_bits(decode_blocks(blobs, reference), blocks),
            "raw_bytes": raw, "encoded_bytes": encoded, "saving": 1 - encoded / raw,
            "exponent_entropy_bits": float(h.mean()),
            "ideal_saving": float(((8 - h) / 16).mean()),
            "raw_blocks": sum(1 for b in blobs if b[4] == 1)}


def _sum_kind(per_tensor: dict[str, dict[str, Any]], kind: str) -> dict[str, Any]:
    rows = [v for k, v in per_tensor.items() if k.startswith(kind)]
    raw = sum(r["raw_bytes"] for r in rows)
    enc = sum(r["encoded_bytes"] for r in rows)
    return {"saving": 1 - enc / raw, "raw_bytes": raw, "encoded_bytes": enc,
            "ideal_saving": statistics.fmean(r["ideal_saving"] for r in rows),
            "exponent_entropy_bits": statistics.fmean(r["exponent_entropy_bits"] for r in rows),
            "per_layer_saving": [round(r["saving"], 5) for r in rows]}


def _triton_check(blocks: Tensor, params: Any, device: torch.device) -> dict[str, Any]:
    from kvgate.engines.kvcodec import kernels, reference
    from kvgate.engines.kvcodec.codec import decode_blocks, encode_blocks
    from kvgate.engines.kvcodec.measure.checks import same_bits

    ref = encode_blocks(blocks, params, reference)
    got = encode_blocks(blocks.to(device), params, kernels)
    return {"blocks": blocks.shape[0], "bytes_equal_reference": got == ref,
            "bit_exact": same_bits(decode_blocks(got, kernels, device), blocks)}


def _gpu_decode_gbps(blocks: Tensor, params: Any, repeats: int) -> float:
    from kvgate.engines.kvcodec import container, kernels
    from kvgate.engines.kvcodec.codec import encode_blocks, prepare_decode, run_decode

    dev = torch.device("cuda")
    parsed = [container.parse(b) for b in encode_blocks(blocks.to(dev), params, kernels)]
    batch = prepare_decode([p for p in parsed if p.mode == container.MODE_CODED], dev)
    run_decode(batch, kernels)  # compile and warm up
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        run_decode(batch, kernels)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return float(2 * batch.sm.numel() / statistics.median(times) / 1e9)


def _aot() -> dict[str, Any]:
    """kvgate.engines.kvcodec.aot in a child without the interpreter (it replaces the compiler)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "kvgate.engines.kvcodec.aot"], env=env,
                          stdout=subprocess.PIPE, text=True, timeout=600, check=True)
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvgate.engines.kvcodec import reference
    from kvgate.engines.kvcodec.codec import Params, backend, histogram, tables
    from kvgate.engines.kvcodec.measure import realkv
    from kvgate.engines.kvcodec.measure.checks import check_case
    from kvgate.engines.kvcodec.measure.edgecases import cases
    from kvgate.engines.kvcodec.tables import canonical_codes

    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    from kvgate.engines.kvcodec import container

    version = 2 if container.chunk_fits(2, args.chunk, args.max_len) else 1  # KVC1 past 170
    params = Params(chunk=args.chunk, max_len=args.max_len, version=version)
    kv = realkv.capture(windows=args.windows)
    values = args.block_tokens * VALUES_PER_TOKEN
    per_tensor = {name: measure_tensor(x.reshape(-1, values), params) for name, x in kv.items()}
    sample = torch.cat([x.reshape(-1, values)[:args.triton_blocks] for x in kv.values()])
    triton = _triton_check(sample, params, device)
    backends = {"torch": backend("torch"), "triton": backend("triton")}
    edges = {name: check_case(x, Params(chunk=64, max_len=args.max_len), backends, device)
             for name, x in cases(0).items()}
    all_hist = torch.cat([histogram(reference.split(x.reshape(-1, values))[1])
                          for x in kv.values()])
    host_lengths, host_codes = tables(all_hist, params.max_len)
    dev_lengths = reference.code_lengths(all_hist, params.max_len)
    raw = sum(v["raw_bytes"] for v in per_tensor.values())
    enc = sum(v["encoded_bytes"] for v in per_tensor.values())
    all_blocks = torch.cat([x.reshape(-1, values) for x in kv.values()])
    return {
        "bit_exact": (all(v["bit_exact"] for v in per_tensor.values()) and triton["bit_exact"]
                      and dev_lengths.tolist() == host_lengths
                      and triton["bytes_equal_reference"]
                      and all(e["bytes_equal"] and all(e["round_trip"].values())
                              for e in edges.values())),
        "saving": 1 - enc / raw,
        "ideal_saving": statistics.fmean(v["ideal_saving"] for v in per_tensor.values()),
        "per_kind": {kind: _sum_kind(per_tensor, kind) for kind in ("K", "V")},
        "per_tensor": per_tensor,
        "triton": {**triton, "mode": "gpu" if gpu else "interpreter (TRITON_INTERPRET=1)"},
        "triton_compile": _aot(),
        "device_tables_equal_host": {
            "blocks": all_hist.shape[0],
            "lengths": dev_lengths.tolist() == host_lengths,
            "codes": canonical_codes(dev_lengths).tolist() == host_codes},
        "edge_cases": edges,
        "gpu": torch.cuda.get_device_name() if gpu else None,
        "gpu_decode_gbps": _gpu_decode_gbps(all_blocks, params, args.repeats) if gpu else None,
        "setup": {"model": f"{realkv.PACKAGE}=={realkv.VERSION}", "text": "its model card",
                  "tokens": args.windows * realkv.WINDOW, "block_tokens": args.block_tokens,
                  "block_values": values, "blocks": all_blocks.shape[0],
                  "chunk": params.chunk, "max_len": params.max_len,
                  "format": f"KVC{params.version}",
                  "torch": torch.__version__},
    }


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvgate.engines.kvcodec.measure.bench")
    ap.add_argument("--json", action="store_true", help="only the JSON line")
    ap.add_argument("--block-tokens", type=int, default=16, help="tokens per KV block")
    ap.add_argument("--chunk", type=int, default=128, help="exponents per chunk (lane)")
    ap.add_argument("--max-len", type=int, default=12, help="longest Huffman code, bits")
    ap.add_argument("--windows", type=int, default=4, help="256-token sequences of text")
    ap.add_argument("--triton-blocks", type=int, default=1, help="blocks per tensor (Triton)")
    ap.add_argument("--repeats", type=int, default=20, help="GPU decode timings (median)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    report = run(args)
    if not args.json:
        for kind, row in report["per_kind"].items():
            print(f"{kind}: saving {row['saving']:.4f} (ideal {row['ideal_saving']:.4f}), "
                  f"exponent entropy {row['exponent_entropy_bits']:.3f} bits")
        print(f"bit_exact {report['bit_exact']}, gpu_decode_gbps {report['gpu_decode_gbps']}")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
