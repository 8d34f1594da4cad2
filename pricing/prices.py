"""The price book: per-model prices with effective-from dates, and per-tenant discounts.

Internally every price is ``Decimal`` USD **per token**. Two file formats are read:

kvgate YAML (``.yaml`` / ``.yml``), prices **per million tokens** as providers publish them::

    models:
      kimi-k2.5:
        - effective_from: 2026-01-01      # UTC date or ISO timestamp; the latest <= t applies
          input_per_mtok: 0.60
          cached_input_per_mtok: 0.10     # optional: defaults to the input price (no discount)
          output_per_mtok: 3.00
          cache_write_per_mtok: 0.75      # optional: defaults to the input price
    tenants:
      acme: {discount: 0.10}              # fraction off the whole bill, in [0, 1]

Numbers are read from their source text (``0.60`` is exactly 0.60, never a binary float).
Unknown or duplicate keys, negative prices and bad dates are errors naming the file and entry.

LiteLLM's price map (``.json``), prices **per token**: ``input_cost_per_token``,
``output_cost_per_token``, ``cache_read_input_token_cost``, ``cache_creation_input_token_cost``;
every other key is ignored, entries without ``input_cost_per_token`` (images, audio, LiteLLM's
``sample_spec``) are skipped, and a missing output price is 0 as in LiteLLM. :func:`to_litellm`
writes kvgate's book back in that format so a LiteLLM deployment prices kvgate models the same.
"""

from __future__ import annotations

import bisect
import datetime as dt
import json
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from kvgate.pricing.money import MILLION, ZERO, parse_decimal

EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
LITELLM_KEYS = {"input": "input_cost_per_token", "output": "output_cost_per_token",
                "cached_input": "cache_read_input_token_cost",
                "cache_write": "cache_creation_input_token_cost"}
_YAML_PRICES = {"input_per_mtok": "input", "cached_input_per_mtok": "cached_input",
                "output_per_mtok": "output", "cache_write_per_mtok": "cache_write"}


class PriceError(ValueError):
    """A price book that cannot be used; the message names the file and the entry."""


@dataclass(frozen=True, slots=True)
class ModelPrice:
    """USD per token, in force from ``effective_from`` (UTC) until the model's next period."""

    input: Decimal
    cached_input: Decimal
    output: Decimal
    cache_write: Decimal | None = None
    effective_from: dt.datetime = EPOCH

    @property
    def cache_write_rate(self) -> Decimal:
        """The cache-write price, falling back to the input price (LiteLLM does the same)."""
        return self.input if self.cache_write is None else self.cache_write


@dataclass(frozen=True)
class PriceBook:
    """Price periods by model (sorted by ``effective_from``) and discounts by tenant."""

    models: Mapping[str, tuple[ModelPrice, ...]] = field(default_factory=dict)
    discounts: Mapping[str, Decimal] = field(default_factory=dict)

    def __post_init__(self) -> None:
        ordered = {m: tuple(sorted(p, key=lambda x: x.effective_from))
                   for m, p in self.models.items()}
        object.__setattr__(self, "models", MappingProxyType(ordered))
        object.__setattr__(self, "discounts", MappingProxyType(dict(self.discounts)))

    def price(self, model: str, at: dt.datetime) -> ModelPrice | None:
        """The price in force for ``model`` at ``at`` (tz-aware); None when there is none."""
        if at.tzinfo is None:
            raise ValueError("price lookup needs a timezone-aware time")
        periods = self.models.get(model, ())
        i = bisect.bisect_right([p.effective_from for p in periods], at)
        return periods[i - 1] if i else None

    def discount(self, tenant: str | None) -> Decimal:
        """The tenant's discount fraction (0 when it has none)."""
        return self.discounts.get(tenant or "", ZERO)


# -- kvgate YAML --------------------------------------------------------------------------


class _StrictLoader(yaml.BaseLoader):
    """Every scalar stays a string (numbers keep their exact text); duplicate keys are errors."""

    def construct_mapping(self, node: yaml.MappingNode,
                          deep: bool = False) -> dict[Hashable, Any]:
        seen: set[Hashable] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _when(value: object, where: str) -> dt.datetime:
    if not isinstance(value, str):
        raise PriceError(f"{where}: effective_from must be an ISO date, got {value!r}")
    try:
        stamp = dt.datetime.fromisoformat(value.strip())
    except ValueError:
        raise PriceError(f"{where}: effective_from {value!r} is not an ISO date") from None
    return stamp if stamp.tzinfo else stamp.replace(tzinfo=dt.UTC)


