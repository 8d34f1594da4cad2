"""OpenAI's Usage API shape (``GET /v1/organization/usage/completions``) from the ledger.

Pure functions: :func:`parse_usage_params` validates the query string, the ledger backends
aggregate rows in SQL (``LedgerBackend.usage_rows``) or :func:`aggregate` does it over records,
and :func:`build_page` lays the rows out as OpenAI does::

    {"object": "page", "has_more": false, "next_page": null,
     "data": [{"object": "bucket", "start_time": 1730419200, "end_time": 1730505600,
               "results": [{"object": "organization.usage.completions.result",
                            "input_tokens": 1000, "input_cached_tokens": 800,
                            "output_tokens": 500, "num_model_requests": 5,
                            "model": null, "api_key_id": null, "project_id": null, ...}]}]}

Buckets are ``bucket_width`` long (``1m``, ``1h``, ``1d``), aligned to UTC multiples of the
width, and cover ``[start_time, end_time)``; empty buckets are listed with no results. A page
holds ``limit`` buckets (OpenAI's defaults and maxima: 1d 7/31, 1h 24/168, 1m 60/1440);
``next_page`` is an opaque cursor for the next one. ``group_by`` takes ``model``,
``api_key_id`` and ``project_id`` (kvgate's tenant); fields not grouped by are null.
``input_tokens`` includes cached and cache-write tokens (as OpenAI's). ``input_cached_tokens``
counts reported and estimated cached tokens; requests whose cached count is unknown add 0 and
are counted in the ``kvgate`` extension object, with the cost (a decimal string, USD).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from kvgate.pricing.money import ZERO, money_str
from kvgate.pricing.records import LedgerRecord

WIDTHS = {"1m": 60, "1h": 3600, "1d": 86400}
LIMITS = {"1m": (60, 1440), "1h": (24, 168), "1d": (7, 31)}
#: Usage-API group name -> ledger column.
GROUPS = {"model": "model", "api_key_id": "key_id", "project_id": "tenant"}
RESULT_OBJECT = "organization.usage.completions.result"


class UsageQueryError(ValueError):
    """A bad Usage-API query; ``param`` names the offending parameter (for a 400 answer)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class UsageQuery:
    """A validated Usage-API query (times in unix seconds, ``end_time`` exclusive)."""

    start_time: int
    end_time: int
    bucket_width: str = "1d"
    group_by: tuple[str, ...] = ()
    limit: int | None = None
    page: str | None = None
    models: tuple[str, ...] = ()
    project_ids: tuple[str, ...] = ()
    api_key_ids: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.bucket_width not in WIDTHS:
            raise UsageQueryError(f"bucket_width must be one of {list(WIDTHS)}", "bucket_width")
        if self.start_time < 0 or self.end_time <= self.start_time:
            raise UsageQueryError("need 0 <= start_time < end_time", "start_time")
        bad = [g for g in self.group_by if g not in GROUPS]
        if bad:
            raise UsageQueryError(f"group_by: unsupported {bad} (supported: {list(GROUPS)})",
                                  "group_by")
        low, high = 1, LIMITS[self.bucket_width][1]
        if self.limit is not None and not low <= self.limit <= high:
            raise UsageQueryError(f"limit must be in [{low}, {high}] for bucket_width "
                                  f"{self.bucket_width}", "limit")
        self.window()  # validates the page cursor

    @property
    def width_s(self) -> int:
        return WIDTHS[self.bucket_width]

    def window(self) -> tuple[list[int], int | None]:
        """This page's bucket starts and the next page's first bucket (None: last page)."""
        width = self.width_s
        first = self.start_time - self.start_time % width
        if self.page is not None:
            if not self.page.isdigit() or int(self.page) % width or not (
                    first <= int(self.page) < self.end_time):
                raise UsageQueryError("page: not a cursor this query returned", "page")
            first = int(self.page)
        limit = self.limit if self.limit is not None else LIMITS[self.bucket_width][0]
        starts = list(range(first, min(self.end_time, first + limit * width), width))
        after = first + limit * width
        return starts, (after if after < self.end_time else None)


@dataclass(frozen=True, slots=True)
class UsageRow:
    """Sums for one bucket and group (a group field is None when not grouped by)."""

    bucket: int
    model: str | None
    api_key_id: str | None
    project_id: str | None
    input_tokens: int
    input_cached_tokens: int
    input_cache_write_tokens: int
    output_tokens: int
    num_model_requests: int
    cached_unknown_requests: int
    cached_estimated_requests: int
    cost_usd: Decimal


def _values(params: Mapping[str, Sequence[str]], name: str) -> tuple[str, ...]:
    """Repeated (``a=x&a=y``), bracketed (``a[]=x``) or comma-separated values."""
    raw = [*params.get(name, ()), *params.get(f"{name}[]", ())]
    return tuple(v for item in raw for v in item.split(",") if v)


