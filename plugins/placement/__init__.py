"""Placement under KV pressure: see README.md in this folder."""

from __future__ import annotations

from kvgate.plugins.placement.scorer import KvPlacementScorer

__all__ = [
    "KvPlacementScorer",
]
