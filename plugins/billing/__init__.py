"""Billing: see README.md in this folder."""

from __future__ import annotations

from kvgate.plugins.billing.plugin import Billing

__all__ = [
    "Billing",
]
