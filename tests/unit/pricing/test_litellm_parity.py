"""kvgate's cost equals LiteLLM's (1.106.2) for the same usage and prices, once the cached
tokens are handed to LiteLLM the way it reads them.

How LiteLLM takes cached tokens (litellm/cost_calculator.py, llm_cost_calc/utils.py): from
``usage.prompt_tokens_details.cached_tokens`` (OpenAI style: ``prompt_tokens`` includes them)
or ``cost_per_token(..., cache_read_input_tokens=n)``; cache writes from
``prompt_tokens_details.cache_creation_tokens`` / ``cache_creation_input_tokens``. It bills
``prompt - cached - cache_write`` at ``input_cost_per_token`` -- the split kvgate uses. An
engine response whose cached count never reaches that field (LiteLLM issue #22984 for vLLM)
is billed by LiteLLM as all-uncached; kvgate flags such a request ``unknown`` instead.

Differences: LiteLLM works in binary floats (each price is the nearest double, each product
and sum rounds to 53 bits), kvgate in exact decimals quantized to 1e-10 USD. For the
published-style prices below (<= 4 decimals per million) kvgate's lines are exact, so the two
agree within 1e-12 relative (float error only). For LiteLLM's own odd prices the 1e-10
quantization of up to four lines is the only extra difference (asserted separately).
"""

from __future__ import annotations

import datetime as dt
import random
from collections.abc import Iterator
from decimal import Decimal
from types import ModuleType
from typing import Any

import pytest

from kvgate.pricing.cost import TokenCounts, cost
from kvgate.pricing.prices import ModelPrice, PriceBook, to_litellm

D = Decimal
M = D(10**6)
REL = D("1e-12")
# LiteLLM's own pydantic models warn at import; not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore:Item .* is using the `ReadOnly`:UserWarning")
ZERO = D(0)
AT = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


@pytest.fixture(scope="module")
def litellm() -> Iterator[ModuleType]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network at import
        module = pytest.importorskip("litellm", reason="pip install litellm==1.106.2")
        yield module
    for name in [m for m in module.model_cost if str(m).startswith("kvgate-parity")]:
        module.model_cost.pop(name)  # leave LiteLLM's process-wide map as we found it


def _register(litellm: ModuleType, name: str, price: ModelPrice) -> None:
    """Register kvgate's price with LiteLLM through kvgate's own exporter."""
    book = PriceBook({name: (price,)})
    litellm.register_model(to_litellm(book, AT, provider="openai"))


def _usage(litellm: ModuleType, counts: TokenCounts) -> Any:
    details: dict[str, int] = {"cached_tokens": counts.cached or 0}
    if counts.cache_write:
        details["cache_creation_tokens"] = counts.cache_write
    return litellm.Usage(prompt_tokens=counts.prompt, completion_tokens=counts.completion,
                         total_tokens=counts.prompt + counts.completion,
                         prompt_tokens_details=details)


def _close(ours: Decimal, theirs: float, absolute: Decimal = ZERO) -> bool:
    diff = abs(ours - D(theirs))
    return diff <= absolute + REL * max(abs(ours), D("1e-30"))


def _random_price(rng: random.Random) -> ModelPrice:
    def mtok() -> D:
        return D(rng.randint(1, 300_000)) / 10_000 / M

    return ModelPrice(input=mtok(), cached_input=mtok(), output=mtok(),
                      cache_write=mtok() if rng.random() < 0.5 else None)


def _random_counts(rng: random.Random) -> TokenCounts:
    prompt = rng.randint(0, 300_000)
    write = rng.randint(0, prompt) if rng.random() < 0.3 else 0
    return TokenCounts(prompt, rng.randint(0, 20_000), rng.randint(0, prompt - write), write)


KIMI = ModelPrice(D("0.60") / M, D("0.10") / M, D("3.00") / M)
FIXED = [
    ("kimi-cached", KIMI, TokenCounts(10_000, 500, 8_000)),
    ("kimi-uncached", KIMI, TokenCounts(10_000, 500, 0)),
    ("kimi-all-cached", KIMI, TokenCounts(4_096, 1, 4_096)),
    ("kimi-output-only", KIMI, TokenCounts(0, 777, 0)),
    ("writes", ModelPrice(D("3") / M, D("0.3") / M, D("15") / M, D("3.75") / M),
     TokenCounts(50_000, 2_000, 30_000, 15_000)),
]


@pytest.mark.parametrize(("price", "counts"), [f[1:] for f in FIXED], ids=[f[0] for f in FIXED])
def test_completion_cost_matches(litellm: ModuleType, price: ModelPrice,
                                 counts: TokenCounts) -> None:
    name = "kvgate-parity-fixed"
    _register(litellm, name, price)
    response = litellm.ModelResponse(model=name, usage=_usage(litellm, counts))
    theirs = litellm.completion_cost(completion_response=response, model=name,
                                     custom_llm_provider="openai")
    assert _close(cost(counts, price).total, theirs)


@pytest.mark.parametrize("seed", [11, 12, 13])
def test_cost_per_token_matches_on_random_usage(litellm: ModuleType, seed: int) -> None:
    rng = random.Random(seed)
    for i in range(40):
        name = f"kvgate-parity-{seed}-{i}"
        price, counts = _random_price(rng), _random_counts(rng)
        _register(litellm, name, price)
        ours = cost(counts, price)
        prompt_usd, completion_usd = litellm.cost_per_token(
            model=name, custom_llm_provider="openai", usage_object=_usage(litellm, counts))
        assert _close(ours.input + ours.cached_input + ours.cache_write, prompt_usd)
        assert _close(ours.output, completion_usd)
        # the keyword form LiteLLM also documents (prompt_tokens includes the cached ones)
        kw_prompt, kw_completion = litellm.cost_per_token(
            model=name, custom_llm_provider="openai", prompt_tokens=counts.prompt,
            completion_tokens=counts.completion, cache_read_input_tokens=counts.cached,
            cache_creation_input_tokens=counts.cache_write)
        assert _close(ours.total, kw_prompt + kw_completion)


def test_odd_float_prices_differ_only_by_quantization(litellm: ModuleType) -> None:
    price = ModelPrice(D("1.5000020000000002e-05"), D("1.5000000000000002e-06"),
                       D("7.500010000000001e-05"))
    name = "kvgate-parity-odd"
    _register(litellm, name, price)
    rng = random.Random(5)
    for _ in range(100):
        counts = _random_counts(rng)
        counts = TokenCounts(counts.prompt, counts.completion, counts.cached)
        prompt_usd, completion_usd = litellm.cost_per_token(
            model=name, custom_llm_provider="openai", usage_object=_usage(litellm, counts))
        assert _close(cost(counts, price).total, prompt_usd + completion_usd,
                      absolute=D("2e-10"))


def test_unreported_cached_tokens_are_billed_uncached_by_both(litellm: ModuleType) -> None:
    """What LiteLLM does when the engine's cached count is lost (its #22984): the full input
    price; kvgate bills the same but flags it ``unknown`` rather than pretending to know."""
    name = "kvgate-parity-unknown"
    _register(litellm, name, KIMI)
    counts = TokenCounts(10_000, 500, None)
    ours = cost(counts, KIMI)
    usage = litellm.Usage(prompt_tokens=10_000, completion_tokens=500, total_tokens=10_500)
    theirs = litellm.completion_cost(
        completion_response=litellm.ModelResponse(model=name, usage=usage), model=name,
        custom_llm_provider="openai")
    assert _close(ours.total, theirs)
    assert ours.cached_source == "unknown"
