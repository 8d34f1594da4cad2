"""Prefill/decode disaggregation: see README.md in this folder."""

from __future__ import annotations

from kvgate.plugins.pd.admission import PdAdmission
from kvgate.plugins.pd.profile_handler import PdProfileHandler

__all__ = [
    "PdAdmission",
    "PdProfileHandler",
]
