"""The cost function: table-driven cases (Kimi K2.5 reference prices, rounding, unknown and
estimated cached tokens, discounts, cache writes) and invariants over seeded random usage."""

from __future__ import annotations

import random
from decimal import Decimal

import pytest

from kvgate.pricing.cost import CachedSource, TokenCounts, cost
from kvgate.pricing.money import QUANTUM, money_str, parse_decimal, usd
from kvgate.pricing.prices import ModelPrice
from tests.unit.pricing.helpers import KIMI

D = Decimal
M = D(10**6)
WRITE = ModelPrice(input=D("0.60") / M, cached_input=D("0.10") / M, output=D("3.00") / M,
                   cache_write=D("0.75") / M)
ODD = ModelPrice(input=D("1.5000020000000002e-05"), cached_input=D(0), output=D(0))
TINY = ModelPrice(input=D("5e-11"), cached_input=D(0), output=D(0))

# (id, price, counts, discount, estimate, expected (input, cached, write, output, disc, total),
#  cached tokens billed, source)
CASES = [
    ("kimi-worked-example", KIMI, TokenCounts(10_000, 500, 8_000), D(0), None,
     ("0.0012", "0.0008", "0", "0.0015", "0", "0.0035"), 8_000, CachedSource.REPORTED),
    ("reported-zero-cached", KIMI, TokenCounts(10_000, 500, 0), D(0), None,
     ("0.006", "0", "0", "0.0015", "0", "0.0075"), 0, CachedSource.REPORTED),
    ("unknown-billed-uncached", KIMI, TokenCounts(10_000, 500, None), D(0), None,
     ("0.006", "0", "0", "0.0015", "0", "0.0075"), 0, CachedSource.UNKNOWN),
    ("unknown-with-estimate", KIMI, TokenCounts(10_000, 500, None), D(0), 8_000,
     ("0.0012", "0.0008", "0", "0.0015", "0", "0.0035"), 8_000, CachedSource.ESTIMATED),
    ("estimate-clamped-to-prompt", KIMI, TokenCounts(10_000, 500, None), D(0), 20_000,
     ("0", "0.001", "0", "0.0015", "0", "0.0025"), 10_000, CachedSource.ESTIMATED),
    ("negative-estimate-clamped", KIMI, TokenCounts(10_000, 0, None), D(0), -5,
     ("0.006", "0", "0", "0", "0", "0.006"), 0, CachedSource.ESTIMATED),
    ("reported-beats-estimate", KIMI, TokenCounts(10_000, 0, 2_000), D(0), 8_000,
     ("0.0048", "0.0002", "0", "0", "0", "0.005"), 2_000, CachedSource.REPORTED),
    ("tenant-discount-10pct", KIMI, TokenCounts(10_000, 500, 8_000), D("0.10"), None,
     ("0.0012", "0.0008", "0", "0.0015", "0.00035", "0.00315"), 8_000, CachedSource.REPORTED),
    ("all-cached", KIMI, TokenCounts(1_000, 0, 1_000), D(0), None,
     ("0", "0.0001", "0", "0", "0", "0.0001"), 1_000, CachedSource.REPORTED),
    ("nothing", KIMI, TokenCounts(0, 0, None), D(0), None,
     ("0", "0", "0", "0", "0", "0"), 0, CachedSource.UNKNOWN),
    ("one-million-output", KIMI, TokenCounts(0, 1_000_000, 0), D(0), None,
     ("0", "0", "0", "3", "0", "3"), 0, CachedSource.REPORTED),
    ("cache-write", WRITE, TokenCounts(1_000, 100, 500, cache_write=300), D(0), None,
     ("0.00012", "0.00005", "0.000225", "0.0003", "0", "0.000695"), 500, CachedSource.REPORTED),
    ("cache-write-defaults-to-input", KIMI, TokenCounts(1_000, 0, 500, cache_write=300),
     D(0), None, ("0.00012", "0.00005", "0.00018", "0", "0", "0.00035"), 500,
     CachedSource.REPORTED),
    # 3 x 1.5000020000000002e-05 = 4.5000060000000006e-05 -> rounds up at the 10th decimal
    ("rounding-up", ODD, TokenCounts(3, 0, 0), D(0), None,
     ("0.0000450001", "0", "0", "0", "0", "0.0000450001"), 0, CachedSource.REPORTED),
    # exact ties go to the even neighbour: 0.5e-10 -> 0, 1.5e-10 -> 2e-10, 2.5e-10 -> 2e-10
    ("half-even-tie-down", TINY, TokenCounts(1, 0, 0), D(0), None,
     ("0", "0", "0", "0", "0", "0"), 0, CachedSource.REPORTED),
    ("half-even-tie-up", TINY, TokenCounts(3, 0, 0), D(0), None,
     ("2e-10", "0", "0", "0", "0", "2e-10"), 0, CachedSource.REPORTED),
    ("half-even-tie-even", TINY, TokenCounts(5, 0, 0), D(0), None,
     ("2e-10", "0", "0", "0", "0", "2e-10"), 0, CachedSource.REPORTED),
    # discount of a tiny amount rounds too: 3e-10 x 0.5 = 1.5e-10 -> 2e-10; total 1e-10
    ("discount-rounding", TINY, TokenCounts(6, 0, 0), D("0.5"), None,
     ("3e-10", "0", "0", "0", "2e-10", "1e-10"), 0, CachedSource.REPORTED),
]


