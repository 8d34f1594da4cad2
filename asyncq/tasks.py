"""The background loops' one shared step: stop a task and wait until it has stopped."""

from __future__ import annotations

import asyncio

from kvgate.middleware.framework.tasks import cancel_and_wait


async def cancel(task: asyncio.Task[None] | None) -> None:
    """Cancel ``task`` (None: nothing to stop) and wait for it to finish unwinding."""
    if task is None:
        return
    await cancel_and_wait(task)
    if not task.cancelled():
        task.result()  # a loop that failed (or ended) on its own: its exception is raised
