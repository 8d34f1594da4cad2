"""Seeded checks of the device tables, the device packing and the multi-symbol decoder against
the host oracle (engine side; run with ``TRITON_INTERPRET=1`` where there is no GPU).

``python -m kvgate.engines.kvcodec.measure.devicechecks NAME`` prints one JSON object with
``ok`` and what was compared. Names (each a few seconds to ~20 s in the interpreter):

* ``tables``: :mod:`kvgate.engines.kvcodec.tables` (torch, all blocks at once) gives the same
  code lengths and canonical codes as ``huffman.py`` over seeded random histograms and the
  degenerate ones (1 symbol, 2 symbols, all 256 equal, a geometric skew that forces the
  length limit, KV-like), for ``max_len`` 8, 12 and 15.
* ``kernel_tables``: the Triton ``_lengths_kernel`` gives ``huffman.py``'s plain lengths over
  the degenerate and random histograms (one launch).
* ``kernel_limit``: its length-limited lengths (a histogram that needs one halving round, and
  a KV-like one) equal ``huffman.py``'s.
* ``oracle_bytes``: :func:`kvgate.engines.kvcodec.codec.encode_device` (torch backend) writes the
  bytes of the host oracle (``huffman.py`` tables, the reference chunk encoder,
  ``container.pack_coded`` / ``pack_raw``), for KVC1 (chunk 512: today's bytes) and KVC2
  (chunk 128), over the edge cases.
* ``multi_luts``: every entry of :func:`kvgate.engines.kvcodec.tables.multi_luts` equals a
  bit-by-bit decode of its window with the canonical code (random and degenerate tables).
* ``triton_roundtrip``: the Triton kernels (tables, encode, multi-symbol decode) write the
  reference's bytes and decode them bit-exactly, on one batch of edge-case blocks.
* ``kvc1``: KVC1 blobs (chunk 512, the previous default) decode bit-exactly with both backends.
* ``launches``: the argument types the launchers pass equal
  :data:`kvgate.engines.kvcodec.aot.SIGNATURES` (what the sm_90 compile was given), for every
  kernel.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from kvgate.engines.kvcodec import container, huffman, reference, tables
from kvgate.engines.kvcodec.codec import Params, decode_blocks, encode_blocks, histogram
from kvgate.engines.kvcodec.measure.checks import same_bits
from kvgate.engines.kvcodec.measure.edgecases import cases

SEED = 20261129


def histograms(count: int = 36, seed: int = SEED) -> list[list[int]]:
    """Degenerate histograms first, then seeded random ones of several shapes."""
    rng = random.Random(seed)
    one = [0] * 256
    one[77] = 1000
    two = [0] * 256
    two[3], two[250] = 5, 1
    geometric = [1 << max(0, 20 - s) for s in range(256)]
    rng.shuffle(geometric)
    out = [one, two, [1] * 256, [9] * 256, geometric]
    while len(out) < count:
        kind = len(out) % 4
        if kind == 0:
            h = [rng.randrange(0, 50) for _ in range(256)]
        elif kind == 1:
            h = [rng.choice([0, 0, 0, 1, 2, 3, 5, 8, 1000]) for _ in range(256)]
        elif kind == 2:
            h = [0] * 256
            for _ in range(6144):
                h[min(255, max(0, round(rng.gauss(120, 1.5))))] += 1
        else:
            h = [0] * 256
            for s in rng.sample(range(256), rng.randrange(1, 20)):
                h[s] = rng.randrange(1, 1 << rng.randrange(1, 24))
        out.append(h if any(h) else one)
    return out


def check_tables() -> dict[str, Any]:
    hs = histograms()
    t = torch.tensor(hs)
    rows = {}
    for max_len in (8, 12, 15):
        want = [huffman.code_lengths(h, max_len) for h in hs]
        got = tables.limited_lengths(t, max_len)
        codes = tables.canonical_codes(got)
        rows[max_len] = (got.tolist() == want
                         and codes.tolist() == [huffman.canonical_codes(w) for w in want])
    free = tables.huffman_lengths(t).tolist() == [huffman._huffman_lengths(h) for h in hs]
    limit_binds = max(huffman._huffman_lengths(hs[4])) > 12
    return {"ok": all(rows.values()) and free and limit_binds, "histograms": len(hs),
            "equal_per_max_len": rows, "plain_equal": free, "limit_binds": limit_binds}


def check_kernel_tables() -> dict[str, Any]:
    from kvgate.engines.kvcodec import kernels

    hs = histograms(count=16)
    plain = kernels.huffman_lengths(torch.tensor(hs)).tolist()
    plain_ok = plain == [huffman._huffman_lengths(h) for h in hs]
    return {"ok": plain_ok, "histograms": len(hs), "plain_equal": plain_ok}


def check_kernel_limit() -> dict[str, Any]:
    from kvgate.engines.kvcodec import kernels

    # 14 symbols halving from 2**13 (and a few singletons): plain Huffman gives 13-bit
    # codes; one halving round fits 12 bits.
    skew = [0] * 256
    for i, s in enumerate(range(100, 114)):
        skew[s] = 1 << (13 - i)
    kv_like = histograms(count=7)[6]
    want = [huffman.code_lengths(h, 12) for h in (skew, kv_like)]
    limited = kernels.code_lengths(torch.tensor([skew, kv_like]), 12).tolist()
    binds = max(huffman._huffman_lengths(skew)) > 12
    return {"ok": limited == want and binds, "limited_equal": limited == want,
            "limit_binds": binds, "limited_max_len": max(limited[0])}


def host_encode(x: Tensor, params: Params) -> list[bytes]:
    """The host oracle: ``huffman.py`` tables, the reference chunk encoder, ``container``."""
    n = x.shape[1]
    sm, exp = reference.split(x)
    out = []
    for i in range(x.shape[0]):
        counts = histogram(exp[i:i + 1]).tolist()[0]
        lengths = huffman.code_lengths(counts, params.max_len)
        codes = huffman.canonical_codes(lengths)
        buf, nbytes = reference.encode_chunks(exp[i:i + 1], torch.tensor([codes]),
                                              torch.tensor([lengths]), params.chunk,
                                              params.max_len)
        sizes = nbytes[0].tolist()
        stream = b"".join(bytes(buf[0, c, :k].tolist()) for c, k in enumerate(sizes))
        if params.version == 2:
            field = bytes(sizes)
        else:
            field = b"".join(int(e).to_bytes(4, "little")
                             for e in torch.tensor(sizes).cumsum(0).tolist())
        size = container.coded_size(n, params.chunk, lengths, len(stream), params.version)
        if size >= container.HEADER.size + 2 * n:
            out.append(container.pack_raw(n, params.chunk,
                                          x[i].view(torch.int16).numpy().tobytes(),
                                          params.version))
        else:
            out.append(container.pack_coded(n, params.chunk, params.max_len, lengths, field,
                                            sm[i].numpy().tobytes(), stream, params.version))
    return out


def check_oracle_bytes() -> dict[str, Any]:
    rows = {}
    for version, chunk in ((1, 512), (2, 128), (2, 64)):
        params = Params(chunk=chunk, version=version)
        for name, x in cases(0).items():
            got = encode_blocks(x, params, reference)
            rows[f"KVC{version}/{chunk}/{name}"] = (
                got == host_encode(x, params) and same_bits(decode_blocks(got, reference), x))
    return {"ok": all(rows.values()), "cases": rows}


def _bit_decode(window: int, lengths: list[int], codes: list[int], max_len: int,
                limit: int) -> tuple[list[int], int]:
    """Whole symbols at the start of a ``max_len``-bit window, at most ``limit``, bit by bit."""
    lookup = {(lengths[s], codes[s]): s for s in range(256) if lengths[s]}
    bits = format(window, f"0{max_len}b")
    out: list[int] = []
    used = 0
    while len(out) < limit:
        for ln in range(1, max_len - used + 1):
            s = lookup.get((ln, int(bits[used:used + ln], 2)))
            if s is not None:
                out.append(s)
                used += ln
                break
        else:
            break
    return out, used


def check_multi_luts() -> dict[str, Any]:
    hs = histograms(count=8)
    max_len = 10  # 1,024 windows a table: every entry checked, bit by bit
    lengths = tables.limited_lengths(torch.tensor(hs), max_len)
    codes = tables.canonical_codes(lengths)
    luts = tables.multi_luts(lengths, codes, max_len).tolist()
    bad = 0
    for b in range(len(hs)):
        ln, cd = lengths[b].tolist(), codes[b].tolist()
        single = len([s for s in ln if s]) == 1
        for w, e in enumerate(luts[b]):
            syms, used = _bit_decode(w, ln, cd, max_len, tables.MULTI)
            if single and w:
                # A lone symbol's code is "0" and its chunks are all zero bits: a 1 in the
                # window lies past the chunk's end, where decoded symbols are never stored.
                continue
            got = [(e >> (8 * j)) & 0xFF for j in range((e >> tables.COUNT_SHIFT) & 3)]
            bad += (got, (e >> tables.USED_SHIFT) & 15) != (syms, used)
    return {"ok": bad == 0, "tables": len(hs), "windows": len(hs) << max_len,
            "mismatches": bad}


def check_triton_roundtrip() -> dict[str, Any]:
    from kvgate.engines.kvcodec import kernels

    rows = {}
    every = cases(0)
    # one batch: specials, a constant (1-bit code), a short last chunk, Gaussian, raw words
    x = torch.cat([every["specials"][:, :700], every["constant"], every["odd_size"][:, :700],
                   every["gaussian"], every["random_words"]])
    ref = encode_blocks(x, Params(), reference)
    got = encode_blocks(x, Params(), kernels)
    rows["bytes_equal_reference"] = got == ref
    rows["modes"] = [container.parse(b).mode for b in got] == [0] * 8 + [1] * 2
    rows["bit_exact"] = same_bits(decode_blocks(got, kernels), x)
    return {"ok": all(rows.values()), "cases": rows, "blocks": x.shape[0]}


def check_kvc1() -> dict[str, Any]:
    from kvgate.engines.kvcodec import kernels

    x = torch.cat([cases(0)["gaussian"], cases(0)["odd_size"][:, :700]])
    old = encode_blocks(x, Params(chunk=512, version=1), reference)
    rows = {"version": container.parse(old[0]).version == 1,
            "triton": same_bits(decode_blocks(old, kernels), x),
            "torch": same_bits(decode_blocks(old, reference), x)}
    return {"ok": all(rows.values()), "cases": rows}


def check_launches() -> dict[str, Any]:
    from kvgate.engines.kvcodec import aot, kernels

    kernels.LAUNCHES = []
    x = cases(0)["gaussian"]
    blobs = encode_blocks(x, Params(), kernels)
    decode_blocks(blobs, kernels)
    parsed = [container.parse(b) for b in blobs]
    from kvgate.engines.kvcodec.codec import prepare_decode

    batch = prepare_decode(parsed, torch.device("cpu"))
    kernels.decode_chunks_single(batch.stream, batch.starts, batch.lengths, batch.codes,
                                 batch.n, batch.chunk, batch.max_len)
    seen: dict[str, Any] = {}
    by_fn = {fn.fn.__name__: name for name, (fn, _, _) in aot.SIGNATURES.items()}
    for fn_name, types, consts, grid in kernels.LAUNCHES:
        name = by_fn[fn_name]
        _, signature, constants = aot.SIGNATURES[name]
        want = [t for t in signature.values() if t != "constexpr"]
        seen[name] = {"types_equal": types == want, "constexprs_equal": consts == constants,
                      "grid": list(grid)}
    kernels.LAUNCHES = None
    ok = set(seen) == set(aot.SIGNATURES) and all(
        v["types_equal"] and v["constexprs_equal"] for v in seen.values())
    return {"ok": ok, "kernels": seen}


CHECKS: dict[str, Callable[[], dict[str, Any]]] = {
    "tables": check_tables, "kernel_tables": check_kernel_tables,
    "oracle_bytes": check_oracle_bytes, "multi_luts": check_multi_luts,
    "kernel_limit": check_kernel_limit, "triton_roundtrip": check_triton_roundtrip,
    "kvc1": check_kvc1, "launches": check_launches,
}


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in CHECKS:
        print(f"usage: python -m kvgate.engines.kvcodec.measure.devicechecks "
              f"{{{','.join(CHECKS)}}}", file=sys.stderr)
        return 2
    print(json.dumps(CHECKS[argv[0]]()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