@pytest.mark.parametrize(("price", "counts", "discount", "estimate", "expected", "cached",
                          "source"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_cost_cases(price: ModelPrice, counts: TokenCounts, discount: Decimal,
                    estimate: int | None, expected: tuple[str, ...], cached: int,
                    source: CachedSource) -> None:
    c = cost(counts, price, discount, estimate)
    got = (c.input, c.cached_input, c.cache_write, c.output, c.discount, c.total)
    assert got == tuple(D(e) for e in expected)
    assert all(v.as_tuple().exponent == -10 for v in got), "every amount is quantized"
    assert (c.cached_tokens, c.cached_source) == (cached, source)


BAD = [
    ("cached-over-prompt", TokenCounts(10, 0, 11), D(0)),
    ("negative-prompt", TokenCounts(-1, 0, None), D(0)),
    ("negative-completion", TokenCounts(10, -1, 0), D(0)),
    ("negative-cached", TokenCounts(10, 0, -1), D(0)),
    ("cache-write-over-prompt", TokenCounts(10, 0, None, cache_write=11), D(0)),
    ("cached-plus-write-over-prompt", TokenCounts(10, 0, 6, cache_write=5), D(0)),
    ("discount-over-one", TokenCounts(10, 0, 0), D("1.5")),
    ("negative-discount", TokenCounts(10, 0, 0), D("-0.1")),
]


@pytest.mark.parametrize(("counts", "discount"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_cost_rejects_impossible_input(counts: TokenCounts, discount: Decimal) -> None:
    with pytest.raises(ValueError):
        cost(counts, KIMI, discount)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_breakdown_adds_up_and_cache_never_costs_more(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(500):
        prompt = rng.randint(0, 200_000)
        counts = TokenCounts(prompt, rng.randint(0, 8_000), rng.randint(0, prompt))
        discount = D(rng.randint(0, 100)) / 100
        c = cost(counts, KIMI, discount)
        assert c.total == c.input + c.cached_input + c.cache_write + c.output - c.discount
        assert c.gross == c.total + c.discount
        uncached = cost(TokenCounts(prompt, counts.completion, 0), KIMI, discount)
        assert c.total <= uncached.total
        assert c.total >= 0


PARSE = [("0.60", D("0.60")), ("  3 ", D(3)), (7, D(7)), (D("1e-7"), D("1e-7")), ("0", D(0))]
PARSE_BAD = [0.6, True, "abc", "-1", "NaN", "Infinity", None, [1]]


@pytest.mark.parametrize(("raw", "want"), PARSE)
def test_parse_decimal(raw: object, want: Decimal) -> None:
    assert parse_decimal(raw, "x") == want


@pytest.mark.parametrize("raw", PARSE_BAD, ids=repr)
def test_parse_decimal_rejects(raw: object) -> None:
    with pytest.raises(ValueError, match="x: "):
        parse_decimal(raw, "x")


def test_money_text_is_never_scientific() -> None:
    assert str(usd(D(0))) == "0E-10"  # why money_str exists
    assert money_str(usd(D(0))) == "0.0000000000"
    assert money_str(usd(D("1e-10"))) == "0.0000000001"
    assert usd(D("0.00000000015")) == 2 * QUANTUM
