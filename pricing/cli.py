"""``kvgate usage ...``: export the ledger, export the price book for LiteLLM.

    kvgate usage export --ledger URL --since T --until T [--format csv|jsonl] [--out FILE]
    kvgate usage litellm-prices --prices FILE [--at T] [--provider P] [--out FILE]

``T`` is an ISO-8601 date or time (UTC when it has no offset) or unix seconds; ``--until`` is
exclusive. Records stream from the database (bounded memory); ``--out`` is written to a
temporary file and renamed into place, so a failed export never leaves a half file.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import os
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from kvgate.pricing.backends.base import LedgerUnavailable
from kvgate.pricing.backends.select import open_backend
from kvgate.pricing.prices import PriceError, litellm_json, load_book
from kvgate.pricing.records import COLUMNS, LedgerRecord


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``usage`` and its subcommands to the ``kvgate`` parser."""
    usage = sub.add_parser("usage", help="usage ledger and price-book tools")
    usub = usage.add_subparsers(dest="usage_command", required=True)
    p = usub.add_parser("export", help="export ledger records as CSV or JSON lines")
    p.add_argument("--ledger", required=True, help="sqlite:///abs/path or postgresql://...")
    p.add_argument("--since", required=True, type=parse_time,
                   help="ISO date/time (UTC if no offset) or unix seconds, inclusive")
    p.add_argument("--until", required=True, type=parse_time, help="same, exclusive")
    p.add_argument("--format", choices=["csv", "jsonl"], default="csv")
    p.add_argument("--out", type=Path, help="output file (default: standard output)")
    p.set_defaults(func=export_command)
    lp = usub.add_parser("litellm-prices", help="write the price book as a LiteLLM price map")
    lp.add_argument("--prices", required=True, type=Path, help="kvgate YAML or LiteLLM JSON")
    lp.add_argument("--at", type=parse_time, help="prices in force at (default: now)")
    lp.add_argument("--provider", default="openai", help="litellm_provider of each entry")
    lp.add_argument("--out", type=Path, help="output file (default: standard output)")
    lp.set_defaults(func=litellm_prices_command)


def parse_time(value: str) -> dt.datetime:
    """ISO-8601 date/time (UTC when naive) or integer unix seconds."""
    if value.isdigit():
        return dt.datetime.fromtimestamp(int(value), tz=dt.UTC)
    try:
        t = dt.datetime.fromisoformat(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not an ISO date/time or unix seconds: {value!r}") from None
    return t if t.tzinfo else t.replace(tzinfo=dt.UTC)


def csv_row(r: LedgerRecord) -> list[str]:
    """One CSV row in :data:`~kvgate.pricing.records.COLUMNS` order (None: empty)."""
    data = r.to_dict()
    out = []
    for name in COLUMNS:
        value = data[name]
        out.append("" if value is None else str(value).lower() if isinstance(value, bool)
                   else str(value))
    return out


def write_records(records: Iterable[LedgerRecord], fmt: str, out: IO[str]) -> int:
    """Write ``records`` to ``out`` as ``csv`` (with a header) or ``jsonl``; return the count."""
    count = 0
    writer = csv.writer(out, lineterminator="\n") if fmt == "csv" else None
    if writer is not None:
        writer.writerow(COLUMNS)
    for r in records:
        if writer is not None:
            writer.writerow(csv_row(r))
        else:
            out.write(r.to_json() + "\n")
        count += 1
    return count


@contextmanager
def _output(path: Path | None) -> Iterator[IO[str]]:
    if path is None:
        yield sys.stdout
        return
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with tmp.open("w", encoding="utf-8", newline="") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def export_command(args: argparse.Namespace) -> int:
    if args.until <= args.since:
        print("kvgate usage export: --until must be after --since", file=sys.stderr)
        return 2
    try:
        backend = open_backend(args.ledger)
        try:
            with _output(args.out) as out:
                count = write_records(backend.iter_records(args.since, args.until),
                                      args.format, out)
        finally:
            backend.close()
    except (ValueError, LedgerUnavailable, OSError) as exc:
        print(f"kvgate usage export: {exc}", file=sys.stderr)
        return 2
    if args.out is not None:
        print(f"{count} records written to {args.out}", file=sys.stderr)
    return 0


def litellm_prices_command(args: argparse.Namespace) -> int:
    at = args.at or dt.datetime.now(dt.UTC)
    try:
        text = litellm_json(load_book(args.prices), at, args.provider)
        with _output(args.out) as out:
            out.write(text)
    except (PriceError, OSError) as exc:
        print(f"kvgate usage litellm-prices: {exc}", file=sys.stderr)
        return 2
    return 0