def _period(entry: object, where: str) -> ModelPrice:
    if not isinstance(entry, dict):
        raise PriceError(f"{where}: a price period must be a mapping")
    unknown = set(entry) - set(_YAML_PRICES) - {"effective_from"}
    if unknown:
        raise PriceError(f"{where}: unknown keys {sorted(map(str, unknown))} "
                         f"(allowed: effective_from, {', '.join(_YAML_PRICES)})")
    missing = {"input_per_mtok", "output_per_mtok"} - set(entry)
    if missing:
        raise PriceError(f"{where}: missing {sorted(missing)}")
    rates: dict[str, Decimal] = {}
    for key, name in _YAML_PRICES.items():
        if key in entry:
            try:
                rates[name] = parse_decimal(entry[key], key) / MILLION
            except ValueError as exc:
                raise PriceError(f"{where}: {exc}") from None
    return ModelPrice(
        input=rates["input"], output=rates["output"],
        cached_input=rates.get("cached_input", rates["input"]),
        cache_write=rates.get("cache_write"),
        effective_from=_when(entry["effective_from"], where) if "effective_from" in entry
        else EPOCH,
    )


def _model_periods(model: str, periods: object, source: str) -> tuple[ModelPrice, ...]:
    where = f"{source}: models.{model}"
    if isinstance(periods, dict):
        periods = [periods]
    if not isinstance(periods, list) or not periods:
        raise PriceError(f"{where}: must be a price period or a non-empty list of them")
    parsed = [_period(p, f"{where}[{i}]") for i, p in enumerate(periods)]
    starts = [p.effective_from for p in parsed]
    if len(set(starts)) != len(starts):
        raise PriceError(f"{where}: two periods start at the same effective_from")
    return tuple(parsed)


def _discounts(data: object, source: str) -> dict[str, Decimal]:
    if data is None or data == "":
        return {}
    if not isinstance(data, dict):
        raise PriceError(f"{source}: tenants must be a mapping of tenant -> {{discount}}")
    out: dict[str, Decimal] = {}
    for tenant, entry in data.items():
        where = f"{source}: tenants.{tenant}"
        if not isinstance(entry, dict) or set(entry) != {"discount"}:
            raise PriceError(f"{where}: expected exactly {{discount: fraction}}")
        try:
            value = parse_decimal(entry["discount"], "discount")
        except ValueError as exc:
            raise PriceError(f"{where}: {exc}") from None
        if value > 1:
            raise PriceError(f"{where}: discount is a fraction in [0, 1], got {value}")
        out[str(tenant)] = value
    return out


def parse_book(data: object, source: str) -> PriceBook:
    """Validate a kvgate price-book document (as read by the strict string loader)."""
    if not isinstance(data, dict):
        raise PriceError(f"{source}: the top level must be a mapping")
    unknown = set(data) - {"models", "tenants"}
    if unknown:
        raise PriceError(f"{source}: unknown top-level keys {sorted(map(str, unknown))} "
                         "(allowed: models, tenants)")
    models = data.get("models") or {}
    if not isinstance(models, dict):
        raise PriceError(f"{source}: models must be a mapping of model -> price periods")
    parsed = {str(m): _model_periods(str(m), p, source) for m, p in models.items()}
    return PriceBook(parsed, _discounts(data.get("tenants"), source))


def parse_book_text(text: str, source: str) -> PriceBook:
    """A kvgate YAML price book from its text."""
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # a BaseLoader: builds strings only
    except yaml.YAMLError as exc:
        raise PriceError(f"{source}: cannot parse YAML: {exc}") from None
    return parse_book(data, source)


def _plain(value: Decimal) -> str:
    """``value`` as plain decimal text without exponent or trailing zeros."""
    return format(value.normalize(), "f")


