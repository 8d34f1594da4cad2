"""BF16 edge cases for the round-trip checks (seeded; engine side).

Each case is a (blocks, values) BF16 tensor built from raw 16-bit words:

* ``specials``: +-0, +-Inf, quiet/signalling/negative NaNs with payloads, the largest finite
  value, the smallest normal and every subnormal (exponent 0) of both signs, shuffled.
* ``all_exponents_uniform``: all 256 exponents equally likely, random sign and mantissa: the
  exponent entropy is 8 bits, coding cannot pay and the block must come back raw.
* ``all_exponents_skewed``: all 256 exponents in every block, counts halving from 4096 down
  to 1 (8,434 values a block): coded, and Huffman would give the 244 singletons codes of more
  than 12 bits, so the length limit is exercised.
* ``random_words``: uniform 16-bit words (raw).
* ``constant``: one value everywhere (a single-symbol table: a 1-bit code).
* ``single``: one value in one block.
* ``odd_size``: a size that is not a multiple of the chunk (a short last chunk).
* ``gaussian``: N(0, 0.02) like trained activations (coded).
"""

from __future__ import annotations

import torch
from torch import Tensor

SPECIAL_WORDS = [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7F81, 0xFFC1, 0x7FFF,
                 0xFFFF, 0x7F7F, 0xFF7F, 0x0080, 0x8080]


def _words(values: Tensor) -> Tensor:
    """int64 words 0..65535 -> BF16 with exactly those bits."""
    return (values.to(torch.int32) & 0xFFFF).to(torch.int16).view(torch.bfloat16)


def _with_exponents(exp: Tensor, gen: torch.Generator) -> Tensor:
    low = torch.randint(0, 1 << 16, exp.shape, generator=gen) & 0x807F
    return _words(low | (exp << 7))


def cases(seed: int = 0, blocks: int = 2, values: int = 700) -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    subnormals = list(range(1, 0x80)) + [0x8000 | w for w in range(1, 0x80)]
    specials = torch.tensor(SPECIAL_WORDS + subnormals)
    pick = torch.randint(0, specials.numel(), (blocks, values), generator=gen)
    pick[0, :specials.numel()] = torch.arange(specials.numel())
    uniform = torch.arange(blocks * values).remainder(256).view(blocks, values)
    ranks = torch.arange(256)
    skew = torch.repeat_interleave(ranks, 2 ** (12 - ranks.clamp(max=12)))  # 8434 per block
    skewed = torch.stack([skew[torch.randperm(skew.numel(), generator=gen)]
                          for _ in range(blocks)])
    return {
        "specials": _words(specials[pick]),
        "all_exponents_uniform": _with_exponents(uniform, gen),
        "all_exponents_skewed": _with_exponents(skewed, gen),
        "random_words": _words(torch.randint(0, 1 << 16, (blocks, values), generator=gen)),
        "constant": torch.full((blocks, values), 0.375, dtype=torch.bfloat16),
        "single": torch.tensor([[-1.5]], dtype=torch.bfloat16),
        "odd_size": (torch.randn((blocks, values + 77), generator=gen) * 3).to(torch.bfloat16),
        "gaussian": (torch.randn((blocks, values), generator=gen) * 0.02).to(torch.bfloat16),
    }
