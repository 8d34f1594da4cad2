"""Stopping background tasks for sure.

Python 3.11's ``asyncio.wait_for`` returns the inner result instead of raising when the inner
awaitable finishes in the same loop iteration as the outer task's cancellation: the cancellation
is lost (fixed in 3.12, whose ``wait_for`` is built on ``asyncio.timeout``). A periodic loop that
awaits ``wait_for`` (a Redis round, an engine probe) can therefore survive one ``cancel()`` and
run on, and a ``stop()`` that awaited it hung: seen in CI as a replica whose shutdown waited
15 s on the shared-load loop after Redis died. :func:`cancel_and_wait` cancels again until each
task is done.
"""

from __future__ import annotations

import asyncio
from typing import Any

#: Seconds between cancellations of a task that is still running. One second leaves a task's
#: own clean-up on cancellation (closing a socket, a last write) time to finish, and bounds the
#: extra wait of a lost cancellation to a second.
RECANCEL_S = 1.0


async def cancel_and_wait(*tasks: asyncio.Future[Any] | None) -> None:
    """Cancel every task (None: skipped) and return once all are done, cancelling again every
    :data:`RECANCEL_S` those that are not. Their results and exceptions are left on them."""
    pending = {t for t in tasks if t is not None and not t.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=RECANCEL_S)
