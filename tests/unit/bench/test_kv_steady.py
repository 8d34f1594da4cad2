"""The steady-state harness's pure parts (bench/kv_steady.py): workloads, modes, pinning by
index, the busiest engine, the access log's kinds and the report."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from bench import agentic
from bench.agentic_client import Record
from bench.agentic_ideal import summarize
from bench.kv_steady import (
    PIN_INDEX,
    Cell,
    LogCursor,
    PinRunner,
    busiest,
    common_shares,
    common_table,
    log_kinds,
    mode_for,
    sequence,
    table,
    worst,
)

SMALL = agentic.Level(slots=2, agents=3)


def count(text: str) -> int:
    return -(-len(text) // 4)


def _sids(workload: agentic.Workload) -> set[str]:
    out = {a.sid for a in workload.agents}
    out |= {t.spawn.sid for a in workload.agents for t in a.turns if t.spawn is not None}
    return out


def test_sequence_workloads_have_their_own_seeds_prompts_and_sessions() -> None:
    workloads = sequence(4, 3, "low", count, SMALL)
    assert [w.seed for w in workloads] == [4, 5, 6]
    assert len({w.shared_prompt for w in workloads}) == 3
    for k, w in enumerate(workloads):
        assert all(sid.startswith(f"w{k}-") for sid in _sids(w))
        plain = agentic.build(4 + k, "low", count, SMALL)
        assert [len(a.turns) for a in w.agents] == [len(a.turns) for a in plain.agents]
    assert not _sids(workloads[0]) & _sids(workloads[1])


def test_modes_alternate_unless_the_system_has_one() -> None:
    modes = ("headers", "no-headers")
    assert [mode_for("kvgate-default", modes, k) for k in range(3)] == \
        ["headers", "no-headers", "headers"]
    assert {mode_for("random", modes, k) for k in range(3)} == {"no-headers"}
    assert {mode_for("session-pin", modes, k) for k in range(3)} == {"headers"}
    assert mode_for(PIN_INDEX, modes, 1) == "no-headers"


def test_pin_index_sends_a_session_and_its_sub_agents_to_index_mod_engines() -> None:
    workload = sequence(0, 1, "low", count, SMALL)[0]
    runner = PinRunner("", workload, "m", "salt", False, urls=("http://a", "http://b"))
    first, second, third = (a.sid for a in workload.agents)
    assert [runner.url_for(s, None) for s in (first, second, third)] == \
        ["http://a", "http://b", "http://a"]
    assert runner.url_for(f"{second}.sub-0", second) == "http://b"


def _record(i: int, engine: str | None, ok: bool = True) -> Record:
    return Record(i, f"s{i}", None, 0, float(i), float(i) + 0.5 if ok else None,
                  200 if ok else 0, None if ok else "boom", engine=engine)


def test_busiest_from_headers_else_from_engine_counters() -> None:
    recs = [_record(0, "engine-1"), _record(1, "engine-1"), _record(2, "engine-0"),
            _record(3, None, ok=False)]
    assert busiest(recs, {}) == ("engine-1", 2 / 3)
    counters = {"engine-0": {"requests": 1.0}, "engine-1": {"requests": 3.0}}
    assert busiest([_record(0, None)], counters) == ("engine-1", 0.75)
    assert busiest([], {}) == ("-", 0.0)


def test_log_kinds_counts_access_lines_only(tmp_path: Path) -> None:
    path = tmp_path / "gw.log"
    lines = [json.dumps({"placement": "home", "affinity": "pinned"}),
             json.dumps({"placement": "cold"}), "INFO some startup line", "{not json",
             json.dumps({"placement": "home", "affinity": None})]
    path.write_text("\n".join(lines[:2]) + "\n")
    cursor = LogCursor(path)
    assert log_kinds(cursor.read()) == {"placement": {"home": 1, "cold": 1},
                                        "affinity": {"pinned": 1}}
    with path.open("a") as f:
        f.write("\n".join(lines[2:]) + "\n")
    assert log_kinds(cursor.read()) == {"placement": {"home": 1}, "affinity": {}}
    assert LogCursor(None).read() == ""


def _cell(system: str, k: int, cached: int, top: float) -> Cell:
    rec = Record(0, "s", None, 0, 0.0, 1.0, 200, engine="engine-0", cached_tokens=cached,
                 prompt_ids=tuple(range(300)))
    summary = summarize(system, "low", "headers", [rec], {}, 1.0)
    return Cell(system, k, k, "headers", summary, "engine-0", top, {}, {}, {}, {}, [rec])


def test_worst_is_from_the_second_workload_on_and_the_table_shows_it() -> None:
    cells = [_cell("kvgate-default", 0, 0, 0.9), _cell("kvgate-default", 1, 128, 0.6),
             _cell("kvgate-default", 2, 256, 0.7)]
    # a lone request has no ideal (nothing completed before it): share None, busiest counted
    assert worst(cells) == (None, 0.7)
    text = table(cells, ("headers", "no-headers"))
    assert text.splitlines()[0].startswith("| system | w0 headers | w1 no-headers | w2 headers")
    assert text.splitlines()[2].endswith("| - / 70% |")


@pytest.mark.parametrize(("ideals", "cached", "expected"), [
    # the slower system's own ideal is smaller: the same cached tokens, one denominator
    ((1000, 1030), (900, 900), (0.874, 0.874)),
    ((1000, 1000), (950, 900), (0.95, 0.9)),
])
def test_common_shares_divide_by_the_workloads_largest_ideal(
        ideals: tuple[int, int], cached: tuple[int, int], expected: tuple[float, float]) -> None:
    cells = []
    for system, ideal, got in zip(("a", "b"), ideals, cached, strict=True):
        base = _cell(system, 1, got, 0.5)
        cells.append(replace(base, summary=replace(base.summary, ideal_tokens=ideal,
                                                   cached_tokens=got)))
    shares = common_shares(cells)
    assert [round(shares[(c.system, 1)], 3) for c in cells] == list(expected)
    text = common_table(cells, ("headers",))
    assert text.splitlines()[2] == f"| a |  | {expected[0]:.3f} | {expected[0]:.3f} |"


def test_kv_pressure_steady_flag_defaults() -> None:
    from bench.kv_pressure import parse_args
    from bench.kv_steady import DEFAULT_SYSTEMS

    steady = parse_args(["--steady", "3"])
    assert steady.systems == ",".join(DEFAULT_SYSTEMS) and steady.levels == "low"
    assert parse_args([]).levels == "low,high"
    with pytest.raises(SystemExit):
        parse_args(["--systems", PIN_INDEX])
