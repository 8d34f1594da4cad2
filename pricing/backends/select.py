"""The ledger backend a URL names (``sqlite:///abs/path``, ``postgresql://...``). PostgreSQL's
backend is imported only when a URL names it: its driver is the ``postgres`` extra."""

from __future__ import annotations

from urllib.parse import urlsplit

from kvgate.pricing.backends.base import LedgerBackend
from kvgate.pricing.backends.sqlite import SqliteBackend


def open_backend(url: str, **options: float) -> LedgerBackend:
    """``sqlite:///abs/path`` or ``postgresql://user[:pass]@host[:port]/db`` (no connection is
    made until first use)."""
    scheme = urlsplit(url).scheme
    if scheme == "sqlite":
        path = url.removeprefix("sqlite://")
        if not path.startswith("/"):
            raise ValueError("ledger URL: use sqlite:///absolute/path (three slashes)")
        return SqliteBackend(path, **options)
    if scheme in ("postgresql", "postgres"):
        from kvgate.pricing.backends.postgres import PostgresBackend

        return PostgresBackend(url, **options)
    raise ValueError(f"ledger URL scheme {scheme!r}: expected sqlite:///path or postgresql://...")
