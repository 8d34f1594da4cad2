"""middleware/framework/tasks.py: a background task that loses a cancellation (as Python 3.11's
``asyncio.wait_for`` can) is still stopped."""

from __future__ import annotations

import asyncio

import pytest

from kvgate.middleware.framework import tasks
from kvgate.middleware.framework.tasks import cancel_and_wait


async def _loses_first_cancel(rounds: list[int]) -> None:
    """A periodic loop whose first cancellation is lost, the way 3.11's ``wait_for`` loses one
    when its inner awaitable finishes in the same iteration."""
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        asyncio.current_task().uncancel()  # type: ignore[union-attr]  # lost, as in wait_for
    while True:
        rounds.append(1)
        await asyncio.sleep(0.01)


async def _obeys() -> None:
    await asyncio.sleep(30)


@pytest.mark.parametrize("body", ["loses", "obeys", "done", "none"])
async def test_every_task_is_done_after_cancel_and_wait(
        body: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tasks, "RECANCEL_S", 0.05)
    rounds: list[int] = []
    task: asyncio.Task[None] | None = None
    if body == "loses":
        task = asyncio.create_task(_loses_first_cancel(rounds))
    elif body in ("obeys", "done"):
        task = asyncio.create_task(_obeys())
    await asyncio.sleep(0)
    if body == "done":
        task.cancel()  # type: ignore[union-attr]
        await asyncio.gather(task, return_exceptions=True)  # type: ignore[arg-type]
    await asyncio.wait_for(cancel_and_wait(task, None), 5)
    assert task is None or task.done()
    if body == "loses":
        assert rounds, "the loop ran on after its first cancellation"
        assert task is not None and task.cancelled()


async def test_a_plain_cancel_does_not_stop_a_loop_that_lost_it() -> None:
    """The failure cancel_and_wait exists for: one cancel(), then waiting, never ends."""
    task = asyncio.create_task(_loses_first_cancel([]))
    await asyncio.sleep(0)
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=0.2)
    assert not done
    await cancel_and_wait(task)
    assert task.cancelled()
