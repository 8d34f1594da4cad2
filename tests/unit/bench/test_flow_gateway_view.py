"""bench.flow_control.gateway_view: the gateway's part of a tenant's TTFT from access logs."""

from __future__ import annotations

import json
from pathlib import Path

from bench.flow_control import gateway_view


def test_gateway_view_reads_the_tenants_lines_since_a_time(tmp_path: Path) -> None:
    lines = [
        {"tenant": "B", "ts": 110.0, "total_s": 1.0, "ttfb_s": 0.05, "flow_wait_ms": 2.0,
         "placement": "home"},
        {"tenant": "B", "ts": 120.0, "total_s": 1.0, "ttfb_s": 0.30, "flow_wait_ms": 250.0,
         "placement": "moved"},
        {"tenant": "B", "ts": 99.0, "total_s": 1.0, "ttfb_s": 9.0},  # started before `since`
        {"tenant": "A", "ts": 120.0, "total_s": 1.0, "ttfb_s": 5.0, "flow_wait_ms": 9e3},
    ]
    text = "\n".join(["INFO not json", *(json.dumps(x) for x in lines)])
    (tmp_path / "kvgate-0.log").write_text(text)
    view = gateway_view(tmp_path, "B", 100.0)
    assert view["n"] == 2 and view["moved"] == 1
    assert view["ttfb_ms"]["max"] == 300.0 and view["flow_wait_ms"]["p50"] == 250.0
    assert gateway_view(tmp_path, "C", 0.0) == {
        "n": 0, "ttfb_ms": {"p50": None, "p99": None, "max": None},
        "flow_wait_ms": {"p50": None, "p99": None, "max": None}, "moved": 0}
