"""Tenants, keys and isolation: see README.md in this folder."""

from __future__ import annotations

from kvgate.plugins.tenancy.auth import ApiKeys
from kvgate.plugins.tenancy.cache_salt import CacheSalt

__all__ = [
    "ApiKeys",
    "CacheSalt",
]
