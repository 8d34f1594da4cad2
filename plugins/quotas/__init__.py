"""Quotas and budgets: see README.md in this folder."""

from __future__ import annotations

from kvgate.plugins.quotas.plugin import Quotas

__all__ = [
    "Quotas",
]
