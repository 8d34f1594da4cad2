"""The price book: kvgate YAML, LiteLLM's price map, export and round trips, validation."""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
import random
from decimal import Decimal
from pathlib import Path

import pytest
import yaml

from kvgate.pricing.prices import (
    EPOCH,
    ModelPrice,
    PriceBook,
    PriceError,
    dump_book,
    litellm_json,
    load_book,
    parse_book_text,
    parse_litellm,
    parse_litellm_text,
    to_litellm,
)

D = Decimal
M = D(10**6)
UTC = dt.UTC
BOOK = """
models:
  kimi-k2.5:
    - effective_from: 2026-01-01
      input_per_mtok: 0.60
      cached_input_per_mtok: 0.10
      output_per_mtok: 3.00
    - effective_from: 2026-06-01T00:00:00+02:00
      input_per_mtok: "0.50"
      cached_input_per_mtok: 0.05
      output_per_mtok: 2.5
      cache_write_per_mtok: 0.75
  llama:
    input_per_mtok: 0.1
    output_per_mtok: 0.2
tenants:
  acme: {discount: 0.10}
"""


def test_yaml_book_reads_exact_per_token_prices() -> None:
    book = parse_book_text(BOOK, "prices.yaml")
    first = book.price("kimi-k2.5", dt.datetime(2026, 3, 1, tzinfo=UTC))
    assert first == ModelPrice(D("0.60") / M, D("0.10") / M, D("3.00") / M, None,
                               dt.datetime(2026, 1, 1, tzinfo=UTC))
    assert first.input == D("6E-7")  # exactly, not float(0.6) / 1e6
    llama = book.price("llama", EPOCH)
    assert llama is not None
    assert llama.cached_input == llama.input == D("1E-7")  # no cached price: no discount
    assert llama.cache_write is None
    assert llama.cache_write_rate == llama.input
    assert book.discount("acme") == D("0.10")
    assert book.discount("nobody") == book.discount(None) == 0


PERIODS = [
    (dt.datetime(2025, 12, 31, 23, 59, tzinfo=UTC), None),
    (dt.datetime(2026, 1, 1, tzinfo=UTC), "0.60"),
    (dt.datetime(2026, 5, 31, 21, 59, 59, tzinfo=UTC), "0.60"),
    (dt.datetime(2026, 5, 31, 22, 0, tzinfo=UTC), "0.50"),  # 2026-06-01T00:00+02:00
    (dt.datetime(2030, 1, 1, tzinfo=dt.timezone(dt.timedelta(hours=-5))), "0.50"),
]


@pytest.mark.parametrize(("at", "input_per_mtok"), PERIODS, ids=str)
def test_price_period_lookup(at: dt.datetime, input_per_mtok: str | None) -> None:
    price = parse_book_text(BOOK, "prices.yaml").price("kimi-k2.5", at)
    assert (None if price is None else price.input * M) == (
        None if input_per_mtok is None else D(input_per_mtok))


def test_price_lookup_needs_an_aware_time() -> None:
    with pytest.raises(ValueError, match="timezone"):
        parse_book_text(BOOK, "p.yaml").price("llama", dt.datetime(2026, 1, 1))


def _one(period: str) -> str:
    return f"models:\n  m:\n    - {period}\n"


