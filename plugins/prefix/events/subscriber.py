"""KV-cache events from vLLM-compatible engines: the ZMQ subscriber plugin ``kv-events``.

Wire decoding lives in :mod:`kvgate.plugins.prefix.events.wire`, gap filling in
:mod:`kvgate.plugins.prefix.events.replay`, the per-engine index states in
:mod:`kvgate.plugins.prefix.events.health`.

Sockets (``zmq.asyncio`` SUB, subscribed to every topic):

* one socket **per engine** that binds its own ``kv_events`` address (``tcp://*:5557``; the
  ``*`` becomes the engine URL's host): everything received on it is that engine's, whatever the
  topic (vLLM's default empty topic and topics shared by the whole fleet work);
* one **bound** socket (``bind``) for engines that connect to the gateway: there the topic
  ``kv@<engine>[@model]`` must name the engine, except when exactly one engine is expected on
  it (then everything on it is that engine's).

A message nobody can be attributed to is counted (``unknown_topics``), logged at WARNING at once
and then at most every ``warn_interval_s``, and degrades the engines expected on the bound
socket that have sent nothing attributed (:mod:`kvgate.plugins.prefix.events.health`).

Per (engine, rank) a sequence step back (restart) resets that rank's entries before the batch
is applied. A jump (lost batches) is filled from the engine's replay socket when one is
configured (``kv_events_replay``): the batches arriving meanwhile are held, the missing ones
asked for, and all applied in order; if the replay cannot fill it (buffer too short, no answer
within ``replay_timeout_s``), or without a replay socket, the rank's entries are reset as for a
restart. At first contact with a (engine, rank) whose first batch is not its first ever
(``seq`` > 0: the gateway joined or restarted after the engine started), the same replay
socket is asked for the engine's history (``history``: every batch it still buffers), so the
blocks cached before the gateway listened are indexed too; without a replay socket, or when it
cannot answer, the index starts from that batch as before (``history`` counter ``failed``).
Malformed frames and events are counted and skipped. Counters live in
:attr:`KvEventsSubscriber.stats`; :meth:`KvEventsSubscriber.collector` exports them and the
states to the app's Prometheus registry; :meth:`KvEventsSubscriber.health` is its ``/health``
section.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import zmq
import zmq.asyncio
from prometheus_client.registry import Collector
from pydantic import BaseModel, ConfigDict, Field

from kvgate.middleware.framework.errors import ConfigError
from kvgate.middleware.framework.plugin import EndpointSetListener, Lifecycle, Plugin, PluginLookup
from kvgate.middleware.framework.tasks import cancel_and_wait
from kvgate.middleware.framework.types import Endpoint
from kvgate.plugins.prefix.events.health import HealthParams, IndexHealth, Source
from kvgate.plugins.prefix.events.replay import PendingGap, ReplayFailed, fetch_replay
from kvgate.plugins.prefix.events.stats import KvEventsStats, StatsCollector
from kvgate.plugins.prefix.events.wire import (
    MAX_DP_RANK,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KvEvent,
    MalformedFrame,
    connect_address,
    decode_event,
    decode_frames,
    offset_port,
    topic_engine,
)
from kvgate.plugins.prefix.index.index import HashingError, KvIndex, engine_of, holder_id
from kvgate.plugins.prefix.shared_tier import holder_for

__all__ = [
    "MAX_DP_RANK", "AllBlocksCleared", "BlockRemoved", "BlockStored", "EventBatch",
    "KvEvent", "KvEventsStats", "KvEventsSubscriber", "MalformedFrame", "connect_address",
    "decode_event", "decode_frames", "topic_engine",
]

log = logging.getLogger("kvgate.kv_events")

#: Seconds between re-evaluations of time-based states (silence, holds, fallback) and flushes
#: of the rate-limited unknown-topic warning: a change shows in the log within this.
TICK_S = 0.5


@dataclass(slots=True)
class _Link:
    """Where one engine's events come from."""

    source: Source
    address: str = ""  # our connect address ("" when it publishes to the bound socket)
    replay: str = ""  # its replay socket ("" when none)
    sock: zmq.asyncio.Socket | None = None
    task: asyncio.Task[None] | None = None


