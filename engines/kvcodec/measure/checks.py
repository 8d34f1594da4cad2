"""Round-trip checks over the edge cases, with every backend (engine side).

``python -m kvgate.engines.kvcodec.measure.checks [--chunk N] [--max-len L] [--backends
torch,triton]`` prints one JSON object: per case, whether every backend wrote the same bytes,
whether every backend decoded them to the same 16-bit words, the blocks' modes and longest code. Run
it with ``TRITON_INTERPRET=1`` where there is no GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch
from torch import Tensor

from kvgate.engines.kvcodec import container
from kvgate.engines.kvcodec.codec import Backend, Params, backend, decode_blocks, encode_blocks
from kvgate.engines.kvcodec.measure.edgecases import cases


def same_bits(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and bool(torch.equal(a.view(torch.int16).cpu(),
                                                   b.view(torch.int16).cpu()))


def check_case(x: Tensor, params: Params, backends: dict[str, Backend],
               device: torch.device) -> dict[str, Any]:
    blobs = {name: encode_blocks(x.to(device), params, be) for name, be in backends.items()}
    first = next(iter(blobs.values()))
    parsed = [container.parse(b) for b in first]
    return {
        "bytes_equal": all(b == first for b in blobs.values()),
        "round_trip": {name: same_bits(decode_blocks(first, be, device), x)
                       for name, be in backends.items()},
        "modes": ["raw" if p.mode == container.MODE_RAW else "coded" for p in parsed],
        "max_code_len": max((max(p.lengths, default=0) for p in parsed), default=0),
        "bytes": sum(len(b) for b in first),
        "raw_bytes": 2 * x.numel(),
    }


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvgate.engines.kvcodec.measure.checks")
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=12)
    ap.add_argument("--backends", default="torch,triton")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    params = Params(chunk=args.chunk, max_len=args.max_len)
    backends = {name: backend(name) for name in args.backends.split(",")}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    report = {name: check_case(x, params, backends, device)
              for name, x in cases(args.seed).items()}
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
