"""Three ``kvgate serve`` replicas, one real redis-server, three simulated engines.

The replicas are real processes started as a platform team starts them behind a load
balancer: the quick start (``--engine URL ...``, no KV events: the approximate record) with
``--redis URL``, each from its own working directory. The test is the load balancer: it sends
request *i* of a session to another replica than request *i - 1*.

* A session's turns, spread over the three replicas, all land on one engine: the shared session
  table (Redis) gives every replica the engine of the session's last turn, and the shared
  approximate record tells every replica which blocks the others routed where. (The same
  traffic over the same replicas started without ``--redis`` moved 6 of 6 sessions, each turn
  to another engine: run by hand on 2026-11-25.) Every replica's placement remembers every
  session's own insertions, including the turns it did not route (told through Redis:
  plugins/placement/shared.py), and says ``shared_placement: ok`` on ``/health``; flow
  control's session counters hear the turns the other replicas served (``shared_sessions``).
* A request in flight on one replica is seen by the others: ``kvgate_token_load_tokens`` with
  ``scope="other"`` on replica B names the engine replica A streams from, and B's flow control
  counts A's demand in splitting the engines' limits (``fleet_limits`` on ``/health``).
* redis-server killed: every replica keeps serving on its own state and says so on ``/health``
  (``degraded``) and ``/metrics`` (``kvgate_shared_load_down 1``).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.servers import REDIS_SERVER, RedisServer, free_port, running_process, wait_ready

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(REDIS_SERVER is None, reason="needs redis-server")]

KVGATE = str(Path(sys.executable).with_name("kvgate"))
ENGINES = 3
REPLICAS = 3
SESSIONS = 6
TURNS = 4
MODEL = "sim-model"


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """Simulated engines at H100 speed (a 1,000-token answer streams for seconds), shared by
    the module's tests (each test routes its own sessions)."""
    with sims(tmp_path_factory.mktemp("sims")) as urls:
        yield urls


@contextlib.contextmanager
def sims(tmp: Path) -> Iterator[list[str]]:
    with contextlib.ExitStack() as stack:
        urls = []
        for i in range(ENGINES):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            stack.enter_context(running_process(
                [KVGATE, "sim", "--port", str(port), "--engine-id", f"sim-{i}", "--seed", str(i)],
                url + "/health", log=tmp / f"sim-{i}.log", limit_s=60))
            urls.append(url)
        yield urls


@contextlib.contextmanager
def replicas(tmp: Path, engines: list[str], redis: str) -> Iterator[list[str]]:
    """The replicas, started together (each from its own directory), ready on /v1/models."""
    procs: list[tuple[subprocess.Popen[bytes], str, Path]] = []
    try:
        for i in range(REPLICAS):
            cwd = tmp / f"replica-{i}"
            cwd.mkdir()
            port = free_port()
            argv = [KVGATE, "serve", "--port", str(port), "--redis", redis]
            argv += [a for url in engines for a in ("--engine", url)]
            log = tmp / f"replica-{i}.log"
            with log.open("wb") as out:
                proc = subprocess.Popen(argv, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
            procs.append((proc, f"http://127.0.0.1:{port}", log))
        for proc, url, log in procs:
            wait_ready(url + "/v1/models", proc, 90.0, log)
        yield [url for _, url, _ in procs]
    finally:
        for proc, _, _ in procs:
            proc.terminate()
        for proc, _, _ in procs:
            proc.wait(10)


def complete(base: str, prompt: str, session: str | None = None, max_tokens: int = 4) -> str:
    """POST a completion; the engine that served it (``x-kvgate-engine``)."""
    headers = {"x-session-affinity": session} if session else {}
    resp = httpx.post(base + "/v1/completions", headers=headers, timeout=60, json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens})
    assert resp.status_code == 200, resp.text
    return resp.headers["x-kvgate-engine"]