class KvEventsSubscriber(Plugin, Lifecycle, EndpointSetListener):
    """Plugin ``kv-events``: subscribes to the engines' KV events and keeps the block index.

    Owns a :class:`~kvgate.plugins.prefix.index.index.KvIndex` (read by ``prefix-cache-producer``
    through :attr:`index`) and the engines' index states (:attr:`health`). See the module docstring
    and docs/plugins/kv-events.md for the parameters and the reasons of their defaults.
    """

    type_name: ClassVar[str] = "kv-events"

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)
        #: ZMQ address the shared SUB socket binds; engines with a plain ``endpoint`` connect.
        bind: str | None = None
        #: Connect one socket to every engine's configured ``kv_events`` address.
        connect: bool = True
        #: First part of the topic: ``<topic_prefix>@<engine>[@model]``.
        topic_prefix: str = Field("kv", min_length=1)
        #: Index bound, in (engine, block) pairs. 262,144 x ~360 bytes ~= 90 MiB; a fleet of 8
        #: engines x 25k GPU blocks (16 tokens each, an 8B model on one H100) fits with room.
        capacity_blocks: int = Field(262_144, ge=1)
        #: Tokens per block assumed for an engine before its first event (vLLM's GPU default).
        default_block_size: int = Field(16, ge=1)
        #: Messages queued in each socket before ZMQ drops (then the sequence check fills or
        #: resets).
        receive_hwm: int = Field(100_000, ge=1)
        #: Recently routed prompts' ids (4 B a token; 16 MiB = 4M) to re-key orphans (recent.py).
        recent_prompt_bytes: int = Field(16 << 20, ge=0)
        #: Recent matches' walks (index/resume.py; 16 MiB: ~300 100k-token prompts). 0: none.
        match_memo_bytes: int = Field(16 << 20, ge=0)
        #: Seconds a served request with uncached blocks may wait for its engine's next event.
        silence_s: float = Field(5.0, gt=0)
        #: Seconds an unattributable message keeps silent bound-socket engines degraded.
        unknown_topic_hold_s: float = Field(30.0, gt=0)
        #: Seconds between two unknown-topic warnings (the first is logged at once).
        warn_interval_s: float = Field(10.0, gt=0)
        #: Predictions judged per engine (a sliding window), and the least judged at all.
        prediction_window: int = Field(50, ge=1)
        prediction_min_checks: int = Field(20, ge=1)
        #: Least share of predictions within one block of the engine's report for ``exact``.
        prediction_agreement: float = Field(0.8, ge=0, le=1)
        #: Hysteresis: the share a new window needs to clear a disagreement (>= agreement),
        #: and seconds a cleared disagreement or silence holds the state before ``exact``.
        prediction_recover_agreement: float = Field(0.9, ge=0, le=1)
        recover_hold_s: float = Field(10.0, ge=0)
        #: Seconds a replay socket has to answer completely.
        replay_timeout_s: float = Field(2.0, gt=0)
        #: Batches held per (engine, rank) while its gap is replayed (past it: reset).
        replay_max_batches: int = Field(10_000, ge=1)
        #: ``medium`` values (exact, case-sensitive) that mean the fleet's shared store even
        #: without ``locality: REMOTE``: vLLM 0.32's Mooncake store connector publishes its
        #: blocks as ``"cpu"`` (lower case; its own CPU offloading says ``"CPU"``). Empty: only
        #: ``locality`` decides (docs/shared-tier.md).
        shared_media: frozenset[str] = frozenset()

    example_params: ClassVar[Mapping[str, object]] = {"bind": "tcp://127.0.0.1:5557"}

    def __init__(self, name: str, params: BaseModel, plugins: PluginLookup) -> None:
        super().__init__(name, params, plugins)
        assert isinstance(params, KvEventsSubscriber.Params)
        self.p = params
        self.index = KvIndex(params.capacity_blocks, None, params.default_block_size,
                             params.recent_prompt_bytes, match_memo_bytes=params.match_memo_bytes)
        self.stats = KvEventsStats()
        self.health_state = IndexHealth(HealthParams(
            silence_s=params.silence_s, unknown_topic_hold_s=params.unknown_topic_hold_s,
            window=params.prediction_window,
            min_checks=min(params.prediction_min_checks, params.prediction_window),
            agreement=params.prediction_agreement,
            recover_agreement=max(params.prediction_agreement,
                                  params.prediction_recover_agreement),
            recover_hold_s=params.recover_hold_s,
        ))
        self._links: dict[str, _Link] = {}
        self._seq: dict[tuple[str, int], int] = {}
        self._gaps: dict[tuple[str, int], PendingGap] = {}
        #: (engine, rank) whose history was asked for (once per contact; dropped with _seq)
        self._met: set[tuple[str, int]] = set()
        self._ctx: zmq.asyncio.Context | None = None
        self._bound: zmq.asyncio.Socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._warned_at = -math.inf
        self._unwarned = 0
        self._last_unknown = ""
        #: The address actually bound (a ``:0`` / ``:*`` port resolved), once started.
        self.bound_address: str | None = None

    # -- endpoint set ---------------------------------------------------------------------
    def on_endpoints_changed(
        self, added: Sequence[Endpoint], removed: Sequence[Endpoint]
    ) -> None:
        for ep in removed:
            link = self._links.pop(ep.id, None)
            if link is not None:
                self._close_link(link)
            self._forget(ep.id)
            self.health_state.forget(ep.id)
        for ep in added:
            link = self._link_for(ep)
            self._links[ep.id] = link
            self.health_state.configure(ep.id, link.source, link.address or (self.p.bind or ""))
            if link.address and self._ctx is not None:
                self._open_link(ep.id, link)

    def _link_for(self, ep: Endpoint) -> _Link:
        replay = connect_address(ep.kv_events_replay, ep.url) if ep.kv_events_replay else ""
        if self.p.connect and ep.kv_events and ep.kv_events != self.p.bind:
            return _Link("connect", connect_address(ep.kv_events, ep.url), replay)
        return _Link("bound" if self.p.bind else "none", "", replay)

    def _forget(self, engine: str) -> None:
        self.index.reset_engine(engine)
        for key in [k for k in self._seq if k[0] == engine]:
            del self._seq[key]
        for key in [k for k in self._gaps if k[0] == engine]:
            del self._gaps[key]
        self._met = {k for k in self._met if k[0] != engine}

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        if self._ctx is not None:
            return
        self._ctx = zmq.asyncio.Context()
        try:
            if self.p.bind:
                self._bound = self._socket()
                self._bound.bind(self.p.bind)
                self.bound_address = self._bound.getsockopt_string(zmq.LAST_ENDPOINT)
                self._spawn(self._receive_loop(self._bound, None), "bound")
            for engine, link in self._links.items():
                if link.address:
                    self._open_link(engine, link)
        except zmq.ZMQError as exc:
            await self.stop()
            raise ConfigError(f"plugin {self.name!r}: cannot open KV-event socket: {exc}") from None
        self._spawn(self._ticker(), "tick")
        log.info("kv events: bound %s, connected to %d engines", self.bound_address,
                 sum(1 for link in self._links.values() if link.sock is not None))

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, set()
        await cancel_and_wait(*tasks)
        for link in self._links.values():
            self._close_link(link)
        if self._bound is not None:
            self._bound.close(linger=0)
            self._bound = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def _socket(self) -> zmq.asyncio.Socket:
        assert self._ctx is not None
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.RCVHWM, self.p.receive_hwm)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        return sock

    def _open_link(self, engine: str, link: _Link) -> None:
        sock = self._socket()
        try:
            sock.connect(link.address)
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        link.sock = sock
        link.task = self._spawn(self._receive_loop(sock, engine), engine)

    def _close_link(self, link: _Link) -> None:
        if link.task is not None:
            link.task.cancel()
            self._tasks.discard(link.task)
            link.task = None
        if link.sock is not None:
            link.sock.close(linger=0)
            link.sock = None

    def _spawn(self, coro: Coroutine[Any, Any, None], what: str) -> asyncio.Task[None]:
        task = asyncio.create_task(coro, name=f"kvgate-{self.name}-{what}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _receive_loop(self, sock: zmq.asyncio.Socket, engine: str | None) -> None:
        while True:
            frames = await sock.recv_multipart()
            try:
                self.handle_frames(frames, via=engine)
            except Exception:  # the loop must survive any bug in one message's handling
                self.stats.malformed_messages += 1
                log.exception("kv events: message handling failed; message dropped")

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            self.health_state.tick()
            self._warn_unknown(time.monotonic(), flush=True)

    # -- message handling (synchronous; also the entry point of tests) -----------------------
    def handle_frames(self, frames: Sequence[bytes], via: str | None = None) -> None:
        """Decode one message and apply it. ``via``: the engine whose own socket it came on
        (None: the shared bound socket, attributed by topic)."""
        self.stats.messages += 1
        try:
            batch = decode_frames(frames)
        except MalformedFrame as exc:
            self.stats.malformed_messages += 1
            log.debug("kv events: malformed message skipped: %s", exc)
            return
        self.stats.malformed_events += batch.malformed_events
        self.stats.unknown_events += batch.unknown_events
        engine = via if via is not None else self._attribute(batch.topic)
        if engine is None or engine not in self._links:
            self._unknown(batch.topic)
            return
        self.health_state.event(engine)
        self._accept(engine, batch)
        self.health_state.settle(engine)  # overs waiting for this batch's removals

    def _attribute(self, topic: str) -> str | None:
        engine = topic_engine(topic, self.p.topic_prefix)
        if engine is not None and engine in self._links:
            return engine
        if self.p.bind:
            bound = [e for e, link in self._links.items() if link.source == "bound"]
            if len(bound) == 1:
                return bound[0]
        return None

    def _unknown(self, topic: str) -> None:
        self.stats.unknown_topics += 1
        self._unwarned += 1
        self._last_unknown = topic
        self.health_state.unknown_topic(topic)
        self._warn_unknown(time.monotonic())

    def _warn_unknown(self, now: float, flush: bool = False) -> None:
        """Rate-limited: the first message at once, then one line per ``warn_interval_s``."""
        if not self._unwarned or now - self._warned_at < self.p.warn_interval_s:
            return
        if flush and self._warned_at == -math.inf:
            return
        known = ", ".join(sorted(self._links)) or "none"
        log.warning("kv events: %d message(s) attributable to no engine (last topic %r) on the "
                    "bound socket %s: the topic must be '%s@<engine>[@model]' for one of the "
                    "configured engines (%s), or connect to an engine that binds",
                    self._unwarned, self._last_unknown, self.bound_address or self.p.bind,
                    self.p.topic_prefix, known)
        self._warned_at, self._unwarned = now, 0

    def _accept(self, engine: str, batch: EventBatch) -> None:
        key = (engine, batch.dp_rank)
        gap = self._gaps.get(key)
        if gap is not None:
            gap.hold(batch)
            return
        last = self._seq.get(key)
        if last is None and key not in self._met:
            self._met.add(key)
            if batch.seq > 0 and self._start_replay(engine, batch, -1, history=True):
                return
        holder = holder_id(engine, batch.dp_rank)
        if last is not None and batch.seq > last + 1:
            self.stats.sequence_gaps += 1
            if self._start_replay(engine, batch, last):
                return
            log.warning("kv events: %s lost batches %d..%d; its entries were reset",
                        holder, last + 1, batch.seq - 1)
            self.index.reset(holder)
        elif last is not None and batch.seq <= last:
            self.stats.sequence_restarts += 1
            log.info("kv events: %s restarted (seq %d after %d); its entries were reset",
                     holder, batch.seq, last)
            self.index.reset(holder)
            self.index.removals.cleared(engine)
        self._apply_batch(engine, batch)

    def _apply_batch(self, engine: str, batch: EventBatch) -> None:
        self._seq[(engine, batch.dp_rank)] = batch.seq
        holder = holder_id(engine, batch.dp_rank)
        for event in batch.events:
            self._apply(holder, event)

    def _apply(self, publisher: str, event: KvEvent) -> None:
        holder = publisher
        if isinstance(event, BlockStored | BlockRemoved):  # a shared store's: its own holder
            holder = holder_for(publisher, event.locality, event.medium, self.p.shared_media)
        if isinstance(event, BlockStored):
            extra = event.extra_keys
            if extra is None and event.lora_name:
                extra = ((event.lora_name,),) * len(event.block_hashes)
            try:
                self.index.store(
                    holder, event.block_hashes, event.parent_block_hash, event.token_ids,
                    event.block_size, medium=event.medium, group_idx=event.group_idx,
                    extra_keys=extra, source=publisher,  # token-less: KvIndex.store_known
                )
            except HashingError as exc:
                self.stats.malformed_events += 1
                log.debug("kv events: unhashable BlockStored from %s: %s", holder, exc)
                return
        elif isinstance(event, BlockRemoved):
            self.index.remove(
                holder, event.block_hashes, medium=event.medium, group_idx=event.group_idx
            )
        else:
            self.index.reset(holder)
            self.index.removals.cleared(engine_of(holder))
        self.stats.events_applied[type(event).__name__] += 1

    # -- gap filling ---------------------------------------------------------------------------
    def _start_replay(self, engine: str, batch: EventBatch, last: int,
                      history: bool = False) -> bool:
        """Hold ``batch`` and ask the engine's replay socket for ``last + 1 ..`` (``history``:
        all it buffers, at first contact); False when the engine has none (or the plugin is
        not running)."""
        link = self._links[engine]
        if not link.replay or self._ctx is None:
            if history:
                self.stats.history["failed"] += 1
                log.warning("kv events: %s first heard at batch %d, with no replay socket "
                            "(kv_events_replay): the blocks it cached before are unknown "
                            "until it stores them again", holder_id(engine, batch.dp_rank),
                            batch.seq)
            return False
        gap = PendingGap(last + 1, self.p.replay_max_batches, history=history)
        gap.hold(batch)
        self._gaps[(engine, batch.dp_rank)] = gap
        address = offset_port(link.replay, batch.dp_rank)
        if not history:  # a history is no loss: the engine's state does not degrade
            self.health_state.gap_opened(
                engine, f"lost KV-event batches {last + 1}..{batch.seq - 1} "
                f"(rank {batch.dp_rank}); asking the replay socket {address}")
        self._spawn(self._replay(engine, batch.dp_rank, gap, address), f"{engine}-replay")
        return True

    async def _replay(self, engine: str, rank: int, gap: PendingGap, address: str) -> None:
        assert self._ctx is not None
        try:
            replayed = await fetch_replay(self._ctx, address, gap.expected,
                                          self.p.replay_timeout_s, self.p.replay_max_batches)
            problem = None
        except ReplayFailed as exc:
            replayed, problem = [], f"replay socket {address}: {exc}"
        if self._gaps.get((engine, rank)) is not gap:
            return  # the engine left the pool meanwhile
        del self._gaps[(engine, rank)]
        if gap.history:
            self._caught_up(engine, rank, gap, replayed, problem, address)
            return
        batches, missing = gap.merge(replayed)
        problem = problem or missing
        holder = holder_id(engine, rank)
        if problem is None:
            self.stats.replays["filled"] += 1
            log.info("kv events: %s gap from batch %d filled from %s (%d batches)", holder,
                     gap.expected, address, len(batches))
        else:
            self.stats.replays["failed"] += 1
            log.warning("kv events: %s lost batches from %d and the replay could not fill "
                        "them (%s); its entries were reset", holder, gap.expected, problem)
            self.index.reset(holder)
            self._seq.pop((engine, rank), None)
        self.health_state.gap_closed(engine)
        if problem is None:
            for batch in batches:
                self._apply_batch(engine, batch)
            return
        for batch in gap.held:  # the ordinary sequence checks (a restart resets again)
            self._accept(engine, batch)

    def _caught_up(self, engine: str, rank: int, gap: PendingGap,
                   replayed: Sequence[EventBatch], problem: str | None, address: str) -> None:
        """Apply a first contact's history, then the batches held meanwhile (any of them the
        history does not reach goes through the ordinary sequence checks)."""
        holder = holder_id(engine, rank)
        batches = gap.history_run(replayed) if problem is None else []
        if batches:
            self.stats.history["caught_up"] += 1
            log.info("kv events: %s caught up on %d batches of history (seq %d..%d) from %s",
                     holder, len(batches), batches[0].seq, batches[-1].seq, address)
        else:
            self.stats.history["failed"] += 1
            log.warning("kv events: %s: no history from the replay socket (%s); the index "
                        "starts from its first live batch", holder,
                        problem or "nothing buffered")
        for batch in batches:
            self._apply_batch(engine, batch)
        applied = self._seq.get((engine, rank), -1)
        for batch in gap.held:
            if batch.seq > applied:
                self._accept(engine, batch)

    # -- observability -------------------------------------------------------------------------
    def health(self) -> Mapping[str, object]:
        """The ``/health`` section: per-engine index states (docs/plugins/kv-events.md)."""
        return self.health_state.health()

    def collector(self) -> Collector:
        """A Prometheus collector of :attr:`stats`, the index size and the engines' states."""
        return StatsCollector(self.stats, self.index, self.health_state)
