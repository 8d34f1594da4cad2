"""The background loops' one shared step: stop a task and wait until it has stopped."""

from __future__ import annotations

import asyncio
import contextlib


async def cancel(task: asyncio.Task[None] | None) -> None:
    """Cancel ``task`` (None: nothing to stop) and wait for it to finish unwinding."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
