"""Steady state on real engines: ONE long-running router per system serves a sequence of agentic
workloads on the same two vLLM CPU engines, nothing reset between the workloads (issue 28).

    flock /tmp/kvgate-heavy.lock .venv/bin/python -m bench.kv_pressure --steady 5

``bench/kv_pressure.py`` starts every run on a fresh gateway over (effectively) empty caches, so
it cannot see what a gateway that has been up for a while does. Here, for each system, the
engines' prefix caches are reset (vLLM's ``POST /reset_prefix_cache``; the engines are started
with ``VLLM_SERVER_DEV_MODE=1`` for it), ONE gateway is started and the workloads of seeds
``seed, seed + 1, ...`` (each its own shared system + tool prompt, sub-agent prompts and
sessions: every session id is prefixed ``w<k>-``) run one after the other through it. Workload k
uses mode ``modes[k % len(modes)]`` (default: with ``x-session-affinity``, without, with, ...);
a system with one mode runs that mode throughout. Every system's sequence therefore starts
from the same state with the same warm-up workload (the first) and sees the same sequence.

Systems: those of :mod:`bench.agentic_systems` and ``pin-index``, a client-side reference with
no gateway: the k-th session of a workload goes straight to engine ``k mod engines``, its
sub-agents with it (the "sessions pinned by index" of the report).

Per workload and system: the share of the ideal cached tokens (:mod:`bench.agentic_ideal`), the
share of the workload's requests on its busiest engine (the ``x-kvgate-engine`` response header;
the engines' own request counters where a system sends none), the access log's ``placement``
and ``affinity`` kinds of that workload's requests (kvgate), kvgate's ``/health`` sections after
it, its ``kvgate_kv_predictions_total`` over it and its ``kvgate_placement_*`` series (each
engine's pressure as the placement sees it, decisions, pins) before and after it. The worst
cell from the second workload on is what the issue is about.
JSON: ``bench/results/kv_steady-<time>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
import urllib.error
import urllib.request
from collections import Counter as Tally
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from bench import agentic
from bench.agentic import Turn
from bench.agentic_client import Record, Runner
from bench.agentic_ideal import RunSummary, summarize
from bench.agentic_systems import (
    HEADERS,
    SYSTEMS,
    Fleet,
    counter_deltas,
    engine_counters,
    health,
    lookup,
    predictions,
    running,
)

PIN_INDEX = "pin-index"
DEFAULT_SYSTEMS = ("kvgate-default", "kvgate-precise", "random", PIN_INDEX)
NAMES = (*SYSTEMS, PIN_INDEX)
#: vLLM serves ``POST /reset_prefix_cache`` only in its dev mode (set when the engines start).
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
#: Access-log fields counted per workload (kv-placement-scorer, session-affinity-scorer).
LOG_KINDS = ("placement", "affinity")


# -- the workloads -------------------------------------------------------------------------
def _renamed_turns(turns: Sequence[Turn], tag: str) -> tuple[Turn, ...]:
    return tuple(t if t.spawn is None else replace(t, spawn=replace(t.spawn,
                 sid=tag + t.spawn.sid)) for t in turns)


def renamed(workload: agentic.Workload, tag: str) -> agentic.Workload:
    """``workload`` with every session id (agents and sub-agents) prefixed by ``tag``: the
    sessions of one workload are never those of another."""
    agents = tuple(replace(a, sid=tag + a.sid, turns=_renamed_turns(a.turns, tag))
                   for a in workload.agents)
    return replace(workload, agents=agents)


def sequence(seed: int, count: int, level: str, counter: agentic.Counter,
             spec: agentic.Level | None = None) -> list[agentic.Workload]:
    """``count`` workloads of seeds ``seed, seed + 1, ...``; the k-th's sessions ``w<k>-...``."""
    return [renamed(agentic.build(seed + k, level, counter, spec), f"w{k}-")
            for k in range(count)]


def mode_for(system: str, modes: Sequence[str], k: int) -> str:
    """Workload ``k``'s mode: ``modes`` in turn, or the system's only mode."""
    have = tuple(modes) if system == PIN_INDEX else lookup(system).modes
    want = modes[k % len(modes)]
    return want if want in have else have[0]


