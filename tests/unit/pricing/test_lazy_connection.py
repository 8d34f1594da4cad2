"""kvgate.pricing.backends.base.LazyConnection, the connection holder both ledger backends share: opened on
first use, kept across calls, dropped (and reopened by the next call) only after an error that
maps to LedgerUnavailable; the driver error is the ``__cause__`` only with ``chain``."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvgate.pricing.backends.base import LazyConnection, LedgerRejected, LedgerUnavailable


class DriverError(Exception):
    pass


class Rejected(DriverError):
    pass


class Conn:
    def __init__(self, number: int) -> None:
        self.number = number
        self.closed = False

    def close(self) -> None:
        self.closed = True


def _classify(exc: DriverError) -> Exception:
    return LedgerRejected(str(exc)) if isinstance(exc, Rejected) else LedgerUnavailable(str(exc))


def _holder(chain: bool) -> tuple[LazyConnection[Conn, DriverError], list[Conn]]:
    opened: list[Conn] = []

    def connect() -> Conn:
        opened.append(Conn(len(opened)))
        return opened[-1]

    return LazyConnection(connect, DriverError, _classify, chain=chain), opened


def _fail(error: DriverError) -> Callable[[Conn], int]:
    def work(db: Conn) -> int:
        raise error
    return work


# (case, driver error, chain, mapped type, first connection dropped, cause kept)
CASES = [
    ("unavailable drops the connection", DriverError("down"), True, LedgerUnavailable, True, True),
    ("rejected keeps it", Rejected("bad row"), True, LedgerRejected, False, True),
    ("no chain hides the driver error", DriverError("url"), False, LedgerUnavailable, True, False),
]


@pytest.mark.parametrize(("case", "error", "chain", "mapped", "dropped", "cause"), CASES,
                         ids=[c[0] for c in CASES])
def test_errors_map_and_drop(case: str, error: DriverError, chain: bool,
                             mapped: type[Exception], dropped: bool, cause: bool) -> None:
    holder, opened = _holder(chain)
    assert holder.run(lambda db: db.number) == 0
    assert holder.run(lambda db: db.number) == 0  # kept across calls
    with pytest.raises(mapped) as raised:
        holder.run(_fail(error))
    assert (raised.value.__cause__ is error) is cause
    assert opened[0].closed is dropped
    assert holder.run(lambda db: db.number) == (1 if dropped else 0)
    holder.close()
    assert opened[-1].closed
    assert len(opened) == (2 if dropped else 1)
