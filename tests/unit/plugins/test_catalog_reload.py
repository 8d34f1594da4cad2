"""Catalog reload (plugins/catalog/plugin.py's Reloadable side, driven by plugins/common/reload.py): a new
file is checked against the gateway config the catalog was built with; a refused one keeps the
last good catalog serving."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kvgate.middleware.framework.composition.config import parse_config
from kvgate.middleware.framework.composition.pipeline import build_pipeline
from kvgate.middleware.framework.composition.registry import Registry
from kvgate.plugins.catalog.plugin import Catalog
from kvgate.plugins.common.reload import FileReloader

POOL: dict[str, Any] = {"name": "sim-model", "aliases": ["sim"], "pool": {"engines": ["e0"]}}


def _catalog(tmp_path: Path) -> Catalog:
    path = tmp_path / "catalog.yaml"
    path.write_text(yaml.safe_dump({"models": [POOL]}))
    data = {"engines": [{"name": "e0", "url": "http://x:1"}],
            "plugins": [{"type": "catalog", "params": {"file": str(path)}},
                        {"type": "max-score-picker"}],
            "profiles": [{"name": "default", "plugins": [{"ref": "max-score-picker"}]}]}
    catalog = build_pipeline(parse_config(data, "gw.yaml"), Registry.from_entry_points()).catalog
    assert isinstance(catalog, Catalog)
    return catalog


CASES: list[tuple[str, Any, str | None]] = [
    ("new alias", [{**POOL, "aliases": ["sim", "new"]}], None),
    ("unknown engine", [{**POOL, "pool": {"engines": ["e9"]}}], "pool engine 'e9'"),
    ("unknown profile", [{**POOL, "pool": {"profile": "fast"}}], "routing profile 'fast'"),
    ("backend kind not started", [POOL, {"name": "gpt", "provider": {
        "model": "openai/gpt-x", "backend": "other"}}], "not installed"),
    ("installed kind the gateway did not start", [POOL, {"name": "gpt", "provider": {
        "model": "openai/gpt-x", "backend": "litellm"}}], "were not started with the gateway"),
    ("not yaml", "models: [", "invalid YAML"),
    ("duplicate alias", [POOL, {"name": "x", "aliases": ["sim"], "pool": {}}],
     "already the name or an alias"),
]


@pytest.mark.parametrize(("case", "models", "error"), CASES, ids=[c[0] for c in CASES])
async def test_reload_checks_against_the_gateway_config(tmp_path: Path, case: str, models: Any,
                                                        error: str | None) -> None:
    catalog = _catalog(tmp_path)
    reloader = FileReloader("catalog", catalog)
    text = models if isinstance(models, str) else yaml.safe_dump({"models": models})
    (tmp_path / "catalog.yaml").write_text(text + "\n# changed\n")
    await reloader.poll()
    if error is None:
        assert reloader.status.error is None and catalog.canonical("new") == "sim-model"
    else:
        assert reloader.status.error is not None and error in reloader.status.error
        assert catalog.canonical("sim") == "sim-model" and catalog.canonical("new") is None
        assert [e.name for e in catalog.file.models] == ["sim-model"]  # the last good one


class _NoPlugins:
    def lookup(self, name: str) -> object:
        raise AssertionError(name)


async def test_billing_price_book_reload_keeps_the_last_good(tmp_path: Path) -> None:
    import datetime as dt
    from decimal import Decimal

    from kvgate.plugins.billing.plugin import Billing

    prices = tmp_path / "prices.yaml"
    prices.write_text("models:\n  m: {input_per_mtok: '1', output_per_mtok: '2'}\n")
    billing = Billing("billing", Billing.Params(prices=str(prices), auth=None,
                                                ledger=f"sqlite://{tmp_path}/l.sqlite"),
                      _NoPlugins())
    reloader = FileReloader("billing", billing)
    now = dt.datetime.now(dt.UTC)

    def output_per_mtok() -> Decimal:
        price = billing.book.price("m", now)
        assert price is not None
        return price.output * 1_000_000
    for text, expected, failing in [
            ("models:\n  m: {input_per_mtok: '1', output_per_mtok: '3'}\n", 3, False),
            ("models:\n  m: {input_per_mtok: '-1', output_per_mtok: '9'}\n", 3, True),
            ("models: [\n", 3, True),
            ("models:\n  m: {input_per_mtok: '1', output_per_mtok: '4'}\n\n", 4, False)]:
        prices.write_text(text)
        await reloader.poll()
        assert (output_per_mtok(), reloader.status.error is not None) == (Decimal(expected), failing)
