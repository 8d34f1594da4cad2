"""Load and session affinity: see README.md in this folder."""

from __future__ import annotations

from kvgate.plugins.load.session_affinity import SessionAffinityScorer
from kvgate.plugins.load.token_load import TokenImbalanceFilter, TokenLoadScorer

__all__ = [
    "SessionAffinityScorer",
    "TokenImbalanceFilter",
    "TokenLoadScorer",
]
