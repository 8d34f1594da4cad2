"""The ledger on a real PostgreSQL server started by these tests (tests/pg_server.py: Debian's
``postgresql`` package). Skipped, with the reason, when the server binaries or psycopg are
missing: ``apt-get install -y postgresql`` and ``pip install 'kvgate[postgres]'``."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import pytest

from kvgate.pricing.backends.base import TABLE, LedgerUnavailable
from kvgate.pricing.backends.select import open_backend
from kvgate.pricing.ledger import Ledger
from kvgate.pricing.records import LedgerRecord
from tests.pg_server import PgServer, pg_server
from tests.servers import free_port
from tests.unit.pricing.helpers import T0, random_records, record
from tests.unit.pricing.schema_helpers import check_upgraded, old_row, old_table_sql
from tests.unit.pricing.test_cli import _run
from tests.unit.pricing.test_usage_api import check_backend_agrees

psycopg = pytest.importorskip("psycopg", reason="pip install 'kvgate[postgres]'")
ALL = (dt.datetime(2000, 1, 1, tzinfo=dt.UTC), dt.datetime(2100, 1, 1, tzinfo=dt.UTC))


@pytest.fixture(scope="module")
def pg() -> Iterator[PgServer]:
    with pg_server() as server:
        yield server


def _count(url: str) -> int:
    backend = open_backend(url)
    try:
        return len(backend.query(*ALL))
    finally:
        backend.close()


def test_upsert_query_and_exact_money(pg: PgServer) -> None:
    url = pg.fresh_db("exact")
    backend = open_backend(url)
    records = random_records(seed=21, n=500)
    backend.write(records)
    changed = [record(r.request_id, ts=r.ts, completion=5) for r in records[:50]]
    backend.write(changed)  # last write wins
    got = {r.request_id: r for r in backend.query(*ALL)}
    assert len(got) == 500
    assert [got[r.request_id] for r in changed] == changed
    assert [got[r.request_id] for r in records[50:]] == records[50:]
    total = sum((r.cost_total for r in got.values()), Decimal(0))
    assert sum(backend.spend_by_key().values()) == total
    assert sum(backend.spend_by_tenant().values()) == total
    streamed = list(backend.iter_records(T0, T0 + dt.timedelta(days=1), batch=17))
    assert streamed == sorted((r for r in got.values() if r.ts < T0 + dt.timedelta(days=1)),
                              key=lambda r: (r.ts, r.request_id))
    backend.close()


def test_usage_aggregation_agrees(pg: PgServer) -> None:
    backend = open_backend(pg.fresh_db("usage"))
    records = random_records(seed=3, n=2000)
    backend.write(records)
    check_backend_agrees(backend, records)
    backend.close()


def test_export_cli(pg: PgServer, tmp_path: Path) -> None:
    url = pg.fresh_db("export")
    backend = open_backend(url)
    records = random_records(seed=5, n=50)
    backend.write(records)
    backend.close()
    out = tmp_path / "x.jsonl"
    assert _run("usage", "export", "--ledger", url, "--since", "2026-01-01", "--until",
                "2027-01-01", "--format", "jsonl", "--out", str(out)) == 0
    got = [LedgerRecord.from_json(line) for line in out.read_text().splitlines()]
    assert sorted(got, key=lambda r: r.request_id) == sorted(records,
                                                            key=lambda r: r.request_id)


def test_ledger_survives_a_database_restart(pg: PgServer, tmp_path: Path) -> None:
    url = pg.fresh_db("outage")

    async def go() -> Ledger:
        ledger = Ledger(open_backend(url, connect_timeout_s=1), tmp_path / "spool",
                        batch_interval_s=0.01, retry_min_s=0.05, retry_max_s=0.5, seed=3)
        await ledger.start()
        await asyncio.gather(*(ledger.submit(record(f"a{i}")) for i in range(50)))
        assert await ledger.sync(10)
        await asyncio.to_thread(pg.stop)
        try:
            await asyncio.gather(*(ledger.submit(record(f"b{i}")) for i in range(100)))
            assert not await ledger.sync(0.5)
            assert ledger.stats.db_errors >= 1
        finally:
            await asyncio.to_thread(pg.start)
        assert await ledger.sync(30)
        await ledger.stop()
        return ledger

    ledger = asyncio.run(go())
    assert ledger.stats.accepted == 150
    assert _count(url) == 150


def test_ledger_starts_while_the_database_is_down(pg: PgServer, tmp_path: Path) -> None:
    url = pg.fresh_db("coldstart")
    pg.stop()
    try:
        async def go() -> Ledger:
            ledger = Ledger(open_backend(url, connect_timeout_s=1), tmp_path / "spool",
                            batch_interval_s=0.01, retry_min_s=0.05, retry_max_s=0.3)
            await ledger.start()  # no connection needed to accept records
            await asyncio.gather(*(ledger.submit(record(f"c{i}")) for i in range(30)))
            await ledger.stop(timeout_s=0.5)  # still down: the records stay spooled
            return ledger

        first = asyncio.run(go())
        assert first.stats.accepted == 30
    finally:
        pg.start()

    async def again() -> None:
        ledger = Ledger(open_backend(url), tmp_path / "spool")
        await ledger.start()
        await ledger.stop()

    asyncio.run(again())
    assert _count(url) == 30


def test_connection_errors_never_carry_the_password() -> None:
    backend = open_backend(f"postgresql://kvgate:s3cret-pw@127.0.0.1:{free_port()}/x",
                           connect_timeout_s=1)
    with pytest.raises(LedgerUnavailable) as info:
        backend.write([record("a")])
    assert "s3cret-pw" not in str(info.value)
    assert "s3cret-pw" not in repr(info.value.__cause__) + repr(info.value.__context__)


def test_a_table_of_the_first_schema_is_upgraded(pg: PgServer) -> None:
    url = pg.fresh_db("upgrade")
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(old_table_sql("postgresql"))
        row = old_row("postgresql")
        conn.execute(f"INSERT INTO {TABLE} VALUES ({', '.join('%s' for _ in row)})", row)
    check_upgraded(url)
