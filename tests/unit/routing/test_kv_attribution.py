"""Attribution of KV-event messages (own socket, topic, single bound engine), loud unknown
topics, and the gap bookkeeping of a replay."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from kvgate.middleware.framework.types import Endpoint
from kvgate.plugins.prefix.events.health import IndexState
from kvgate.plugins.prefix.events.replay import PendingGap
from kvgate.plugins.prefix.events.subscriber import KvEventsSubscriber
from kvgate.plugins.prefix.events.wire import EventBatch, offset_port
from tests.unit.routing.helpers import NoLookup, blocks, frames, stored

BIND = "tcp://127.0.0.1:5999"


def _endpoint(name: str, kv_events: str | None = None) -> Endpoint:
    return Endpoint(id=name, url=f"http://10.0.0.{name[-1]}:8000", kind="vllm",
                    kv_events=kv_events)


def _sub(eps: list[Endpoint], **params: Any) -> KvEventsSubscriber:
    sub = KvEventsSubscriber("kv-events", KvEventsSubscriber.Params(**params), NoLookup())
    sub.on_endpoints_changed(eps, [])
    return sub


def _store(seed: int) -> list[Any]:
    return [stored([seed], None, blocks(seed, 1, 16), 16)]


ATTRIBUTION = [
    # (case, engines' kv_events, bind, topic, via, expected holder or None)
    ("own socket, vLLM's empty topic", ["tcp://*:5557", "tcp://*:5557"], None, "", "e1", "e1"),
    ("own socket, a shared topic", ["tcp://*:5557", "tcp://*:5557"], None, "kv", "e0", "e0"),
    ("own socket wins over a topic naming another engine", ["tcp://*:5557", None], BIND,
     "kv@e1", "e0", "e0"),
    ("bound socket, topic names the engine", [None, None], BIND, "kv@e1@m", None, "e1"),
    ("bound socket, one engine there takes any topic", ["tcp://*:5557", None], BIND, "", None,
     "e1"),
    ("bound socket, two engines there need the topic", [None, None], BIND, "", None, None),
    ("bound socket, stranger topic", [None, None], BIND, "kv@zz", None, None),
]


@pytest.mark.parametrize(("case", "kv_events", "bind", "topic", "via", "holder"), ATTRIBUTION,
                         ids=[c[0] for c in ATTRIBUTION])
def test_attribution(case: str, kv_events: list[str | None], bind: str | None, topic: str,
                     via: str | None, holder: str | None) -> None:
    sub = _sub([_endpoint(f"e{i}", a) for i, a in enumerate(kv_events)], bind=bind)
    sub.handle_frames(frames(topic, 0, _store(1)), via=via)
    held = {h: sub.index.blocks_of(h) for h in ("e0", "e1") if sub.index.blocks_of(h)}
    assert held == ({} if holder is None else {holder: 1})
    assert sub.stats.unknown_topics == (holder is None)


def test_per_engine_connect_addresses_take_the_engine_host() -> None:
    sub = _sub([_endpoint("e3", "tcp://*:5557")])
    assert sub._links["e3"].address == "tcp://10.0.0.3:5557"
    assert sub._links["e3"].source == "connect"


def test_unknown_topic_degrades_the_bound_engines_and_warns_rate_limited(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    sub = _sub([_endpoint("e0"), _endpoint("e1"), _endpoint("e2", "tcp://*:5557")], bind=BIND,
               warn_interval_s=3600)
    for seq in range(5):
        sub.handle_frames(frames("", seq, _store(seq)))
    warnings = [r.getMessage() for r in caplog.records if r.name == "kvgate.kv_events"]
    assert len(warnings) == 1  # the first message at once, the rest waits for the interval
    assert "attributable to no engine (last topic '')" in warnings[0]
    assert sub.stats.unknown_topics == 5
    states = {e: sub.health_state.state(e) for e in ("e0", "e1", "e2")}
    assert states == {"e0": IndexState.DEGRADED, "e1": IndexState.DEGRADED,
                      "e2": IndexState.EXACT}
    sub.handle_frames(frames("kv@e1", 0, _store(9)))  # e1's own events clear it
    assert sub.health_state.state("e1") is IndexState.EXACT
    assert sub.health()["engines"]["e0"]["state"] == "degraded"  # type: ignore[index]


def test_warning_flush_repeats_after_the_interval(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "kvgate.kv_events")
    sub = _sub([_endpoint("e0"), _endpoint("e1")], bind=BIND, warn_interval_s=10)
    sub.handle_frames(frames("x", 0, []))
    sub.handle_frames(frames("x", 1, []))
    sub._warn_unknown(sub._warned_at + 5, flush=True)
    lines = [r.getMessage() for r in caplog.records if r.name == "kvgate.kv_events"]
    assert len(lines) == 1
    sub._warn_unknown(sub._warned_at + 10, flush=True)
    lines = [r.getMessage() for r in caplog.records if r.name == "kvgate.kv_events"]
    assert len(lines) == 2
    assert "1 message(s)" in lines[1]


def test_gap_without_a_running_replay_resets_as_before() -> None:
    eps = [Endpoint(id="e0", url="http://10.0.0.1:8000", kind="vllm", kv_events="tcp://*:5557",
                    kv_events_replay="tcp://*:5558")]
    sub = _sub(eps)
    assert sub._links["e0"].replay == "tcp://10.0.0.1:5558"
    sub.handle_frames(frames("", 0, _store(1)), via="e0")
    sub.handle_frames(frames("", 3, _store(2)), via="e0")  # not started: no replay possible
    assert sub.stats.sequence_gaps == 1
    assert sub.index.blocks_of("e0") == 1
    assert sub.stats.replays == {"filled": 0, "failed": 0}


def _batch(seq: int) -> EventBatch:
    return EventBatch("", seq, 0.0, 0, ())


MERGE = [
    # (case, expected, held, replayed, applied seqs, problem part)
    ("filled", 3, [5, 6], [3, 4, 5, 6], [3, 4, 5, 6], None),
    ("filled, replay also older", 3, [5], [1, 2, 3, 4, 5], [3, 4, 5], None),
    ("held only after the replay", 3, [5, 6, 7], [3, 4, 5], [3, 4, 5, 6, 7], None),
    ("buffer too short", 3, [5, 6], [4, 5, 6], [], "batches 3..3 are not in the replay"),
    ("no answer", 3, [5], [], [], "batches 3..4"),
    ("restart during the replay", 3, [5, 0], [3, 4, 5], [], "restarted"),
]


@pytest.mark.parametrize(("case", "expected", "held", "replayed", "applied", "problem"), MERGE,
                         ids=[c[0] for c in MERGE])
def test_pending_gap_merge(case: str, expected: int, held: list[int], replayed: list[int],
                           applied: list[int], problem: str | None) -> None:
    gap = PendingGap(expected, limit=10)
    for seq in held:
        gap.hold(_batch(seq))
    out, missing = gap.merge([_batch(s) for s in replayed])
    assert (missing is None) is (problem is None)
    if problem is not None:
        assert missing is not None and problem in missing
    else:
        assert [b.seq for b in out] == applied


def test_pending_gap_is_bounded() -> None:
    gap = PendingGap(0, limit=2)
    for seq in range(3, 6):
        gap.hold(_batch(seq))
    assert len(gap.held) == 2
    assert gap.merge([_batch(s) for s in range(6)]) == ([], "more than 2 batches arrived "
                                                        "during the replay")


@pytest.mark.parametrize(("address", "rank", "expected"), [
    ("tcp://*:5557", 0, "tcp://*:5557"), ("tcp://10.0.0.1:5557", 2, "tcp://10.0.0.1:5559"),
    ("ipc:///tmp/kv", 1, "ipc:///tmp/kv"), ("tcp://[::1]:7000", 1, "tcp://[::1]:7001"),
])
def test_offset_port(address: str, rank: int, expected: str) -> None:
    assert offset_port(address, rank) == expected
