"""Money: ``Decimal`` USD everywhere, quantized to 1e-10 USD with banker's rounding.

Why 1e-10 USD. Published prices have at most four decimals per million tokens ($0.0001 / M is
1e-10 per token), so ``tokens x price`` is exact at this quantum for every real price: rounding
only ever touches exotic imported prices (LiteLLM's map carries binary-float artefacts such as
``1.5000020000000002e-05``). The worst-case error is 0.5e-10 USD per line item, i.e. at most
$0.05 over a billion requests.

Why ROUND_HALF_EVEN. Half-up rounding biases every tie upward, which accumulates when millions of
records are summed; half-even is unbiased (and is what accountants call banker's rounding).

Why a local context with 60 digits. The default context has 28 significant digits, so quantizing
a large amount to 1e-10 could raise ``InvalidOperation``; 60 digits cover any token count times
any price without ever rounding before the final, explicit quantization.
"""

from __future__ import annotations

from decimal import ROUND_HALF_EVEN, Decimal, InvalidOperation, localcontext

QUANTUM = Decimal("1e-10")
MILLION = Decimal(1_000_000)
ZERO = Decimal(0)
PRECISION = 60


def usd(value: Decimal) -> Decimal:
    """``value`` quantized to the ledger's precision (1e-10 USD, half-even)."""
    with localcontext(prec=PRECISION, rounding=ROUND_HALF_EVEN):
        return value.quantize(QUANTUM)


def money_str(value: Decimal) -> str:
    """Plain decimal text, never scientific (``str(Decimal("0E-10"))`` would be ``0E-10``)."""
    return format(value, "f")


def times(tokens: int, price: Decimal) -> Decimal:
    """``tokens x price`` exactly (no intermediate rounding)."""
    with localcontext(prec=PRECISION):
        return Decimal(tokens) * price


def fraction_of(amount: Decimal, fraction: Decimal) -> Decimal:
    """``amount x fraction`` exactly."""
    with localcontext(prec=PRECISION):
        return amount * fraction


def exact_sum(values: list[Decimal]) -> Decimal:
    """The exact sum of ``values``."""
    with localcontext(prec=PRECISION):
        return sum(values, ZERO)


def parse_decimal(value: object, what: str) -> Decimal:
    """A finite, non-negative Decimal from a string, an int or a Decimal.

    Floats are refused: by the time a value is a float it may already be inexact (the loaders
    read numbers from their source text instead, so ``0.60`` in a file stays exactly 0.60).
    """
    if isinstance(value, (bool, float)):
        raise ValueError(f"{what}: give money as a string or integer, not {value!r}")
    if not isinstance(value, (str, int, Decimal)):
        raise ValueError(f"{what}: not a number: {value!r}")
    try:
        out = Decimal(value.strip() if isinstance(value, str) else value)
    except InvalidOperation:
        raise ValueError(f"{what}: not a number: {value!r}") from None
    if not out.is_finite():
        raise ValueError(f"{what}: must be finite, got {value!r}")
    if out < 0:
        raise ValueError(f"{what}: must be non-negative, got {value!r}")
    return out