# -- pinning by index (client side) --------------------------------------------------------
@dataclass
class PinRunner(Runner):
    """Each main session straight to engine ``index mod engines`` (its order in the workload),
    a sub-agent with its parent; names the engine on each record as kvgate's header does."""

    urls: tuple[str, ...] = ()
    _index: dict[str, int] = field(default_factory=dict)

    def _engine(self, sid: str, parent: str | None) -> int:
        if not self._index:
            self._index = {a.sid: i for i, a in enumerate(self.workload.agents)}
        return self._index[parent or sid] % len(self.urls)

    def url_for(self, sid: str, parent: str | None) -> str:
        return self.urls[self._engine(sid, parent)]

    async def send(self, messages: Sequence[dict[str, str]], turn: Turn, sid: str,
                   parent: str | None, index: int) -> Record:
        rec = await super().send(messages, turn, sid, parent, index)
        rec.engine = rec.engine or f"engine-{self._engine(sid, parent)}"
        return rec


# -- what one workload showed --------------------------------------------------------------
def busiest(records: Sequence[Record],
            engines: Mapping[str, Mapping[str, float]]) -> tuple[str, float]:
    """The engine that served the most of the workload's requests and its share: from the
    records' ``x-kvgate-engine`` when every completed one has it, else the engines' counters."""
    ok = [r for r in records if r.ok]
    if ok and all(r.engine for r in ok):
        name, top = Tally(r.engine for r in ok).most_common(1)[0]
        return str(name), top / len(ok)
    served = {e: m.get("requests", 0.0) for e, m in engines.items()}
    total = sum(served.values())
    if not total:
        return "-", 0.0
    name = max(served, key=served.__getitem__)
    return name, served[name] / total


def log_kinds(lines: str) -> dict[str, dict[str, int]]:
    """Per :data:`LOG_KINDS` field, its values' counts over the access-log lines in ``lines``
    (the gateway's output: other lines are skipped)."""
    out: dict[str, Tally[str]] = {k: Tally() for k in LOG_KINDS}
    for line in lines.splitlines():
        if not line.startswith("{"):
            continue
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        for kind in LOG_KINDS:
            if isinstance(doc, dict) and doc.get(kind) is not None:
                out[kind][str(doc[kind])] += 1
    return {k: dict(v) for k, v in out.items()}


@dataclass(slots=True)
class LogCursor:
    """Reads what a growing log file gained since the last read."""

    path: Path | None
    offset: int = 0

    def read(self) -> str:
        if self.path is None or not self.path.exists():
            return ""
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        self.offset += len(data)
        return data.decode(errors="replace")


@dataclass(frozen=True, slots=True)
class Cell:
    """One workload of one system's sequence."""

    system: str
    workload: int
    seed: int
    mode: str
    summary: RunSummary
    busiest_engine: str
    busiest_share: float
    log: dict[str, dict[str, int]]
    predictions: dict[str, float]
    health: dict[str, Any]
    placement: dict[str, dict[str, float]]
    records: list[Record] = field(repr=False)


def placement_state(base: str) -> dict[str, float]:
    """kvgate's ``kvgate_placement_*`` series (``name{label}``: value; {} for other systems):
    each engine's pressure and capacity as the placement sees them, its decisions, pins."""
    if not base:
        return {}
    try:
        families = text_string_to_metric_families(_metrics(base))
        return {s.name + "".join(f"{{{v}}}" for v in s.labels.values()): s.value
                for f in families for s in f.samples if s.name.startswith("kvgate_placement_")}
    except (OSError, ValueError):
        return {}


def _metrics(base: str) -> str:
    with urllib.request.urlopen(base + "/metrics", timeout=10) as resp:
        body: bytes = resp.read()
        return body.decode()


def _delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


def _runner(system: str, base: str, workload: agentic.Workload, fleet: Fleet, salt: str,
            mode: str) -> Runner:
    sessions = mode == HEADERS
    if system == PIN_INDEX:
        return PinRunner(base, workload, fleet.model, salt, sessions, urls=fleet.urls)
    return Runner(base, workload, fleet.model, salt, sessions)


