"""Compile the Triton kernels ahead of time for a CUDA GPU, on a machine without one.

``python -m kvgate.engines.kvcodec.aot [--arch 90]`` (never with ``TRITON_INTERPRET=1``: the
interpreter replaces the compiler) runs Triton's whole pipeline (TTIR, TTGIR, LLVM IR, PTX
and, with the ``ptxas`` Triton ships, a cubin) for each kernel with the argument types the
launchers pass, and prints one JSON object: per kernel whether it compiled and the sizes of its
PTX and cubin. The interpreter runs the kernels' arithmetic with numpy and accepts things the
compiler rejects (it let a typing annotation through that the code generator refuses), so this
is the check that the kernels would build for the GPU; it says nothing about their speed.
Default target: sm_90 (H100/H200).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvgate.engines.kvcodec import kernels

#: The chunk the kernels are compiled for: the codec's default (``codec.Params``).
CHUNK = 128

#: (kernel, argument types in order, constexpr values): what kernels.py's launchers pass
#: (checked against ``kernels.LAUNCHES`` by tests/unit/engines/test_kvcodec_device.py).
SIGNATURES: dict[str, tuple[Any, dict[str, str], dict[str, int]]] = {
    "split": (kernels._split_kernel,
              {"words_ptr": "*i16", "sm_ptr": "*u8", "exp_ptr": "*u8", "total": "i32",
               "elems": "constexpr"}, {"elems": kernels.ELEMS}),
    "merge": (kernels._merge_kernel,
              {"sm_ptr": "*u8", "exp_ptr": "*u8", "words_ptr": "*i16", "total": "i32",
               "elems": "constexpr"}, {"elems": kernels.ELEMS}),
    "encode": (kernels._encode_kernel,
               {"exp_ptr": "*u8", "codes_ptr": "*i32", "lens_ptr": "*i32", "out_ptr": "*u8",
                "nbytes_ptr": "*i32", "n": "i32", "n_chunks": "i32", "n_lanes": "i32",
                "cap": "i32", "chunk": "constexpr", "lanes": "constexpr"},
               {"chunk": CHUNK, "lanes": kernels.LANES}),
    "decode": (kernels._decode_kernel,
               {"stream_ptr": "*u8", "starts_ptr": "*i64", "luts_ptr": "*i32", "out_ptr": "*u8",
                "n": "i32", "n_chunks": "i32", "n_lanes": "i32", "chunk": "constexpr",
                "max_len": "constexpr", "lanes": "constexpr"},
               {"chunk": CHUNK, "max_len": 12, "lanes": kernels.LANES}),
    "decode_multi": (kernels._decode_multi_kernel,
                     {"stream_ptr": "*u8", "starts_ptr": "*i64", "luts_ptr": "*i32",
                      "out_ptr": "*u8", "n": "i32", "n_chunks": "i32", "n_lanes": "i32",
                      "chunk": "constexpr", "max_len": "constexpr", "lanes": "constexpr"},
                     {"chunk": CHUNK, "max_len": 12, "lanes": kernels.LANES}),
    "lengths": (kernels._lengths_kernel,
                {"weights_ptr": "*i32", "present_ptr": "*i32", "nodes_ptr": "*i32",
                 "leaf_parent_ptr": "*i32", "node_parent_ptr": "*i32", "depth_ptr": "*i32",
                 "n_blocks": "i32", "lanes": "constexpr"},
                {"lanes": kernels.TABLE_LANES}),
}


def compile_one(name: str, arch: int) -> dict[str, Any]:
    fn, signature, constants = SIGNATURES[name]
    order = list(signature)
    source = ASTSource(fn, signature, constexprs={(order.index(k),): v
                                                  for k, v in constants.items()})
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32))
    except (triton.CompilationError, RuntimeError) as exc:
        return {"ok": False, "error": str(exc)[-2000:]}
    asm = compiled.asm
    return {"ok": True, "ptx_bytes": len(asm.get("ptx", "")),
            "cubin_bytes": len(asm.get("cubin", b""))}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvgate.engines.kvcodec.aot")
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability x 10")
    ap.add_argument("--kernels", default=",".join(SIGNATURES), help="comma-separated subset")
    args = ap.parse_args(argv)
    report = {name: compile_one(name, args.arch) for name in args.kernels.split(",")}
    print(json.dumps({"arch": f"sm_{args.arch}", "kernels": report}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
