"""Fault state: counters consumed per request, merge semantics, clear."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from kvgate.engines.sim.core.faults import FaultSpec, FaultState


@pytest.mark.parametrize(("spec", "statuses"), [
    ({"fail_next": 2}, [503, 503, None]),
    ({"fail_next": 1, "status": 429}, [429, None, None]),
    ({"fail_next": 0}, [None]),
])
def test_fail_next(spec: dict[str, Any], statuses: list[int | None]) -> None:
    state = FaultState()
    state.apply(FaultSpec.model_validate(spec))
    assert [state.take_failure() for _ in statuses] == statuses


@pytest.mark.parametrize(("spec", "drops"), [
    ({"drop_after_chunks": 3}, [3, None]),
    ({"drop_after_chunks": 0, "drop_streams": 2}, [0, 0, None]),
    ({"drop_streams": 2}, [None]),
])
def test_drop(spec: dict[str, Any], drops: list[int | None]) -> None:
    state = FaultState()
    state.apply(FaultSpec.model_validate(spec))
    assert [state.take_drop() for _ in drops] == drops


def test_apply_merges_and_clear_resets() -> None:
    state = FaultState()
    state.apply(FaultSpec(health=False))
    state.apply(FaultSpec(delay_first_byte_s=0.5))
    assert (state.health, state.delay_first_byte_s) == (False, 0.5)
    state.clear()
    assert state == FaultState()


@pytest.mark.parametrize("body", [{"fail_next": -1}, {"status": 200}, {"nope": 1},
                                  {"delay_first_byte_s": -2}])
def test_bad_specs(body: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        FaultSpec.model_validate(body)
