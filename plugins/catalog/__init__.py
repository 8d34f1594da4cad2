"""Model catalog: see README.md in this folder."""

from __future__ import annotations

from kvgate.plugins.catalog.plugin import Catalog

__all__ = [
    "Catalog",
]
