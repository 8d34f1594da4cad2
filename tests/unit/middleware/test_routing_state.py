"""The routing state kept across restarts (middleware/serving/routing_state.py) with the placement
scorer's snapshot: round trip, one file per fleet and profile, bad files skipped loudly, bounded."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest

from kvgate.middleware.framework.types import CycleState, Endpoint, RoutingDecision
from kvgate.middleware.serving.routing_state import MAX_FILES, RoutingStateFile, fleet_digest
from kvgate.plugins.common.state import SESSION_KEY
from kvgate.plugins.placement.scorer import KvPlacementScorer
from tests.unit.routing_load.helpers import req

ENGINES = [("e0", "http://127.0.0.1:9000"), ("e1", "http://127.0.0.1:9001")]


class _NoLookup:
    def lookup(self, name: str) -> object:
        raise KeyError(name)


def _scorer(**params: object) -> KvPlacementScorer:
    return KvPlacementScorer("placement", KvPlacementScorer.Params.model_validate(params),
                             _NoLookup())


def _route(scorer: KvPlacementScorer, session: str, engine: str) -> None:
    state = CycleState()
    state.put(SESSION_KEY, session)
    target = Endpoint(id=engine, url=f"http://{engine}", kind="vllm")
    asyncio.run(scorer.before_dispatch(req(), state, RoutingDecision(target=target)))


def _file(tmp: Path, scorer: KvPlacementScorer,
          engines: list[tuple[str, str]] = ENGINES) -> RoutingStateFile:
    return RoutingStateFile(tmp, engines, {"placement": scorer}, save_s=30.0)


def test_pins_and_pressure_survive_a_restart(tmp_path: Path) -> None:
    before = _scorer()
    for i in range(10):
        _route(before, f"s{i}", f"e{i % 2}")
    _file(tmp_path, before).save()
    after = _scorer()
    state = _file(tmp_path, after)
    state.restore()
    assert after.pins.entries == before.pins.entries
    assert list(after.pins.entries) == list(before.pins.entries)  # LRU order kept
    half_life = 1_000_000.0
    for engine in ("e0", "e1"):
        assert after.ledger.value(engine, half_life) == pytest.approx(
            before.ledger.value(engine, half_life))
    assert state.health()["status"] == "restored"
    assert state.stats.restored == {"placement": 10 + 2}


@pytest.mark.parametrize("engines", [
    [("e0", "http://127.0.0.1:9000"), ("e1", "http://127.0.0.1:9002")],  # another URL
    [("e0", "http://127.0.0.1:9000")],  # an engine fewer
])
def test_another_fleet_starts_fresh(tmp_path: Path, engines: list[tuple[str, str]]) -> None:
    before = _scorer()
    _route(before, "s", "e0")
    _file(tmp_path, before).save()
    after = _scorer()
    state = _file(tmp_path, after, engines)
    state.restore()
    assert not after.pins.entries
    assert state.stats.status == "fresh"


def test_another_profile_starts_fresh() -> None:
    assert fleet_digest(ENGINES, ["placement:kv-placement-scorer"]) != fleet_digest(
        ENGINES, ["placement:kv-placement-scorer", "affinity:session-affinity-scorer"])
    assert fleet_digest(ENGINES, ["a:x"]) == fleet_digest(list(reversed(ENGINES)), ["a:x"])


@pytest.mark.parametrize("content", [
    b"not json",
    b'{"format": 99, "plugins": {}}',
    b'["a list"]',
])
def test_unreadable_file_is_skipped_with_a_warning(
    tmp_path: Path, content: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    scorer = _scorer()
    state = _file(tmp_path, scorer)
    state.path.parent.mkdir(parents=True, exist_ok=True)
    state.path.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="kvgate.routing_state"):
        state.restore()
    assert state.health()["status"] == "unreadable"
    assert state.stats.load_failures == 1
    assert "routing starts with fresh state" in caplog.text
    assert not scorer.pins.entries


def test_malformed_plugin_part_leaves_that_plugin_fresh(tmp_path: Path) -> None:
    scorer = _scorer()
    state = _file(tmp_path, scorer)
    state.path.parent.mkdir(parents=True, exist_ok=True)
    state.path.write_text(json.dumps({"format": 1, "fleet": state.digest,
                                      "plugins": {"placement": {"pins": "oops"}}}))
    state.restore()
    assert state.stats.load_failures == 1
    assert "placement" not in state.stats.restored
    assert not scorer.pins.entries


def test_restore_keeps_the_most_recent_pins_up_to_max_sessions(tmp_path: Path) -> None:
    before = _scorer()
    for i in range(20):
        _route(before, f"s{i}", "e0")
    _file(tmp_path, before).save()
    after = _scorer(max_sessions=5)
    _file(tmp_path, after).restore()
    assert list(after.pins.entries) == [f"s{i}" for i in range(15, 20)]


def test_failed_save_is_counted_and_does_not_raise(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("a file where the directory should be")
    state = _file(blocker / "dir", _scorer())
    state.save()
    assert state.stats.save_failures == 1 and state.stats.saves == 0


def test_directory_keeps_at_most_max_files(tmp_path: Path) -> None:
    for i in range(MAX_FILES + 3):
        _file(tmp_path, _scorer(), [("e0", f"http://127.0.0.1:{10_000 + i}")]).save()
    assert len(list(tmp_path.glob("*.json"))) == MAX_FILES


def test_periodic_save_and_last_save_at_stop(tmp_path: Path) -> None:
    async def run() -> RoutingStateFile:
        scorer = _scorer()
        state = RoutingStateFile(tmp_path, ENGINES, {"placement": scorer}, save_s=0.05)
        state.start()
        _route_in_loop(scorer, "early", "e1")
        await asyncio.sleep(0.3)
        periodic = state.stats.saves
        _route_in_loop(scorer, "late", "e0")
        await state.stop()
        assert periodic >= 1 and state.stats.saves == periodic + 1
        return state

    state = asyncio.run(run())
    doc = json.loads(state.path.read_text())
    assert doc["plugins"]["placement"]["pins"] == [["early", "e1", 100], ["late", "e0", 100]]


def _route_in_loop(scorer: KvPlacementScorer, session: str, engine: str) -> None:
    scorer.pins.pin(session, engine, 100)
