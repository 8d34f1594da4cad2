"""``kvgate codec setup|bench``: the lossless BF16 KV-block codec (gateway side, no torch).

``bench`` sets up the engine-side environment (:mod:`kvgate.engines.kvcodec.venv`) and runs
``python -m engines.kvcodec.bench`` there; its last stdout line is the JSON report
(``bit_exact``, ``saving``, ``per_kind``, ``gpu_decode_gbps``...). ``--out`` also writes that
report, with the command that produced it, to a file (bench/results/codec-saving.json).
``bench --speed`` runs ``python -m kvgate.engines.kvcodec.measure.speed`` instead: encode and
decode GB/s per block size against a device copy of the same bytes, saving, bit-exactness and
the backend that ran (JSON on the last line, ``--out`` likewise).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from kvgate.engines.kvcodec.venv import engine_env, engine_side_path, ensure_codec_env

BENCH_OPTIONS = ("block_tokens", "chunk", "max_len", "windows", "triton_blocks", "repeats")
SPEED_OPTIONS = ("source", "values", "block_values", "windows", "repeats", "backend")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("codec", help="lossless BF16 KV-block codec (engine side)")
    csub = p.add_subparsers(dest="codec_command", required=True)
    csub.add_parser("setup", help="engine venv + the real model for K/V (idempotent)"
                    ).set_defaults(func=lambda a: _setup())
    b = csub.add_parser("bench", help="bit-exactness and saving on real K/V; GPU decode speed")
    b.add_argument("--json", action="store_true", help="print only the JSON report line")
    b.add_argument("--out", type=Path, help="also write the report (and command) here")
    for name in BENCH_OPTIONS:
        b.add_argument("--" + name.replace("_", "-"), type=int,
                       help="see python -m kvgate.engines.kvcodec.measure.bench --help")
    b.add_argument("--speed", action="store_true",
                   help="encode/decode GB/s per block size against a device copy of the same "
                        "bytes (python -m kvgate.engines.kvcodec.measure.speed) instead")
    b.add_argument("--source", choices=("real", "synthetic"), help="--speed: K/V source")
    b.add_argument("--values", type=int, help="--speed: values used (0: all)")
    b.add_argument("--block-values", help="--speed: comma-separated block sizes in values")
    b.add_argument("--backend", choices=("auto", "torch", "triton"),
                   help="--speed: auto (Triton on CUDA, torch reference on CPU), or force one "
                        "(triton without a GPU runs the interpreter: a path check, not a speed)")
    b.set_defaults(func=_bench)


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _setup() -> int:
    print(ensure_codec_env(_progress))
    return 0


def _passed(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    return [f"--{n.replace('_', '-')}={getattr(args, n)}" for n in names
            if getattr(args, n) is not None]


def _bench(args: argparse.Namespace) -> int:
    python = ensure_codec_env(_progress)
    if args.speed:  # its summary goes to stderr: stdout is the JSON line alone
        passed = ["--speed", *_passed(args, SPEED_OPTIONS)]
        cmd = [str(python), "-m", "kvgate.engines.kvcodec.measure.speed", *passed[1:]]
    else:
        passed = _passed(args, BENCH_OPTIONS)
        cmd = [str(python), "-m", "kvgate.engines.kvcodec.measure.bench",
               *(["--json"] if args.json else []), *passed]
    with engine_side_path() as path:
        done = subprocess.run(cmd, env=engine_env(path), stdout=subprocess.PIPE, text=True,
                              check=False)
    if done.returncode != 0:
        print(done.stdout, end="")
        return done.returncode
    lines = done.stdout.splitlines()
    if args.out is not None:
        report = json.loads(lines[-1])
        command = " ".join(["kvgate codec bench --json", *passed])
        args.out.write_text(json.dumps({**report, "command": command}, indent=1) + "\n")
    print("\n".join(lines))
    return 0
