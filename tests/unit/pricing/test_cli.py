"""``kvgate usage export`` and ``kvgate usage litellm-prices`` (through their own parser, as
the ``kvgate`` CLI mounts them via the ``kvgate.commands`` entry point)."""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import io
import json
from pathlib import Path

import pytest

from kvgate.pricing.backends.select import open_backend
from kvgate.pricing.cli import parse_time, register
from kvgate.pricing.records import COLUMNS, LedgerRecord
from tests.unit.pricing.helpers import T0, random_records


def _run(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="kvgate")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


@pytest.fixture
def ledger_url(tmp_path: Path) -> tuple[str, list[LedgerRecord]]:
    url = f"sqlite://{tmp_path / 'ledger.sqlite'}"
    records = random_records(seed=9, n=120, span_s=2 * 86400)
    backend = open_backend(url)
    backend.write(records)
    backend.close()
    return url, sorted(records, key=lambda r: (r.ts, r.request_id))


def test_export_jsonl_to_file(tmp_path: Path, ledger_url: tuple[str, list[LedgerRecord]]) -> None:
    url, records = ledger_url
    out = tmp_path / "out.jsonl"
    since, until = "2026-03-01T12:00:00", str(int((T0 + dt.timedelta(days=1)).timestamp()))
    assert _run("usage", "export", "--ledger", url, "--since", since, "--until", until,
                "--format", "jsonl", "--out", str(out)) == 0
    got = [LedgerRecord.from_json(line) for line in out.read_text().splitlines()]
    assert got == [r for r in records if T0 <= r.ts < T0 + dt.timedelta(days=1)]
    assert not list(tmp_path.glob(".*.tmp"))


def test_export_csv_to_stdout(ledger_url: tuple[str, list[LedgerRecord]],
                              capsys: pytest.CaptureFixture[str]) -> None:
    url, records = ledger_url
    assert _run("usage", "export", "--ledger", url, "--since", "2026-01-01",
                "--until", "2027-01-01") == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert len(rows) == len(records)
    assert tuple(rows[0]) == COLUMNS
    for row, r in zip(rows, records, strict=True):
        assert row["request_id"] == r.request_id
        assert row["cost_total"] == format(r.cost_total, "f")
        assert row["cached_tokens"] == ("" if r.cached_tokens is None else str(r.cached_tokens))


ERRORS = [
    (["--ledger", "mysql://x/y"], "expected sqlite:///path or postgresql"),
    (["--ledger", "sqlite://relative.db"], "absolute"),
    (["--ledger", "sqlite:///nonexistent/dir/x.sqlite"], "sqlite:"),
]


@pytest.mark.parametrize(("args", "message"), ERRORS)
def test_export_errors(args: list[str], message: str,
                       capsys: pytest.CaptureFixture[str]) -> None:
    assert _run("usage", "export", *args, "--since", "2026-01-01", "--until", "2026-02-01") == 2
    assert message in capsys.readouterr().err


def test_export_rejects_an_empty_range(ledger_url: tuple[str, list[LedgerRecord]]) -> None:
    url, _ = ledger_url
    assert _run("usage", "export", "--ledger", url, "--since", "2026-02-01",
                "--until", "2026-01-01") == 2


@pytest.mark.parametrize(("text", "want"), [
    ("2026-03-01", dt.datetime(2026, 3, 1, tzinfo=dt.UTC)),
    ("2026-03-01T01:00:00+01:00", dt.datetime(2026, 3, 1, tzinfo=dt.UTC)),
    ("0", dt.datetime(1970, 1, 1, tzinfo=dt.UTC)),
])
def test_parse_time(text: str, want: dt.datetime) -> None:
    assert parse_time(text) == want


def test_litellm_prices(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text(
        "models:\n  kimi-k2.5: {input_per_mtok: 0.60, cached_input_per_mtok: 0.10, "
        "output_per_mtok: 3.00}\n")
    out = tmp_path / "map.json"
    assert _run("usage", "litellm-prices", "--prices", str(tmp_path / "p.yaml"),
                "--out", str(out)) == 0
    assert json.loads(out.read_text()) == {"kimi-k2.5": {
        "input_cost_per_token": 6e-07, "cache_read_input_token_cost": 1e-07,
        "output_cost_per_token": 3e-06, "litellm_provider": "openai", "mode": "chat"}}
    assert _run("usage", "litellm-prices", "--prices", str(tmp_path / "none.yaml")) == 2
