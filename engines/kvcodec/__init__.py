"""Lossless BF16 KV-block codec (engine side: torch and Triton, never a gateway dependency).

Each BF16 value splits into a sign+mantissa byte (kept raw) and an exponent byte; the exponents
of a block are entropy-coded with the block's own length-limited canonical Huffman table, in
byte-aligned chunks so that a GPU decodes every chunk in its own lane. Modules:

* :mod:`kvgate.engines.kvcodec.huffman`: code lengths and canonical codes (pure Python, host side).
* :mod:`kvgate.engines.kvcodec.container`: the per-block byte format (header, table, chunk offsets).
* :mod:`kvgate.engines.kvcodec.reference`: the torch reference (CPU or any torch device).
* :mod:`kvgate.engines.kvcodec.kernels`: the Triton kernels (GPU; CPU through
``TRITON_INTERPRET=1``).
* :mod:`kvgate.engines.kvcodec.aot`: compile the kernels for a CUDA target without a GPU.
* :mod:`kvgate.engines.kvcodec.codec`: encode/decode of a batch of blocks with either backend.
* :mod:`kvgate.engines.kvcodec.store`: a Mooncake Store put/get wrapper that encodes on put.
* :mod:`kvgate.engines.kvcodec.measure.realkv` and :mod:`kvgate.engines.kvcodec.measure.bench`: real
K/V and the benchmark.
* :mod:`kvgate.engines.kvcodec.cli` (gateway side, no torch): ``kvgate codec bench``.

docs/kernels.md describes the design, format, parameters and figures.
"""