ERRORS = [
    ("negative-price", _one("{input_per_mtok: -1, output_per_mtok: 1}"),
     "prices.yaml: models.m[0]: input_per_mtok: must be non-negative"),
    ("unknown-key", _one("{input_per_token: 1, input_per_mtok: 1, output_per_mtok: 1}"),
     "prices.yaml: models.m[0]: unknown keys ['input_per_token']"),
    ("bad-date", _one("{effective_from: 2026-13-01, input_per_mtok: 1, output_per_mtok: 1}"),
     "prices.yaml: models.m[0]: effective_from '2026-13-01' is not an ISO date"),
    ("not-a-number", _one("{input_per_mtok: cheap, output_per_mtok: 1}"),
     "prices.yaml: models.m[0]: input_per_mtok: not a number: 'cheap'"),
    ("nan", _one("{input_per_mtok: .nan, output_per_mtok: 1}"),
     "prices.yaml: models.m[0]: input_per_mtok: not a number"),
    ("missing-output", _one("{input_per_mtok: 1}"),
     "prices.yaml: models.m[0]: missing ['output_per_mtok']"),
    ("duplicate-key", _one("{input_per_mtok: 1, input_per_mtok: 2, output_per_mtok: 1}"),
     "prices.yaml: cannot parse YAML: duplicate key 'input_per_mtok'"),
    ("duplicate-model", "models:\n  m: {input_per_mtok: 1, output_per_mtok: 1}\n"
     "  m: {input_per_mtok: 2, output_per_mtok: 1}\n", "duplicate key 'm'"),
    ("same-start-twice", "models:\n  m:\n"
     "    - {effective_from: 2026-01-01, input_per_mtok: 1, output_per_mtok: 1}\n"
     "    - {effective_from: 2026-01-01, input_per_mtok: 2, output_per_mtok: 1}\n",
     "prices.yaml: models.m: two periods start at the same effective_from"),
    ("empty-periods", "models:\n  m: []\n", "prices.yaml: models.m: must be a price period"),
    ("discount-over-one", "tenants:\n  acme: {discount: 1.5}\n",
     "prices.yaml: tenants.acme: discount is a fraction in [0, 1], got 1.5"),
    ("discount-extra-key", "tenants:\n  acme: {discount: 0.1, cap: 3}\n",
     "prices.yaml: tenants.acme: expected exactly {discount: fraction}"),
    ("tenants-not-mapping", "tenants: [acme]\n", "prices.yaml: tenants must be a mapping"),
    ("unknown-top-level", "model: {}\n", "prices.yaml: unknown top-level keys ['model']"),
    ("not-a-mapping", "- 1\n", "prices.yaml: the top level must be a mapping"),
    ("broken-yaml", "models: {m: [\n", "prices.yaml: cannot parse YAML"),
]