def _int(params: Mapping[str, Sequence[str]], name: str, default: int | None) -> int | None:
    values = params.get(name)
    if not values:
        return default
    try:
        return int(values[-1])
    except ValueError:
        raise UsageQueryError(f"{name} must be an integer", name) from None


def parse_usage_params(params: Mapping[str, Sequence[str]], now: int) -> UsageQuery:
    """A :class:`UsageQuery` from a parsed query string (``end_time`` defaults to ``now``)."""
    start = _int(params, "start_time", None)
    if start is None:
        raise UsageQueryError("start_time (unix seconds) is required", "start_time")
    end = _int(params, "end_time", now)
    assert end is not None
    widths = params.get("bucket_width") or ["1d"]
    pages = params.get("page")
    return UsageQuery(
        start_time=start, end_time=end, bucket_width=widths[-1],
        group_by=_values(params, "group_by"), limit=_int(params, "limit", None),
        page=pages[-1] if pages else None, models=_values(params, "models"),
        project_ids=_values(params, "project_ids"), api_key_ids=_values(params, "api_key_ids"),
    )


def _selected(r: LedgerRecord, q: UsageQuery) -> bool:
    return ((not q.models or r.model in q.models)
            and (not q.project_ids or r.tenant in q.project_ids)
            and (not q.api_key_ids or r.key_id in q.api_key_ids))


def aggregate(records: Iterable[LedgerRecord], q: UsageQuery,
              start: int, end: int) -> list[UsageRow]:
    """Rows for records with ``start <= ts < end`` (streaming: memory grows with the number of
    bucket x group combinations, not with the records)."""
    sums: dict[tuple[Any, ...], list[Any]] = {}
    for r in records:
        ts = r.ts.timestamp()
        if not start <= ts < end or not _selected(r, q):
            continue
        bucket = int(ts) - int(ts) % q.width_s
        key = (bucket, *(getattr(r, GROUPS[g]) if g in q.group_by else None for g in GROUPS))
        acc = sums.setdefault(key, [0, 0, 0, 0, 0, 0, 0, ZERO])
        for i, value in enumerate((
                r.prompt_tokens, r.cached_tokens or 0, r.cache_write_tokens,
                r.completion_tokens, 1, int(r.cached_source == "unknown"),
                int(r.cached_source == "estimated"), r.cost_total)):
            acc[i] += value
    return [UsageRow(*key, *acc) for key, acc in sums.items()]


def _result(row: UsageRow) -> dict[str, Any]:
    return {
        "object": RESULT_OBJECT,
        "input_tokens": row.input_tokens, "output_tokens": row.output_tokens,
        "input_cached_tokens": row.input_cached_tokens,
        "input_audio_tokens": 0, "output_audio_tokens": 0,
        "num_model_requests": row.num_model_requests,
        "project_id": row.project_id, "user_id": None, "api_key_id": row.api_key_id,
        "model": row.model, "batch": None,
        "kvgate": {"cost_usd": money_str(row.cost_usd),
                   "input_cache_write_tokens": row.input_cache_write_tokens,
                   "cached_unknown_requests": row.cached_unknown_requests,
                   "cached_estimated_requests": row.cached_estimated_requests},
    }


def _order(row: UsageRow) -> tuple[str, ...]:
    return tuple("" if v is None else f"~{v}" for v in (row.model, row.api_key_id,
                                                         row.project_id))


def build_page(rows: Iterable[UsageRow], q: UsageQuery) -> dict[str, Any]:
    """The Usage-API page for ``q`` from aggregated rows (rows outside the page are ignored)."""
    starts, after = q.window()
    by_bucket: dict[int, list[UsageRow]] = {b: [] for b in starts}
    for row in rows:
        if row.bucket in by_bucket:
            by_bucket[row.bucket].append(row)
    data = [{"object": "bucket", "start_time": b, "end_time": b + q.width_s,
             "results": [_result(r) for r in sorted(by_bucket[b], key=_order)]}
            for b in starts]
    return {"object": "page", "data": data, "has_more": after is not None,
            "next_page": None if after is None else str(after)}


def page_bounds(q: UsageQuery) -> tuple[int, int]:
    """The time range (unix seconds, end exclusive) whose records this page needs."""
    starts, _ = q.window()
    if not starts:
        return q.start_time, q.start_time
    return max(q.start_time, starts[0]), min(q.end_time, starts[-1] + q.width_s)


def usage_page(records: Sequence[LedgerRecord], start: int, end: int, width: str = "1d",
               group_by: Sequence[str] = (), limit: int | None = None,
               page: str | None = None) -> dict[str, Any]:
    """The page for in-memory ``records`` (a convenience over :func:`aggregate`)."""
    q = UsageQuery(start, end, width, tuple(group_by), limit, page)
    low, high = page_bounds(q)
    return build_page(aggregate(records, q, low, high), q)


def from_unix(seconds: int) -> dt.datetime:
    return dt.datetime.fromtimestamp(seconds, tz=dt.UTC)
