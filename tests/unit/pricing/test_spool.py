"""The durable spool: segments, replay order, torn tails, deletion only after release."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgate.pricing.spool import QUARANTINE, Cursor, Spool, SpoolError


def _lines(prefix: str, n: int) -> list[bytes]:
    return [f'{{"n":"{prefix}{i}"}}\n'.encode() for i in range(n)]


def _segments(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.suffix == ".jsonl" and p.name != QUARANTINE)


def test_append_read_release(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s")
    cursor = spool.open()
    spool.append(_lines("a", 3))
    spool.append(_lines("b", 2))
    lines, end = spool.read(cursor, 4)
    assert lines == _lines("a", 3) + _lines("b", 1)
    cursor = spool.release(end)  # not caught up: the active segment stays
    assert len(_segments(tmp_path / "s")) == 1
    lines, end = spool.read(cursor, 100)
    assert lines == _lines("b", 2)[1:]
    assert spool.caught_up(end)
    cursor = spool.release(end)  # caught up: sealed, deleted, a fresh empty segment
    assert spool.read(cursor, 10) == ([], cursor)
    assert [(tmp_path / "s" / n).stat().st_size for n in _segments(tmp_path / "s")] == [0]
    spool.close()


@pytest.mark.parametrize("segment_bytes", [1, 50, 200, 10_000])
def test_segments_roll_and_are_read_in_order(tmp_path: Path, segment_bytes: int) -> None:
    spool = Spool(tmp_path / "s", segment_bytes=segment_bytes)
    cursor = spool.open()
    written = []
    for g in range(10):
        group = _lines(f"g{g}-", g % 3 + 1)
        spool.append(group)
        written += group
    got: list[bytes] = []
    while True:
        lines, end = spool.read(cursor, 4)
        if not lines:
            break
        got += lines
        cursor = spool.release(end)
        assert spool.backlog_bytes(cursor) == sum(map(len, written)) - sum(map(len, got))
    assert got == written
    assert len(_segments(tmp_path / "s")) == 1  # everything released
    spool.close()


def test_reopen_replays_leftovers_and_skips_a_torn_tail(tmp_path: Path) -> None:
    d = tmp_path / "s"
    spool = Spool(d, segment_bytes=60)
    spool.open()
    spool.append(_lines("x", 4))
    spool.append(_lines("y", 1))
    spool.close()  # "crash": nothing released
    with (d / _segments(d)[-1]).open("ab") as f:
        f.write(b'{"n":"torn')  # a write cut short, never acknowledged
    again = Spool(d, segment_bytes=60)
    cursor = again.open()
    lines, end = again.read(cursor, 100)
    assert lines == _lines("x", 4) + _lines("y", 1)
    again.release(end)
    assert len(_segments(d)) == 1
    again.close()


def test_one_process_per_spool(tmp_path: Path) -> None:
    first = Spool(tmp_path / "s")
    first.open()
    with pytest.raises(SpoolError, match="in use by another process"):
        Spool(tmp_path / "s").open()
    first.close()
    second = Spool(tmp_path / "s")
    second.open()
    second.close()


def test_quarantine_keeps_the_line(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s")
    spool.open()
    spool.quarantine(b"not json", "unreadable")
    assert (tmp_path / "s" / QUARANTINE).read_bytes() == b"not json\n"
    spool.close()


def test_append_after_close_is_refused(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s")
    assert spool.open() == Cursor(1, 0)
    spool.close()
    with pytest.raises(SpoolError, match="closed"):
        spool.append(_lines("a", 1))
