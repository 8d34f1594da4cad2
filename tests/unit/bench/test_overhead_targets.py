"""bench/overhead.py's issue-12 item-5 checks: per-core shares vs vllm-router at 1 KiB and the
large size, and saturation of the large open-loop cell, from a medians table."""

from __future__ import annotations

from typing import Any

import pytest

from bench import overhead
from bench.harness import Medians

LARGE = 200 * 1024


def _medians(kv_small: float, kv_large: float, open_rps: float, errors: float) -> Medians:
    return {
        "kvgate": {
            "json 1KiB closed": {"rps": kv_small, "cpu_us_per_req": 1e6 / kv_small},
            "json 200KiB closed": {"rps": kv_large, "cpu_us_per_req": 1e6 / kv_large},
            "json 200KiB open": {"rps": open_rps, "errors": errors, "p50_ms": 1.0},
        },
        "vllm-router": {
            "json 1KiB closed": {"rps": 6000.0, "cpu_us_per_req": 1e6 / 6000},
            "json 200KiB closed": {"rps": 2000.0, "cpu_us_per_req": 1e6 / 2000},
        },
    }


@pytest.mark.parametrize(("small", "large", "open_rps", "errors", "expect"), [
    (1800.0, 1000.0, 1000.0, 0.0, (True, True, True)),
    (1700.0, 999.0, 949.0, 0.0, (False, False, False)),
    (3000.0, 1500.0, 1000.0, 3.0, (True, True, False)),
])
def test_shares_and_saturation(small: float, large: float, open_rps: float, errors: float,
                               expect: tuple[bool, bool, bool]) -> None:
    checks: dict[str, Any] = overhead.per_core_targets(
        _medians(small, large, open_rps, errors), LARGE, 1000.0)
    got = (checks["json 1KiB closed"]["pass"], checks["json 200KiB closed"]["pass"],
           checks["json 200KiB open"]["unsaturated"])
    assert got == expect
    assert checks["json 1KiB closed"]["share_by_cpu"] == pytest.approx(small / 6000)
    text = overhead.per_core_text(checks)
    assert text.count("\n") == 2 and "json 200KiB open" in text


def test_unmeasured_cells_are_not_judged() -> None:
    checks = overhead.per_core_targets({}, LARGE, 1000.0)
    assert checks["json 1KiB closed"]["pass"] is None
    assert checks["json 200KiB open"]["unsaturated"] is None
    assert "n/a" in overhead.per_core_text(checks)


def test_no_large_judges_1_kib_against_its_own_target() -> None:
    # ``--no-large``: the largest size measured is 1 KiB; its need stays 0.3, not the large 0.5
    checks = overhead.per_core_targets(_medians(1900.0, 1000.0, 1000.0, 0.0), 1024, 1000.0)
    assert checks["json 1KiB closed"]["need"] == 0.3
    assert checks["json 1KiB closed"]["pass"] is True
    assert set(checks) == {"json 1KiB closed", "json 1KiB open"}