def dump_book(book: PriceBook) -> dict[str, Any]:
    """The book as a kvgate YAML document (prices per million tokens, as strings)."""
    models: dict[str, Any] = {}
    for model, periods in book.models.items():
        models[model] = [{
            "effective_from": p.effective_from.isoformat(),
            "input_per_mtok": _plain(p.input * MILLION),
            "cached_input_per_mtok": _plain(p.cached_input * MILLION),
            "output_per_mtok": _plain(p.output * MILLION),
            **({} if p.cache_write is None
               else {"cache_write_per_mtok": _plain(p.cache_write * MILLION)}),
        } for p in periods]
    tenants = {t: {"discount": _plain(d)} for t, d in book.discounts.items()}
    return {"models": models, "tenants": tenants}


# -- LiteLLM's price map ------------------------------------------------------------------


def _litellm_rate(entry: Mapping[str, Any], key: str, where: str) -> Decimal | None:
    value = entry.get(key)
    if value is None:
        return None
    try:
        return parse_decimal(value, key)
    except ValueError as exc:
        raise PriceError(f"{where}: {exc}") from None


def _litellm_entry(model: str, entry: Mapping[str, Any], source: str) -> ModelPrice:
    where = f"{source}: {model}"
    rates = {name: _litellm_rate(entry, key, where) for name, key in LITELLM_KEYS.items()}
    inp = rates["input"]
    assert inp is not None  # entries without an input price are skipped by the caller
    return ModelPrice(
        input=inp,
        output=rates["output"] if rates["output"] is not None else ZERO,
        cached_input=rates["cached_input"] if rates["cached_input"] is not None else inp,
        cache_write=rates["cache_write"],
    )


def parse_litellm(data: object, source: str) -> PriceBook:
    """A book from LiteLLM's price map (parse its JSON with ``parse_float=Decimal``)."""
    if not isinstance(data, dict):
        raise PriceError(f"{source}: a LiteLLM price map is a JSON object of model -> entry")
    models: dict[str, tuple[ModelPrice, ...]] = {}
    for name, entry in data.items():
        if name == "sample_spec":
            continue
        if not isinstance(entry, dict):
            raise PriceError(f"{source}: {name}: an entry must be a JSON object")
        if entry.get(LITELLM_KEYS["input"]) is not None:
            models[str(name)] = (_litellm_entry(str(name), entry, source),)
    return PriceBook(models)


def parse_litellm_text(text: str, source: str) -> PriceBook:
    """A book from the text of a LiteLLM price map; numbers are read exactly."""
    try:
        data = json.loads(text, parse_float=Decimal)
    except json.JSONDecodeError as exc:
        raise PriceError(f"{source}: cannot parse JSON: {exc}") from None
    return parse_litellm(data, source)


def _as_float(value: Decimal, where: str) -> float:
    """``value`` as a JSON float, refusing a value the float cannot carry exactly."""
    out = float(value)
    if Decimal(repr(out)) != value:
        raise PriceError(f"{where}: {value} has no exact JSON-float form (LiteLLM reads floats)")
    return out


def to_litellm(book: PriceBook, at: dt.datetime, provider: str = "openai",
               mode: str = "chat") -> dict[str, dict[str, Any]]:
    """The prices in force at ``at`` as a LiteLLM price map (per token).

    LiteLLM keeps prices as floats; each value is checked to survive ``float`` -> JSON text ->
    ``Decimal`` unchanged (true for any price with at most 15 significant digits).
    """
    out: dict[str, dict[str, Any]] = {}
    for model in sorted(book.models):
        price = book.price(model, at)
        if price is None:
            continue
        entry: dict[str, Any] = {"litellm_provider": provider, "mode": mode}
        for name, key in LITELLM_KEYS.items():
            value = getattr(price, name)
            if value is not None:
                entry[key] = _as_float(value, f"{model}.{key}")
        out[model] = entry
    return out


def litellm_json(book: PriceBook, at: dt.datetime, provider: str = "openai") -> str:
    """:func:`to_litellm` as JSON text (what ``litellm.register_model`` or a file accepts)."""
    return json.dumps(to_litellm(book, at, provider), indent=2, sort_keys=True) + "\n"


def load_book(path: str | Path) -> PriceBook:
    """Load a kvgate YAML book (``.yaml``/``.yml``) or a LiteLLM price map (``.json``)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise PriceError(f"{p}: cannot read: {exc.strerror}") from None
    if p.suffix == ".json":
        return parse_litellm_text(text, str(p))
    if p.suffix in (".yaml", ".yml"):
        return parse_book_text(text, str(p))
    raise PriceError(f"{p}: unknown price-book format (use .yaml/.yml or LiteLLM .json)")