def metric(base: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Samples of one metric: labels (sorted) -> value."""
    text = httpx.get(base + "/metrics", timeout=10).text
    return {tuple(sorted(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == name}


def wait_for(check: object, what: str, limit_s: float = 15.0) -> None:
    assert callable(check)
    deadline = time.monotonic() + limit_s
    while not check():
        assert time.monotonic() < deadline, f"not within {limit_s} s: {what}"
        time.sleep(0.1)


def document(session: int, turn: int) -> str:
    """A session's prompt at a turn: its own opening, then one line per turn (growing)."""
    lines = [f"session {session} document: " + " ".join(
        f"w{session}x{k}" for k in range(300))]
    lines += [f"turn {t}: question {session}.{t} " + "more " * 20 for t in range(turn + 1)]
    return "\n".join(lines)


def stream_in_background(base: str, started: threading.Event, stop: threading.Event) -> None:
    """A long streaming completion on ``base``, held open until ``stop``."""
    body = {"model": MODEL, "prompt": "a long answer please " * 50, "max_tokens": 4000,
            "ignore_eos": True, "stream": True}  # ~4000 decode steps of ~5 ms: ~20 s
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as resp:
        if resp.status_code != 200:
            return
        for _ in resp.iter_lines():
            started.set()
            if stop.is_set():
                return


def test_three_replicas_route_as_one(tmp_path: Path, engines: list[str]) -> None:
    redis = RedisServer()
    redis.start()
    try:
        with replicas(tmp_path, engines, redis.url) as gws:
            _sessions_agree(gws)
            _load_is_shared(gws)
            assert redis.proc is not None
            redis.proc.kill()  # an outage, not a shutdown
            redis.proc.wait(10)
            _outage_keeps_serving(gws)
    finally:
        redis.stop()


def _sessions_agree(gws: list[str]) -> None:
    landed: dict[int, list[str]] = {s: [] for s in range(SESSIONS)}
    for turn in range(TURNS):
        for s in range(SESSIONS):
            base = gws[(s + turn) % REPLICAS]  # every turn on another replica than the last
            landed[s].append(complete(base, document(s, turn), f"chat-{s}"))
    for s, engines in landed.items():
        assert len(set(engines)) == 1, f"session {s} moved between engines: {engines}"
    for base in gws:  # every replica knows every session's own insertions, told or seen
        def told(base: str = base) -> bool:
            own = metric(base, "kvgate_placement_own_insertion_sessions")
            return list(own.values()) == [float(SESSIONS)]

        wait_for(told, "every replica's placement remembers every session")
        section = httpx.get(base + "/health", timeout=10).json()["plugins"]
        assert section["kv-placement-scorer"]["shared_placement"] == "ok"
        # flow control's least attained service counts the turns the others served
        assert section["flow-control"]["shared_sessions"] == "ok"

        def service_told(base: str = base) -> bool:
            items = metric(base, "kvgate_flow_shared_sessions_items_total")
            return items.get((("outcome", "received"),), 0.0) > 0

        wait_for(service_told, "every replica hears the sessions' service served elsewhere")


def _load_is_shared(gws: list[str]) -> None:
    started, stop = threading.Event(), threading.Event()
    worker = threading.Thread(target=stream_in_background, args=(gws[0], started, stop))
    worker.start()
    try:
        assert started.wait(30), "the long stream did not start"

        def seen() -> bool:
            samples = metric(gws[1], "kvgate_token_load_tokens")
            return any(dict(k).get("scope") == "other" and dict(k).get("kind") == "decode"
                       and v > 0 for k, v in samples.items())

        wait_for(seen, "replica B sees replica A's in-flight decode tokens")
        own = metric(gws[1], "kvgate_token_load_tokens")
        assert not any(dict(k).get("scope") == "local" and v > 0 for k, v in own.items())
        health = httpx.get(gws[1] + "/health", timeout=10).json()["plugins"]
        assert health["token-load-scorer"]["other_replicas"] == REPLICAS - 1

        def demand_seen() -> bool:  # flow control splits the limits by demand (share_limits)
            flow = httpx.get(gws[1] + "/health", timeout=10).json()["plugins"]["flow-control"]
            return "fleet_limits" in flow and flow["demand"]["others"] >= 1

        wait_for(demand_seen, "replica B's flow control sees replica A's demand")
    finally:
        stop.set()
        worker.join(30)


def _outage_keeps_serving(gws: list[str]) -> None:
    for i, base in enumerate(gws):
        complete(base, document(100 + i, 0), f"after-outage-{i}")

        def degraded(base: str = base) -> bool:
            section = httpx.get(base + "/health", timeout=10).json()["plugins"]
            return "degraded" in str(section.get("token-load-scorer", {}).get("shared_load"))

        wait_for(degraded, f"replica {i} reports the shared load degraded")
        plugins = httpx.get(base + "/health", timeout=10).json()["plugins"]
        assert "degraded" in str(plugins["prefix-cache-producer"].get("shared_record"))
        assert "degraded" in str(plugins["kv-placement-scorer"].get("shared_placement"))
        assert "degraded" in str(plugins["flow-control"].get("shared_sessions"))

        def own_limits(base: str = base) -> bool:  # flow control's exchange failed a round too
            flow = httpx.get(base + "/health", timeout=10).json()["plugins"]["flow-control"]
            return "fleet_limits" not in flow

        wait_for(own_limits, f"replica {i}'s flow control on its own limits")
        down = metric(base, "kvgate_shared_load_down")
        assert list(down.values()) == [1.0]
        assert httpx.get(base + "/health", timeout=10).status_code == 200
        complete(base, document(100 + i, 1), f"after-outage-{i}")


def test_workers_share_one_port_and_route_as_one(tmp_path: Path, engines: list[str]) -> None:
    """``--workers 2 --redis``: both workers answer on one port and see each other's load."""
    redis = RedisServer()
    redis.start()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    try:
        with running_process(
                [KVGATE, "serve", "--port", str(port), "--workers", "2", "--redis", redis.url,
                 *[a for url in engines for a in ("--engine", url)]],
                base + "/v1/models", log=tmp_path / "workers.log", cwd=tmp_path, limit_s=90):
            def each_sees_the_other() -> bool:
                for _ in range(6):  # new connections: either worker may accept each
                    with httpx.Client() as fresh:
                        section = fresh.get(base + "/health", timeout=10).json()["plugins"]
                    if section["token-load-scorer"].get("other_replicas") != 1:
                        return False
                return True

            wait_for(each_sees_the_other, "every worker sees one other", limit_s=60)
            log = (tmp_path / "workers.log").read_text()
            assert "worker slot 0 of 2" in log and "worker slot 1 of 2" in log
            assert complete(base, document(0, 0), "w") in {f"engine-{i}" for i in range(ENGINES)}
    finally:
        redis.stop()


def test_workers_refuse_a_gateway_bound_event_socket() -> None:
    done = subprocess.run(
        [KVGATE, "serve", "--engine", "http://127.0.0.1:9", "--workers", "2",
         "--kv-events-bind", f"tcp://127.0.0.1:{free_port()}"],
        capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert "--kv-events-bind" in done.stderr and "--workers" in done.stderr