def serve(system: str, base: str, k: int, workload: agentic.Workload, mode: str, fleet: Fleet,
          salt: str, log: LogCursor) -> Cell:
    """Workload ``k`` through the running ``system`` (``base``: its URL, "" for pin-index)."""
    before = [engine_counters(u) for u in fleet.urls]
    checked, placed = (predictions(base), placement_state(base)) if base else ({}, {})
    log.read()  # what the gateway wrote before this workload (start-up, the previous one)
    started = time.monotonic()
    records = asyncio.run(_runner(system, base, workload, fleet, salt, mode).run())
    wall = time.monotonic() - started
    time.sleep(0.5)  # let the engines' counters and the gateway's access log settle
    after = [engine_counters(u) for u in fleet.urls]
    deltas = {f"engine-{i}": counter_deltas(b, a) for i, (b, a) in
              enumerate(zip(before, after, strict=True))}
    summary = summarize(system, workload.level, mode, records, deltas, wall)
    engine, share = busiest(records, deltas)
    status = {k: v for k, v in health(base).items() if k != "engines"} if base else {}
    return Cell(system, k, workload.seed, mode, summary, engine, share, log_kinds(log.read()),
                _delta(checked, predictions(base)) if base else {}, status,
                {"before": placed, "after": placement_state(base)}, records)


