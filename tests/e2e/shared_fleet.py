"""Pairs of real vLLM CPU engines that several e2e modules share (the fixtures ``vllm_fleet``,
``bind_fleet`` and ``small_kv_fleet`` in tests/e2e/conftest.py): each started once per session
instead of once per module (30 s on a quiet 2-core machine, minutes on a loaded one).

Each module gets the engines as a fresh start would give them (:meth:`SharedFleet.acquire`):

* healthy: an engine that died or stopped answering (a module stops one on purpose, another
  may crash one) is stopped and started again under its name, core and KV-event address;
* idle: no request running or waiting (a module's last requests may still be finishing);
* with an empty prefix cache: ``POST /reset_prefix_cache`` (vLLM's dev mode, so the engines
  start with ``VLLM_SERVER_DEV_MODE=1``). vLLM 0.32 answers ``{"success": false}`` while any
  block is held (a request finishing): retried until it succeeds;
* (engines connecting to the gateway: ``vllm_fleet``) with the KV-event port free: the gateways
  of a module bind it, and the previous module's last gateway must be gone before the next
  one binds;
* (the same) with nothing buffered for the next gateway. An engine's ZMQ PUB socket
  *connects* to that port, and once a subscriber has been there it keeps that subscription
  when the subscriber goes: whatever the engine publishes meanwhile (a module's last requests,
  the reset) queues (vLLM's high-water mark: 100,000) and floods the next gateway that binds,
  naming blocks long gone (and, to ``test_serve_default_e2e``'s gateway with other topics,
  degrading it at once). A fresh engine, never connected, drops what it publishes. So the port
  is bound here for a moment: the engines connect, their queues drain, and an unsubscribe
  leaves them with no subscriber, as fresh engines are. (An engine that binds its own socket
  drops a subscriber's queue when the subscriber goes: nothing to do there.)
* with no event pending: the reset queues ``AllBlocksCleared``, which vLLM publishes only with
  its next engine step; one tiny request (shorter than a block: nothing cached) makes that step
  now, with nobody subscribed, instead of in the middle of the next module's first request.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import httpx
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from bench.kv_steady import DEV_MODE_ENV, reset_prefix_cache  # dev mode, read at start
from kvgate.engines.local.fleet import start_fleet
from kvgate.engines.local.launcher import (
    DEFAULT_KV_CACHE_BYTES,
    LocalEngine,
    log_tail,
    spawn,
    stop,
    wait_healthy,
)
from kvgate.engines.local.model import SERVED_NAME

#: How long a module's leftovers may keep an engine busy, or a gateway the event port [s].
SETTLE_S = 120.0
IDLE_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")


class SharedFleet:
    """``count`` engines with ``kv_cache_bytes`` of KV each, started on first use and handed
    to each module clean (:meth:`acquire`). Their KV events: with ``events_port``, each engine
    connects to ``tcp://127.0.0.1:<events_port>`` (a gateway binds it); without, each binds its
    own socket (``LocalEngine.kv_events``), as deployed."""

    def __init__(self, model: Path, count: int, *, events_port: int | None = None,
                 kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES) -> None:
        self.model = model
        self.count = count
        self.events_port = events_port
        self.kv_cache_bytes = kv_cache_bytes
        self.engines: list[LocalEngine] = []
        #: Engines started again because they had died (a module's kill, a crash).
        self.replaced: list[str] = []
        #: Stale KV-event messages taken off the engines' queues between modules.
        self.drained = 0

    @property
    def events(self) -> str | None:
        """Where the engines connect to publish (None: they bind)."""
        return None if self.events_port is None else f"tcp://127.0.0.1:{self.events_port}"

    def acquire(self) -> list[LocalEngine]:
        """The engines, running, healthy, idle and with empty prefix caches, and (connecting
        engines) the event port unbound with nothing queued for it; a new list each time (a
        module may not change another's)."""
        if not self.engines:
            with pytest.MonkeyPatch.context() as env:
                env.setenv(DEV_MODE_ENV, "1")
                self.engines = start_fleet(self.count, self.events,
                                           kv_cache_bytes=self.kv_cache_bytes,
                                           kv_events_bind=self.events is None)
        else:
            self._replace_dead()
        with httpx.Client(timeout=30) as client:
            for engine in self.engines:
                _wait_idle(client, engine)
                _reset_prefix_cache(engine)
            if self.events_port is not None:  # bound by the engines: no queue outlives its SUB
                _wait_port_free(self.events_port)
                self.drained += _drain_events(f"tcp://127.0.0.1:{self.events_port}",
                                              len(self.engines))
            for engine in self.engines:
                _publish_pending_events(client, engine)
        return list(self.engines)

    def stop(self) -> None:
        for engine in self.engines:
            stop(engine)
        self.engines = []

    def _replace_dead(self) -> None:
        cores = len(os.sched_getaffinity(0))
        for i, engine in enumerate(self.engines):
            if _healthy(engine):
                continue
            stop(engine)  # a hung one too; a dead one: nothing to do
            with pytest.MonkeyPatch.context() as env:
                env.setenv(DEV_MODE_ENV, "1")
                new = spawn(self.model, engine.name, i % cores, self.events,
                            kv_cache_bytes=self.kv_cache_bytes,
                            kv_events_bind=self.events is None)
            try:
                wait_healthy([new])
            except BaseException:
                stop(new)
                raise
            self.engines[i] = new
            self.replaced.append(engine.name)


def _healthy(engine: LocalEngine, tries: int = 3) -> bool:
    for _ in range(tries):
        try:
            if httpx.get(engine.url + "/health", timeout=10).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    return False


def _busy(client: httpx.Client, engine: LocalEngine) -> float:
    text = client.get(engine.url + "/metrics").text
    return sum(sample.value for family in text_string_to_metric_families(text)
               if family.name in IDLE_GAUGES for sample in family.samples)


def _wait_idle(client: httpx.Client, engine: LocalEngine) -> None:
    deadline = time.monotonic() + SETTLE_S
    while (busy := _busy(client, engine)) > 0:
        if time.monotonic() > deadline:
            raise AssertionError(f"{engine.name}: {busy:.0f} request(s) still running or "
                                 f"waiting after {SETTLE_S:.0f} s; log tail:\n"
                                 f"{log_tail(engine)}")
        time.sleep(0.5)


def _reset_prefix_cache(engine: LocalEngine) -> None:
    deadline = time.monotonic() + SETTLE_S
    while True:
        done = reset_prefix_cache(engine.url)
        assert done is not None, (f"{engine.name}: POST /reset_prefix_cache not served "
                                  f"(started without {DEV_MODE_ENV}=1?)")
        if done:
            return
        if time.monotonic() > deadline:  # vLLM refuses while blocks are held
            raise AssertionError(f"{engine.name}: prefix cache not reset after "
                                 f"{SETTLE_S:.0f} s; log tail:\n{log_tail(engine)}")
        time.sleep(0.5)


def _publish_pending_events(client: httpx.Client, engine: LocalEngine) -> None:
    """One engine step: vLLM publishes the reset's ``AllBlocksCleared`` with it. The prompt is
    shorter than a block (128 tokens), so the step caches nothing."""
    resp = client.post(engine.url + "/v1/completions", json={
        "model": SERVED_NAME, "prompt": "reset", "max_tokens": 1})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["prompt_tokens"] < 128


def _wait_port_free(port: int) -> None:
    """Until nothing listens on 127.0.0.1:``port`` (a test socket binds it, without listening,
    with ``SO_REUSEADDR`` as ZMQ binds: only a listener is in the way)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("127.0.0.1", port))
                return
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise AssertionError(f"the KV-event port {port} is still bound after "
                                         f"{SETTLE_S:.0f} s (a gateway left running?)") from exc
        time.sleep(0.5)


def _drain_events(address: str, engines: int) -> int:
    """Bind ``address``, wait for ``engines`` connections, take what their queues hold, then
    unsubscribe (the engines drop what they publish until a gateway subscribes); how many
    messages were queued."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    monitor = sub.get_monitor_socket(zmq.EVENT_ACCEPTED)
    try:
        sub.bind(address)
        deadline = time.monotonic() + SETTLE_S
        accepted = 0
        while accepted < engines:
            if monitor.poll(500):
                monitor.recv_multipart()
                accepted += 1
            elif time.monotonic() > deadline:
                raise AssertionError(f"{accepted} of {engines} engines connected to {address} "
                                     f"in {SETTLE_S:.0f} s")
        drained = 0
        while sub.poll(1000):  # queued messages follow the connection at once
            sub.recv_multipart()
            drained += 1
        sub.setsockopt(zmq.UNSUBSCRIBE, b"")
        time.sleep(0.5)  # the unsubscribe reaches the engines before the connections close
        return drained
    finally:
        sub.disable_monitor()
        monitor.close(linger=0)
        sub.close(linger=0)
        ctx.term()