@pytest.mark.parametrize(("text", "message"), [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_yaml_validation_names_file_and_entry(text: str, message: str) -> None:
    with pytest.raises(PriceError) as info:
        parse_book_text(text, "prices.yaml")
    assert message in str(info.value)


def test_load_book_by_suffix(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text(BOOK)
    (tmp_path / "p.json").write_text(json.dumps({"m": {"input_cost_per_token": "1e-6"}}))
    (tmp_path / "p.toml").write_text("")
    assert set(load_book(tmp_path / "p.yaml").models) == {"kimi-k2.5", "llama"}
    assert load_book(tmp_path / "p.json").models["m"][0].input == D("1e-6")
    with pytest.raises(PriceError, match=r"p\.toml: unknown price-book format"):
        load_book(tmp_path / "p.toml")
    with pytest.raises(PriceError, match=r"missing\.yaml: cannot read"):
        load_book(tmp_path / "missing.yaml")


LITELLM_MAP = """{
  "sample_spec": {"input_cost_per_token": 0.0, "litellm_provider": "doc"},
  "kimi": {"input_cost_per_token": 6e-07, "output_cost_per_token": 3e-06,
           "cache_read_input_token_cost": 1e-07, "max_tokens": 8192, "mode": "chat",
           "supports_vision": true, "litellm_provider": "openai"},
  "writer": {"input_cost_per_token": 3e-06, "output_cost_per_token": 1.5e-05,
             "cache_creation_input_token_cost": 3.75e-06},
  "odd": {"input_cost_per_token": 1.5000020000000002e-05},
  "image-gen": {"output_cost_per_image": 0.04},
  "unpriced": {"input_cost_per_token": null}
}"""


def test_litellm_map_import() -> None:
    book = parse_litellm_text(LITELLM_MAP, "map.json")
    assert set(book.models) == {"kimi", "writer", "odd"}
    kimi = book.models["kimi"][0]
    assert (kimi.input, kimi.cached_input, kimi.output) == (D("6e-07"), D("1e-07"), D("3e-06"))
    writer = book.models["writer"][0]
    assert writer.cached_input == writer.input  # no cache-read price: full price
    assert writer.cache_write == D("3.75e-06")
    odd = book.models["odd"][0]
    assert odd.input == D("1.5000020000000002e-05")  # the JSON text, exactly
    assert odd.output == 0  # missing output price is 0, as in LiteLLM


LITELLM_ERRORS = [
    ('{"m": {"input_cost_per_token": -1e-6}}', "map.json: m: input_cost_per_token: must be"),
    ('{"m": {"input_cost_per_token": 1e-6, "output_cost_per_token": "x"}}',
     "map.json: m: output_cost_per_token: not a number"),
    ('{"m": {"input_cost_per_token": true}}', "map.json: m: input_cost_per_token"),
    ('{"m": 3}', "map.json: m: an entry must be a JSON object"),
    ("[1]", "map.json: a LiteLLM price map is a JSON object"),
    ("{", "map.json: cannot parse JSON"),
]


@pytest.mark.parametrize(("text", "message"), LITELLM_ERRORS)
def test_litellm_map_validation(text: str, message: str) -> None:
    with pytest.raises(PriceError) as info:
        parse_litellm_text(text, "map.json")
    assert message in str(info.value)


def test_litellm_bundled_price_map_imports() -> None:
    """LiteLLM's own ~4,000-entry price map (read as a file, LiteLLM not imported)."""
    spec = importlib.util.find_spec("litellm")
    if spec is None or spec.origin is None:
        pytest.skip("litellm not installed (pip install 'kvgate[dev]')")
    path = Path(spec.origin).parent / "model_prices_and_context_window_backup.json"
    raw = json.loads(path.read_text(), parse_float=D)
    book = load_book(path)
    priced = [m for m, e in raw.items() if m != "sample_spec"
              and e.get("input_cost_per_token") is not None]
    assert len(book.models) == len(priced) > 1000
    for model in priced[:: max(1, len(priced) // 50)]:
        entry, price = raw[model], book.models[model][0]
        assert price.input == entry["input_cost_per_token"]
        assert price.output == entry.get("output_cost_per_token", 0)
        assert price.cached_input == entry.get("cache_read_input_token_cost",
                                               entry["input_cost_per_token"])


def _random_book(seed: int) -> PriceBook:
    rng = random.Random(seed)

    def mtok() -> D:  # up to 4 decimals per million, as providers publish
        return D(rng.randint(0, 200_000)) / 10_000 / M

    models = {}
    for i in range(rng.randint(1, 8)):
        starts = sorted(rng.sample(range(0, 2000), rng.randint(1, 3)))
        models[f"model-{i}"] = tuple(ModelPrice(
            input=mtok(), cached_input=mtok(), output=mtok(),
            cache_write=mtok() if rng.random() < 0.5 else None,
            effective_from=dt.datetime(2024, 1, 1, tzinfo=UTC) + dt.timedelta(days=s))
            for s in starts)
    discounts = {f"tenant-{i}": D(rng.randint(0, 100)) / 100 for i in range(3)}
    return PriceBook(models, discounts)


@pytest.mark.parametrize("seed", range(5))
def test_litellm_export_round_trip(seed: int) -> None:
    book = _random_book(seed)
    at = dt.datetime(2025, 6, 1, tzinfo=UTC)
    back = parse_litellm_text(litellm_json(book, at), "exported.json")
    for model in book.models:
        want = book.price(model, at)
        if want is None:
            assert model not in back.models
            continue
        got = back.models[model][0]
        assert (got.input, got.cached_input, got.output, got.cache_write) == (
            want.input, want.cached_input, want.output, want.cache_write)


@pytest.mark.parametrize("seed", range(5))
def test_yaml_dump_round_trip(seed: int) -> None:
    book = _random_book(seed)
    back = parse_book_text(yaml.safe_dump(dump_book(book)), "dumped.yaml")
    assert dict(back.models) == dict(book.models)
    assert dict(back.discounts) == dict(book.discounts)


def test_litellm_export_shape_and_exactness_guard() -> None:
    book = parse_book_text(BOOK, "p.yaml")
    exported = to_litellm(book, dt.datetime(2026, 7, 1, tzinfo=UTC), provider="hosted_vllm")
    assert exported["kimi-k2.5"] == {
        "litellm_provider": "hosted_vllm", "mode": "chat", "input_cost_per_token": 5e-07,
        "cache_read_input_token_cost": 5e-08, "output_cost_per_token": 2.5e-06,
        "cache_creation_input_token_cost": 7.5e-07}
    too_precise = PriceBook({"m": (ModelPrice(D("0.12345678901234567891"), D(0), D(0)),)})
    with pytest.raises(PriceError, match="no exact JSON-float form"):
        to_litellm(too_precise, dt.datetime(2026, 1, 1, tzinfo=UTC))


def test_parse_litellm_accepts_parsed_objects() -> None:
    book = parse_litellm({"m": {"input_cost_per_token": "2e-6", "output_cost_per_token": 0}},
                         "inline")
    assert book.models["m"][0].input == D("2e-6")