# -- a system's sequence -------------------------------------------------------------------
def reset_prefix_cache(url: str) -> bool | None:
    """One ``POST /reset_prefix_cache``: its ``success``, None where it is not served."""
    request = urllib.request.Request(url + "/reset_prefix_cache", b"", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            body = json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        if exc.code in (404, 405):
            return None
        raise
    return bool(body.get("success", True)) if isinstance(body, dict) else True


def reset_caches(fleet: Fleet, attempts: int = 10) -> bool:
    """Empty every engine's prefix cache; False where an engine does not serve the reset (not
    in dev mode): the system's own ``cache_salt`` then keeps earlier blocks from hitting."""
    for url in fleet.urls:
        for _ in range(attempts):
            done = reset_prefix_cache(url)
            if done is None:
                return False
            if done:
                break
            time.sleep(1.0)  # vLLM refuses while blocks are held (a request finishing)
        else:
            raise RuntimeError(f"{url} did not reset its prefix cache")
    return True


@contextlib.contextmanager
def gateway(system: str, fleet: Fleet, logs: Path, root: Path) -> Iterator[tuple[str, LogCursor]]:
    """The system running in front of ``fleet`` (nothing for pin-index): its URL and log."""
    if system == PIN_INDEX:
        yield "", LogCursor(None)
        return
    with running(lookup(system), fleet, logs, root) as base:
        yield base, LogCursor(logs / f"{system}.log")


def run_sequence(system: str, workloads: Sequence[agentic.Workload], modes: Sequence[str],
                 fleet: Fleet, salt: str, logs: Path, root: Path,
                 progress: Any = print) -> list[Cell]:
    """Reset the caches, start ``system`` once and serve ``workloads`` in order through it."""
    if not reset_caches(fleet):
        progress(f"kv_steady: engines' caches not reset ({DEV_MODE_ENV} unset); "
                 f"salt {salt} isolates this system")
    cells: list[Cell] = []
    with gateway(system, fleet, logs / system, root) as (base, log):
        for k, workload in enumerate(workloads):
            mode = mode_for(system, modes, k)
            cells.append(serve(system, base, k, workload, mode, fleet, salt, log))
            progress(f"kv_steady: {line(cells[-1])}")
    return cells


# -- report --------------------------------------------------------------------------------
def line(cell: Cell) -> str:
    share = cell.summary.share_of_ideal
    return (f"{cell.system} w{cell.workload} (seed {cell.seed}, {cell.mode}): share "
            f"{'-' if share is None else f'{share:.3f}'}, busiest {cell.busiest_engine} "
            f"{cell.busiest_share:.0%} of {cell.summary.requests}, failed "
            f"{cell.summary.failed}, log {cell.log}")


def worst(cells: Sequence[Cell], first: int = 1) -> tuple[float | None, float]:
    """From workload ``first`` on: the lowest share of the ideal and the highest busiest-engine
    share (each over the cells it is defined for)."""
    later = [c for c in cells if c.workload >= first]
    shares = [c.summary.share_of_ideal for c in later if c.summary.share_of_ideal is not None]
    return (min(shares) if shares else None,
            max((c.busiest_share for c in later), default=0.0))


def table(cells: Sequence[Cell], modes: Sequence[str]) -> str:
    """Rows: systems; columns: workloads; a cell: share of ideal / busiest engine's share."""
    count = 1 + max((c.workload for c in cells), default=-1)
    heads = [f"w{k} {modes[k % len(modes)]}" for k in range(count)]
    out = ["| system | " + " | ".join(heads) + " | worst from w1 |",
           "|---|" + "---|" * (count + 1)]
    for system in dict.fromkeys(c.system for c in cells):
        mine = {c.workload: c for c in cells if c.system == system}
        row = [_cell(mine.get(k)) for k in range(count)]
        low, top = worst(list(mine.values()))
        single = () if system == PIN_INDEX else lookup(system).modes
        name = f"{system} ({single[0]})" if len(single) == 1 else system
        out.append(f"| {name} | " + " | ".join(row)
                   + f" | {'-' if low is None else f'{low:.3f}'} / {top:.0%} |")
    return "\n".join(out)


def common_shares(cells: Sequence[Cell]) -> dict[tuple[str, int], float]:
    """(system, workload) -> cached tokens over the workload's *largest* ideal among the
    systems of the run. Each run's own ideal counts only the requests that completed before a
    request was sent, so it depends on the system's own speed (a faster system's requests
    overlap less: a larger ideal, a smaller share for the same cached tokens: up to 3 % apart
    between systems here); every system sent the same prompts, so one denominator per workload
    compares what they cached, not how fast they ran."""
    top: dict[int, int] = {}
    for c in cells:
        top[c.workload] = max(top.get(c.workload, 0), c.summary.ideal_tokens)
    return {(c.system, c.workload): c.summary.cached_tokens / top[c.workload]
            for c in cells if top[c.workload] > 0}


def common_table(cells: Sequence[Cell], modes: Sequence[str]) -> str:
    """As :func:`table`, the share over the workload's largest ideal (:func:`common_shares`)."""
    shares = common_shares(cells)
    count = 1 + max((c.workload for c in cells), default=-1)
    out = ["| system | " + " | ".join(f"w{k} {modes[k % len(modes)]}" for k in range(count))
           + " | worst from w1 |", "|---|" + "---|" * (count + 1)]
    for system in dict.fromkeys(c.system for c in cells):
        row = [shares.get((system, k)) for k in range(count)]
        later = [v for v in row[1:] if v is not None]
        low = f"{min(later):.3f}" if later else "-"
        out.append(f"| {system} | " + " | ".join("" if v is None else f"{v:.3f}" for v in row)
                   + f" | {low} |")
    return "\n".join(out)


def _cell(cell: Cell | None) -> str:
    if cell is None:
        return ""
    share = cell.summary.share_of_ideal
    return f"{'-' if share is None else f'{share:.3f}'} / {cell.busiest_share:.0%}"


def cell_doc(cell: Cell, compact: Any) -> dict[str, Any]:
    """A cell for the JSON: figures, access-log kinds, /health, predictions, every request."""
    doc = {k: v for k, v in asdict(cell).items() if k != "records"}
    return {**doc, "records": compact(cell.records)}


def run_steady(args: argparse.Namespace, fleet: Fleet, doc: dict[str, Any], out: Path,
               counter: agentic.Counter, compact: Any) -> list[Cell]:
    """Every system's sequence, level by level; the JSON rewritten after each system."""
    modes = args.modes.split(",")
    cells: list[Cell] = []
    path = out / f"kv_steady-{doc['stamp']}.json"
    for level in args.levels.split(","):
        workloads = sequence(args.seed, args.steady, level, counter)
        doc["workloads"][level] = [{"seed": w.seed, "slots": w.slots, "agents": len(w.agents),
                                    "requests": w.requests()} for w in workloads]
        mine: list[Cell] = []
        for system in args.systems.split(","):
            salt = f"kvs-{doc['stamp']}-{level}-{system}"
            print(f"kv_steady: {level} {system} ({args.steady} workloads) ...", flush=True)
            got = run_sequence(system, workloads, modes, fleet, salt,
                               out / "logs" / doc["stamp"] / level, args.venv_root)
            mine += got
            doc["runs"] += [cell_doc(c, compact) for c in got]
            path.write_text(json.dumps(doc, indent=1))
        print(f"\nsteady state, level {level} (share of ideal / busiest engine's share of "
              f"requests):\n{table(mine, modes)}\n\ncached tokens over the workload's largest "
              f"ideal among the systems:\n{common_table(mine, modes)}", flush=True)
        cells += mine
    print(f"wrote {path}", flush=True)
    return cells
