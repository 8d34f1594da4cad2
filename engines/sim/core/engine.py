"""The simulated engine: a real-time step loop around
:class:`~kvgate.engines.sim.core.scheduler.Scheduler`.

A background task (started by the app's lifespan, or lazily by the first request — never at
import) repeats: schedule a step, sleep for its modelled duration * ``time_scale`` (measured
from the step's start, so the loop's own work is not added on top), apply it, hand the sampled
tokens to their requests, publish the step's KV events. With ``time_scale == 0`` it only yields
to the event loop between steps. Idle, it waits for a request.

Requests talk to it through :class:`RequestHandle`: a queue of :class:`TokenOut` per request,
bounded by the request's ``max_tokens`` (one entry per token, plus an end marker).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence

from kvgate.engines.sim.core.config import SimConfig
from kvgate.engines.sim.core.kv_events import AllBlocksCleared, KvEvent, KvEventPublisher
from kvgate.engines.sim.core.scheduler import Scheduler, SeqSpec, SeqState, TokenOut
from kvgate.engines.sim.core.timing import TimingModel

log = logging.getLogger(__name__)

#: Most lag behind the modelled clock, in seconds, that later steps make up by sleeping less.
#: 50 ms: several decode steps' worth, enough to absorb timer jitter and short stalls.
MAX_CATCH_UP_S = 0.05


class EngineOverloaded(RuntimeError):
    """The waiting queue is full (``max_waiting_requests``)."""


class EngineDead(RuntimeError):
    """The step loop failed or the engine was closed."""


class RequestHandle:
    """One request's view of the engine: its tokens as they are sampled, and its usage."""

    def __init__(self, engine: SimEngine, seq: SeqState) -> None:
        self._engine = engine
        self._seq = seq
        self._queue: asyncio.Queue[TokenOut | None] = asyncio.Queue()
        self._ended = False

    @property
    def request_id(self) -> str:
        return self._seq.request_id

    @property
    def prompt_tokens(self) -> int:
        return self._seq.num_prompt

    @property
    def completion_tokens(self) -> int:
        return self._seq.num_output

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache (0 until the request was admitted)."""
        return self._seq.cached_tokens or 0

    @property
    def finish_reason(self) -> str | None:
        return self._seq.finish_reason

    @property
    def finished(self) -> bool:
        return self._seq.finish_reason is not None

    def abort(self) -> None:
        """Stop the request (client gone); no-op once finished."""
        self._engine.abort(self)

    def tokens(self) -> AsyncIterator[TokenOut]:
        """Sampled tokens as steps complete; ends after the last one or on abort.

        A plain iterator (not an async generator): leaving it early needs no finalization.
        """
        return self

    def __aiter__(self) -> AsyncIterator[TokenOut]:
        return self

    async def __anext__(self) -> TokenOut:
        if self._ended:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is None:
            self._ended = True
            raise StopAsyncIteration
        return item

    async def result(self) -> list[TokenOut]:
        """Every token, once the request finished (or was aborted)."""
        return [t async for t in self]

    def _push(self, item: TokenOut | None) -> None:
        self._queue.put_nowait(item)


class SimEngine:
    """Engine state (scheduler, prefix cache, counters) and its step loop.

    Parameters:
        config: the engine's :class:`SimConfig`.
    """

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.scheduler = Scheduler(config)
        self.timing = TimingModel(config.timing)
        self.publisher: KvEventPublisher | None = None
        if config.kv_events is not None:
            self.publisher = KvEventPublisher(config.kv_events, config.kv_events_topic)
        #: In-flight requests (at most waiting + running); an entry leaves when its request
        #: finishes or is aborted.
        self._handles: dict[SeqState, RequestHandle] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._deadline: float | None = None  # loop time the running step is due to end
        self.failure: BaseException | None = None

    # ---- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Start the step loop (and the KV-event publisher) in the running event loop."""
        if self._closed:
            raise EngineDead("engine closed")
        if self._task is not None:
            return
        if self.publisher is not None:
            self.publisher.start()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine")

    async def aclose(self) -> None:
        """Stop the loop, end every in-flight request (as aborted), close the publisher."""
        self._closed = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for handle in list(self._handles.values()):
            self.abort(handle)
        if self.publisher is not None:
            await self.publisher.aclose()

    @property
    def healthy(self) -> bool:
        return self.failure is None and not self._closed

    # ---- requests ---------------------------------------------------------------------------

    def submit(self, spec: SeqSpec) -> RequestHandle:
        """Queue a request. Raises :class:`EngineOverloaded` or :class:`EngineDead`."""
        if self.failure is not None:
            raise EngineDead(f"engine step loop failed: {self.failure!r}")
        if not self.scheduler.can_accept():
            raise EngineOverloaded(
                f"{len(self.scheduler.waiting)} requests waiting (max_waiting_requests)"
            )
        self.start()
        seq = self.scheduler.add(spec)
        handle = RequestHandle(self, seq)
        self._handles[seq] = handle
        self._wake.set()
        return handle

    def abort(self, handle: RequestHandle) -> None:
        seq = handle._seq
        if self.scheduler.abort(seq):
            self._publish(self.scheduler.drain_events())
        if self._handles.pop(seq, None) is not None:
            handle._push(None)
        self._wake.set()  # freed blocks may let a waiting request in

    def reset_prefix_cache(self) -> bool:
        """Forget the cache (vLLM's ``/reset_prefix_cache``) if no request holds blocks.

        Publishes ``AllBlocksCleared`` on success.
        """
        if not self.scheduler.cache.clear():
            return False
        self._publish([AllBlocksCleared()])
        return True

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def kv_events_endpoint(self) -> str | None:
        """Where KV events go (a bound ``:*`` port resolved once started)."""
        return None if self.publisher is None else self.publisher.endpoint

    # ---- the loop ---------------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            while True:
                if not self.scheduler.has_work():
                    self._deadline = None
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                await self._step()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.failure = exc
            log.exception("sim engine %s: step loop failed", self.config.engine_id)
            for handle in list(self._handles.values()):
                self.abort(handle)

    async def _step(self) -> None:
        """One engine step, sleeping its modelled duration."""
        plan = self.scheduler.schedule()
        if not plan:
            self._publish(self.scheduler.drain_events())
            if self.scheduler.preempted:  # re-admission was held back for this step only
                await asyncio.sleep(0)
                return
            self._deadline = None
            self._wake.clear()  # nothing can run until a request arrives or leaves
            await self._wake.wait()
            return
        seconds = self.timing.step_seconds(Scheduler.chunks(plan)) * self.config.time_scale
        await self._sleep_step(seconds)
        for seq, tok in self.scheduler.complete(plan):
            handle = self._handles.get(seq)
            if handle is None:
                continue
            handle._push(tok)
            if tok.finish_reason is not None:
                del self._handles[seq]
                handle._push(None)
        self._publish(self.scheduler.drain_events())

    async def _sleep_step(self, seconds: float) -> None:
        """Sleep until this step's end on a clock that runs back to back while busy.

        Each step ends ``seconds`` after the previous step's *scheduled* end, not after the
        moment the loop got round to it, so timer granularity (~1 ms per sleep) and the loop's
        own work do not pile up over hundreds of steps. A lag beyond :data:`MAX_CATCH_UP_S` is
        forgiven rather than caught up (no burst of zero-length steps after a stall).
        """
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        now = asyncio.get_running_loop().time()
        start = self._deadline
        if start is None or now - start > MAX_CATCH_UP_S:
            start = now
        self._deadline = start + seconds
        await asyncio.sleep(max(0.0, self._deadline - now))

    def _publish(self, events: Sequence[KvEvent]) -> None:
        if self.publisher is not None and events:
            self.publisher.publish(events)
