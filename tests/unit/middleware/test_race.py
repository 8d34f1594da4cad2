"""middleware.dispatch.race: the work runs in the caller's task; a client disconnect cancels it
where it awaits (ClientGone), the caller's own cancellation stays a cancellation. Each case
runs with both ways of learning of the disconnect: a watcher on ``receive`` and the server's
:class:`~kvgate.middleware.transport.asgi.DisconnectSource` callback (kvgate's own HTTP server)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import pytest

from kvgate.middleware.serving.dispatch import race
from kvgate.middleware.transport.asgi import ClientGone

T = TypeVar("T")


def _receiver(disconnect: asyncio.Event) -> Any:
    async def receive() -> dict[str, Any]:
        await disconnect.wait()
        return {"type": "http.disconnect"}
    return receive


class _Source:
    """A DisconnectSource whose client leaves when ``event`` is set."""

    def __init__(self, event: asyncio.Event) -> None:
        self.disconnected = False
        self.watchers: list[Callable[[], None]] = []
        self._waiter = asyncio.ensure_future(self._leave(event))

    async def _leave(self, event: asyncio.Event) -> None:
        await event.wait()
        self.disconnected = True
        watchers, self.watchers = self.watchers, []
        for callback in watchers:
            callback()

    def watch(self, callback: Callable[[], None]) -> None:
        self.watchers.append(callback)

    def unwatch(self, callback: Callable[[], None]) -> None:
        if callback in self.watchers:
            self.watchers.remove(callback)


async def _race(kind: str, work: Coroutine[Any, Any, T], disconnect: asyncio.Event) -> T:
    if kind == "receive":
        return await race(work, _receiver(disconnect))
    source = _Source(disconnect)
    try:
        return await race(work, _receiver(asyncio.Event()), source)
    finally:
        assert source.watchers == []  # unwatched on every outcome
        source._waiter.cancel()


KINDS = ["receive", "source"]


@pytest.mark.parametrize("kind", KINDS)
async def test_the_work_result_is_returned_in_the_calling_task(kind: str) -> None:
    caller = asyncio.current_task()

    async def work() -> object:
        return asyncio.current_task()

    assert await _race(kind, work(), asyncio.Event()) is caller
    await asyncio.sleep(0)  # the watcher's cancellation settles
    assert caller is not None and caller.cancelling() == 0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("swallow", [False, True])
async def test_a_disconnect_cancels_the_work(swallow: bool, kind: str) -> None:
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
        await _race(kind, work(), gone)
    assert cleaned == ["cancelled"]
    caller = asyncio.current_task()
    assert caller is not None and caller.cancelling() == 0
    await asyncio.sleep(0)  # still usable: no cancellation left pending


@pytest.mark.parametrize("kind", KINDS)
async def test_the_callers_own_cancellation_is_not_a_disconnect(kind: str) -> None:
    started = asyncio.Event()

    async def work() -> None:
        started.set()
        await asyncio.sleep(30)

    async def caller() -> None:
        await _race(kind, work(), asyncio.Event())

    task = asyncio.ensure_future(caller())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()


async def test_a_client_already_gone_never_starts_the_work() -> None:
    left = asyncio.Event()
    left.set()
    source = _Source(left)
    await asyncio.sleep(0)  # the client's leaving is noticed
    ran: list[str] = []

    async def work() -> None:
        ran.append("ran")

    with pytest.raises(ClientGone):
        await race(work(), _receiver(asyncio.Event()), source)
    assert ran == [] and source.watchers == []
