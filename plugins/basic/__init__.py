"""Basic scheduling plugins: see README.md in this folder."""

from __future__ import annotations

from kvgate.plugins.basic.filters import HealthFilter, ModelFilter, RoleFilter
from kvgate.plugins.basic.pickers import MaxScorePicker, RoundRobinPicker, WeightedRandomPicker
from kvgate.plugins.basic.scorers import LeastInFlightScorer

__all__ = [
    "HealthFilter",
    "LeastInFlightScorer",
    "MaxScorePicker",
    "ModelFilter",
    "RoleFilter",
    "RoundRobinPicker",
    "WeightedRandomPicker",
]
