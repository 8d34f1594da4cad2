"""middleware.dispatch.race: the work runs in the caller's task; a client disconnect cancels it
where it awaits (ClientGone), the caller's own cancellation stays a cancellation."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from middleware.asgi import ClientGone
from middleware.dispatch import race


def _receiver(disconnect: asyncio.Event) -> Any:
    async def receive() -> dict[str, Any]:
        await disconnect.wait()
        return {"type": "http.disconnect"}
    return receive


async def test_the_work_result_is_returned_in_the_calling_task() -> None:
    caller = asyncio.current_task()

    async def work() -> object:
        return asyncio.current_task()

    assert await race(work(), _receiver(asyncio.Event())) is caller
    await asyncio.sleep(0)  # the watcher's cancellation settles
    assert caller is not None and caller.cancelling() == 0


@pytest.mark.parametrize("swallow", [False, True])
async def test_a_disconnect_cancels_the_work(swallow: bool) -> None:
    gone = asyncio.Event()
    cleaned: list[str] = []

    async def work() -> str:
        try:
            gone.set()
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cleaned.append("cancelled")
            if not swallow:
                raise
        return "finished"

    with pytest.raises(ClientGone):
        await race(work(), _receiver(gone))
    assert cleaned == ["cancelled"]
    caller = asyncio.current_task()
    assert caller is not None and caller.cancelling() == 0
    await asyncio.sleep(0)  # still usable: no cancellation left pending


async def test_the_callers_own_cancellation_is_not_a_disconnect() -> None:
    started = asyncio.Event()

    async def work() -> None:
        started.set()
        await asyncio.sleep(30)

    async def caller() -> None:
        await race(work(), _receiver(asyncio.Event()))

    task = asyncio.ensure_future(caller())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()
