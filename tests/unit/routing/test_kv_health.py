"""Per-engine KV index states: each cause in, its recovery out, warnings, /health and metrics."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from kvgate.plugins.prefix.events.health import (
    HealthParams,
    IndexHealth,
    IndexState,
    Policy,
    Source,
)
from tests.unit.routing.helpers import Clock

PARAMS = HealthParams(silence_s=5, unknown_topic_hold_s=30, window=10, min_checks=5,
                      agreement=0.8, recover_agreement=0.9, recover_hold_s=10,
                      fallback_after_s=10)
Step = Callable[[IndexHealth, Clock], None]


def _health(policy: Policy = "precise", source: Source = "bound") -> tuple[IndexHealth, Clock]:
    clock = Clock()
    health = IndexHealth(PARAMS, policy=policy, clock=clock, wall=lambda: 1.7e9 + clock.now)
    health.configure("e0", source)
    health.configure("e1", source)
    return health, clock


def _later(seconds: float) -> Step:
    def step(h: IndexHealth, c: Clock) -> None:
        c.now += seconds
        h.tick()
    return step


def _served(h: IndexHealth, c: Clock) -> None:
    h.served("e0", c.now - 0.01, expects_event=True)


def _predictions(n: int, predicted: int, reported: int, tokens_agree: bool = True) -> Step:
    def step(h: IndexHealth, c: Clock) -> None:
        for _ in range(n):
            h.prediction("e0", predicted, reported, 16, tokens_agree)
    return step


@dataclass(frozen=True)
class Case:
    name: str
    cause: list[Step]
    reason: str  # a part of the degraded reason
    recovery: list[Step]
    #: A judged cause (silence, predictions): exact only after ``recover_hold_s`` clear.
    held: bool = False


CASES = [
    Case("gap being replayed", [lambda h, c: h.gap_opened("e0", "lost KV-event batches 3..4")],
         "lost KV-event batches 3..4", [lambda h, c: h.gap_closed("e0")]),
    Case("pseudo-tokenizer ids", [lambda h, c: h.token_ids_inexact("e0", "ids of approx")],
         "ids of approx", [lambda h, c: h.token_ids_inexact("e0", None)]),
    Case("unattributable messages on its socket", [lambda h, c: h.unknown_topic("")],
         "unattributable KV events", [_later(30)]),
    Case("silent after serving new blocks", [_served, _later(5)], "silent",
         [lambda h, c: h.event("e0")], held=True),
    Case("predictions under", [_predictions(5, 0, 64)], "predictions disagree",
         [_predictions(4, 64, 64), _predictions(1, 64, 64)], held=True),
    Case("predictions over", [_predictions(5, 64, 0)], "predictions disagree",
         [_predictions(5, 32, 16)], held=True),
    Case("token counts differ", [_predictions(5, 0, 0, tokens_agree=False)],
         "token ids are not the engine's", [_predictions(5, 0, 0)], held=True),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_cause_degrades_and_recovery_restores(case: Case,
                                              caplog: pytest.LogCaptureFixture) -> None:
    health, clock = _health()
    assert health.state("e0") is IndexState.EXACT
    caplog.set_level(logging.WARNING, "kvgate.kv_index")
    for step in case.cause:
        step(health, clock)
    assert health.state("e0") is IndexState.DEGRADED
    assert case.reason in health.reason("e0")
    assert _lines(caplog, "e0") == [
        f"kv index: engine e0 exact -> degraded: {health.reason('e0')}"]
    caplog.clear()
    for step in case.recovery:
        step(health, clock)
    lines = [" engine e0 degraded -> exact"]
    if case.held:  # hysteresis: still degraded until the cause stayed clear for the hold
        assert health.state("e0") is IndexState.DEGRADED
        assert "recovering" in health.reason("e0")
        _later(PARAMS.recover_hold_s - 0.1)(health, clock)
        assert health.state("e0") is IndexState.DEGRADED
        _later(0.1)(health, clock)
        lines = [" engine e0 degraded -> degraded", *lines]
    assert health.state("e0") is IndexState.EXACT, health.reason("e0")
    assert [line.split(":")[1] for line in _lines(caplog, "e0")] == lines


def _lines(caplog: pytest.LogCaptureFixture, engine: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and f"engine {engine} " in r.getMessage()]


def test_predictions_need_a_new_window_to_recover() -> None:
    health, _ = _health()
    _predictions(5, 0, 64)(health, Clock())
    assert health.state("e0") is IndexState.DEGRADED
    _predictions(4, 64, 64)(health, Clock())  # 4 < min_checks: not judged yet
    assert health.state("e0") is IndexState.DEGRADED
    assert health.within_share("e0") == 1.0


def test_an_idle_engine_is_never_silent() -> None:
    health, clock = _health()
    _later(3600)(health, clock)
    assert health.state("e0") is IndexState.EXACT


def test_an_event_after_the_dispatch_answers_the_request() -> None:
    health, clock = _health()
    health.event("e0")  # arrives before the usage (the usual order)
    health.served("e0", clock.now - 0.01, expects_event=True)
    _later(60)(health, clock)
    assert health.state("e0") is IndexState.EXACT
    health.served("e0", clock.now, expects_event=False)  # a fully cached prompt stores nothing
    _later(60)(health, clock)
    assert health.state("e0") is IndexState.EXACT


def test_unknown_topics_spare_engines_whose_own_events_arrive() -> None:
    health, _ = _health()
    health.event("e1")
    health.unknown_topic("kv@typo")
    assert health.state("e0") is IndexState.DEGRADED
    assert health.state("e1") is IndexState.EXACT
    assert "'kv@typo'" in health.reason("e0")


def test_unknown_topics_leave_engines_on_their_own_socket_alone() -> None:
    health, _ = _health(source="connect")
    health.unknown_topic("")
    assert health.state("e0") is IndexState.EXACT


def test_auto_mode_falls_back_then_returns() -> None:
    health, clock = _health("auto")
    health.gap_opened("e0", "lost batches")
    assert health.state("e0") is IndexState.DEGRADED
    assert health.routing("e0") == "approximate"
    assert health.routing("e1") == "precise"
    _later(9)(health, clock)
    assert health.state("e0") is IndexState.DEGRADED
    _later(1)(health, clock)
    assert health.state("e0") is IndexState.APPROXIMATE
    assert health.reason("e0") == "fallen back to the gateway's record: lost batches"
    health.gap_closed("e0")
    assert health.state("e0") is IndexState.EXACT
    assert health.routing("e0") == "precise"


STATIC_CASES = [
    # (policy, source, state, part of the reason)
    ("precise", "none", IndexState.OFF, "no prefix routing"),
    ("events", "none", IndexState.OFF, "no prefix routing"),
    ("auto", "none", IndexState.APPROXIMATE, "the gateway's own record"),
    ("approximate", "bound", IndexState.APPROXIMATE, "mode approximate"),
    ("approximate", "none", IndexState.APPROXIMATE, "mode approximate"),
    ("auto", "connect", IndexState.EXACT, "none received yet"),
    ("precise", "bound", IndexState.EXACT, "none received yet"),
]


@pytest.mark.parametrize(("policy", "source", "state", "reason"), STATIC_CASES)
def test_configured_states(policy: Policy, source: Source, state: IndexState,
                           reason: str) -> None:
    health, _ = _health(policy, source)
    assert health.state("e0") is state
    assert reason in health.reason("e0")


@pytest.mark.parametrize(("predicted", "reported", "result"), [
    (0, 0, "within_block"), (48, 32, "within_block"), (32, 48, "within_block"),
    (64, 32, "over"), (0, 33, "under"), (160, 0, "over"),
])
def test_prediction_results(predicted: int, reported: int, result: str) -> None:
    health, _ = _health()
    assert health.prediction("e0", predicted, reported, 16, True) == result
    assert health.results("e0")[result] == 1


@pytest.mark.parametrize(("predicted", "confirmed", "reported", "result"), [
    (160, 0, 0, "speculative"),  # all of the excess was a guess about a request in flight
    (160, 32, 16, "speculative"),
    (160, 160, 0, "over"),  # the engine's own events said so: the index is wrong
    (160, 96, 0, "over"),  # the confirmed part alone is still off by more than a block
    (160, 0, 160, "within_block"),
])
def test_speculative_misses_are_kept_apart(predicted: int, confirmed: int, reported: int,
                                           result: str) -> None:
    health, _ = _health()
    assert health.prediction("e0", predicted, reported, 16, True, confirmed=confirmed) == result
    assert health.results("e0")[result] == 1


def test_speculative_misses_do_not_degrade_an_engine() -> None:
    health, _ = _health()
    for _ in range(60):
        health.prediction("e0", 160, 0, 16, True, confirmed=0)
    assert health.results("e0")["speculative"] == 60
    assert health.state("e0") is not IndexState.DEGRADED


def test_health_section_and_metrics() -> None:
    health, clock = _health()
    health.event("e0")
    _predictions(3, 16, 16)(health, clock)
    _predictions(1, 64, 0)(health, clock)
    health.gap_opened("e1", "lost batches")
    section = health.health()
    assert section["policy"] == "precise"
    engines = section["engines"]
    assert isinstance(engines, dict)
    assert engines["e0"] == {
        "state": "exact", "reason": "KV events arrive attributed; predictions agree",
        "since": 1.7e9 + 1000.0, "routing": "precise", "events": "bound",
        "predictions_checked": 4, "predictions_within_block": 0.75}
    assert engines["e1"]["state"] == "degraded"
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for m in health.collector().collect() for s in m.samples}
    assert samples[("kvgate_kv_index_state", (("engine", "e1"), ("state", "degraded")))] == 1
    assert samples[("kvgate_kv_index_state", (("engine", "e1"), ("state", "exact")))] == 0
    assert samples[("kvgate_kv_index_state_changes_total",
                    (("engine", "e1"), ("state", "degraded")))] == 1
    assert samples[("kvgate_kv_predictions_total",
                    (("engine", "e0"), ("result", "within_block")))] == 3
    assert samples[("kvgate_kv_predictions_total", (("engine", "e0"), ("result", "over")))] == 1
    assert samples[("kvgate_kv_predictions_within_block_ratio", (("engine", "e0"),))] == 0.75


def test_forgotten_engines_leave_health_and_metrics() -> None:
    health, _ = _health()
    health.forget("e1")
    assert health.engines() == ("e0",)
    assert health.state("e1") is None
    assert health.routing("e1") == "none"


def test_in_flight_evictions_do_not_degrade_an_engine() -> None:
    """``over`` predictions whose blocks the engine's events removed after the dispatch are
    counted apart (``evicted``) and never judged: under KV pressure they are most of the
    misses, and judging them made the state flap."""
    health, _ = _health()
    for _ in range(60):
        assert health.prediction("e0", 160, 0, 16, True, evicted=True) == "evicted"
    assert health.results("e0")["evicted"] == 60
    assert health.state("e0") is not IndexState.DEGRADED
    assert health.prediction("e0", 160, 160, 16, True, evicted=True) == "within_block"


D, E, A = IndexState.DEGRADED, IndexState.EXACT, IndexState.APPROXIMATE


def _mixed(good: int, bad: int) -> Step:
    """``good`` predictions within one block, then ``bad`` ones off by four blocks."""
    def step(h: IndexHealth, c: Clock) -> None:
        _predictions(good, 64, 64)(h, c)
        _predictions(bad, 0, 64)(h, c)
    return step


def _event(h: IndexHealth, c: Clock) -> None:
    h.event("e0")


#: (name, policy, steps with the state expected after each, changes of e0's state)
HYSTERESIS = [
    ("a share between the two thresholds does not clear a disagreement", "precise",
     [(_mixed(0, 5), D), (_mixed(4, 1), D), (_later(30), D), (_mixed(4, 1), D)], 1),
    ("a share at the recovery threshold clears it after the hold", "precise",
     [(_mixed(0, 5), D), (_mixed(4, 1), D), (_mixed(5, 0), D), (_later(9.9), D),
      (_later(0.1), E)], 2),
    ("an exact window at the lower threshold stays exact (no re-judging up)", "precise",
     [(_mixed(4, 1), E), (_mixed(4, 1), E), (_later(60), E)], 0),
    ("a silence that recurs within the hold does not flap", "precise",
     [(_served, E), (_later(5), D), (_event, D), (_later(4), D), (_served, D), (_later(5), D),
      (_event, D), (_later(9.9), D), (_later(0.1), E)], 2),
    ("a relapse during the hold restarts it", "precise",
     [(_mixed(0, 5), D), (_mixed(5, 0), D), (_later(5), D), (_mixed(0, 5), D),
      (_mixed(5, 0), D), (_mixed(5, 0), D), (_later(9.9), D), (_later(0.1), E)], 2),
    ("auto: fallen back, cleared, it routes on the record until the hold ends", "auto",
     [(_mixed(0, 5), D), (_later(10), A), (_mixed(5, 0), A), (_later(9.9), A),
      (_later(0.1), E)], 3),
    ("definitive causes clear at once", "precise",
     [(lambda h, c: h.gap_opened("e0", "lost 3..4"), D), (lambda h, c: h.gap_closed("e0"), E)],
     2),
]


@pytest.mark.parametrize(("name", "policy", "steps", "changes"), HYSTERESIS,
                         ids=[h[0] for h in HYSTERESIS])
def test_index_state_hysteresis(name: str, policy: Policy, steps: list[tuple[Step, IndexState]],
                                changes: int, caplog: pytest.LogCaptureFixture) -> None:
    """Judged causes (prediction windows, silence) enter at ``agreement`` / ``silence_s`` but
    clear only at ``recover_agreement`` and after ``recover_hold_s`` clear: an engine whose
    evidence hovers at a threshold changes state once, not at every window or event."""
    health, clock = _health(policy)
    caplog.set_level(logging.WARNING, "kvgate.kv_index")
    for i, (step, expected) in enumerate(steps):
        step(health, clock)
        assert health.state("e0") is expected, (i, health.reason("e0"))
    moves = [line for line in _lines(caplog, "e0")
             if (m := re.search(r"engine e0 (\w+) -> (\w+):", line)) and m[1] != m[2]]
    assert len(moves) == changes, moves
    assert health.state("e1") is IndexState.EXACT
