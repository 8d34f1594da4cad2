"""Lossless BF16 KV-block codec (engine side: torch and Triton, never a gateway dependency).

Each BF16 value splits into a sign+mantissa byte (kept raw) and an exponent byte; the exponents
of a block are entropy-coded with the block's own length-limited canonical Huffman table, in
byte-aligned chunks so that a GPU decodes every chunk in its own lane. Modules:

* :mod:`engines.kvcodec.huffman`: code lengths and canonical codes (pure Python, host side).
* :mod:`engines.kvcodec.container`: the per-block byte format (header, table, chunk offsets).
* :mod:`engines.kvcodec.reference`: the torch reference (CPU or any torch device).
* :mod:`engines.kvcodec.kernels`: the Triton kernels (GPU; CPU through ``TRITON_INTERPRET=1``).
* :mod:`engines.kvcodec.aot`: compile the kernels for a CUDA target without a GPU.
* :mod:`engines.kvcodec.codec`: encode/decode of a batch of blocks with either backend.
* :mod:`engines.kvcodec.store`: a Mooncake Store put/get wrapper that encodes on put.
* :mod:`engines.kvcodec.realkv` and :mod:`engines.kvcodec.bench`: real K/V and the benchmark.
* :mod:`engines.kvcodec.cli` (gateway side, no torch): ``kvgate codec bench``.

docs/kernels.md describes the design, format, parameters and figures.
"""
