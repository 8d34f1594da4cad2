"""Session affinity scorer: header precedence and validation, scoping, rendezvous hashing
determinism across replicas, bounded-load and health fallbacks, evenness."""

from __future__ import annotations

import collections
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from kvgate.middleware.framework.errors import BadRequest
from kvgate.middleware.framework.types import RESPONSE_HEADERS, CycleState, Endpoint
from kvgate.plugins.common.state import SESSION_KEY
from kvgate.plugins.load.session_affinity import (
    DEFAULT_HEADERS,
    SessionAffinityScorer,
    hrw_order,
    hrw_weight,
    session_key,
)
from tests.unit.routing_load.helpers import ep, fleet, req, session_scorer

SES = "ses_f84c6ba38ffe6UeTRaX25G3KTr"


async def _state(
    scorer: SessionAffinityScorer, headers: dict[str, str], **kw: Any
) -> CycleState:
    state = CycleState()
    await scorer.on_request(req(headers, **kw), state)
    return state


async def _choice(scorer: SessionAffinityScorer, session: str, eps: list[Endpoint]) -> str | None:
    state = await _state(scorer, {"x-session-affinity": session})
    scores = scorer.score(req(), state, eps)
    best = [k for k, v in scores.items() if v == 1.0]
    return best[0] if best else None


# -- headers -----------------------------------------------------------------------------------

PRECEDENCE = [
    ("none", {}, None, None),
    ("affinity", {"x-session-affinity": "a"}, None, ("x-session-affinity", "a")),
    ("session-id", {"x-session-id": "b"}, None, ("x-session-id", "b")),
    ("dynamo", {"x-dynamo-session-id": "c"}, None, ("x-dynamo-session-id", "c")),
    ("claude", {"x-claude-code-session-id": "d"}, None, ("x-claude-code-session-id", "d")),
    ("smg", {"x-smg-routing-key": "e"}, None, ("x-smg-routing-key", "e")),
    ("codex", {"session-id": "c"}, None, ("session-id", "c")),
    ("smg beats codex", {"session-id": "c", "x-smg-routing-key": "e"}, None,
     ("x-smg-routing-key", "e")),
    ("affinity beats session-id", {"x-session-id": "b", "x-session-affinity": "a"}, None,
     ("x-session-affinity", "a")),
    ("session-id beats smg", {"x-smg-routing-key": "e", "x-session-id": "b"}, None,
     ("x-session-id", "b")),
    ("empty value is absent", {"x-session-affinity": "", "x-session-id": "b"}, None,
     ("x-session-id", "b")),
    ("blank value is absent", {"x-session-affinity": "   "}, None, None),
    ("surrounding space trimmed", {"x-session-id": "  b "}, None, ("x-session-id", "b")),
    ("unlisted header ignored", {"x-parent-session-id": "p"}, None, None),
    ("configured order", {"x-session-affinity": "a", "x-smg-routing-key": "e"},
     ["x-smg-routing-key", "x-session-affinity"], ("x-smg-routing-key", "e")),
    ("configured subset", {"x-session-affinity": "a"}, ["x-session-id"], None),
    ("configured names are case-insensitive", {"x-my-session": "z"}, ["X-My-Session"],
     ("x-my-session", "z")),
]


@pytest.mark.parametrize(("case", "headers", "names", "expected"), PRECEDENCE,
                         ids=[c[0] for c in PRECEDENCE])
async def test_header_precedence(case: str, headers: dict[str, str], names: list[str] | None,
                                 expected: tuple[str, str] | None) -> None:
    scorer = session_scorer(**({} if names is None else {"headers": names}))
    state = await _state(scorer, headers, tenant="t1")
    if expected is None:
        assert SESSION_KEY not in state
        assert RESPONSE_HEADERS not in state
        return
    header, value = expected
    assert state.get(SESSION_KEY) == session_key("t1", "m", value)
    assert state.get(RESPONSE_HEADERS) == {header: value}


VALIDATION = [
    ("opencode id", SES, True),
    ("uuid", "3f2b8c1e-9a4d-4e2f-8b1a-0c9d8e7f6a5b", True),
    ("inner space", "a b", True),
    ("256 chars", "x" * 256, True),
    ("257 chars", "x" * 257, False),
    ("control char", "a\x01b", False),
    ("tab", "a\tb", False),
    ("DEL", "a\x7f", False),
    ("non-ascii", "sessión", False),
    ("latin-1 decoded utf-8", "caf\xc3\xa9", False),
]


@pytest.mark.parametrize(("case", "value", "ok"), VALIDATION, ids=[c[0] for c in VALIDATION])
async def test_header_value_validation(case: str, value: str, ok: bool) -> None:
    scorer = session_scorer()
    if ok:
        state = await _state(scorer, {"x-session-id": value})
        assert state.get(SESSION_KEY) == session_key(None, "m", value)
        return
    with pytest.raises(BadRequest) as info:
        await _state(scorer, {"x-session-id": value})
    assert info.value.status == 400
    assert info.value.param == "x-session-id"
    assert scorer.stats.rejected == 1


async def test_max_length_is_configurable() -> None:
    scorer = session_scorer(max_length=8)
    await _state(scorer, {"x-session-id": "12345678"})
    with pytest.raises(BadRequest):
        await _state(scorer, {"x-session-id": "123456789"})


async def test_echo_can_be_disabled() -> None:
    state = await _state(session_scorer(echo=False), {"x-session-affinity": SES})
    assert SESSION_KEY in state
    assert RESPONSE_HEADERS not in state


SCOPES = [
    ("same everything", ("t", "m", "s"), ("t", "m", "s"), True),
    ("other tenant", ("t", "m", "s"), ("u", "m", "s"), False),
    ("other model", ("t", "m", "s"), ("t", "m2", "s"), False),
    ("other session", ("t", "m", "s"), ("t", "m", "s2"), False),
    ("no tenant is '-'", (None, "m", "s"), ("-", "m", "s"), True),
    ("no ambiguity from separators", ("a,b", "m", "s"), ("a", "b,m", "s"), False),
]


@pytest.mark.parametrize(("case", "a", "b", "same"), SCOPES, ids=[c[0] for c in SCOPES])
def test_session_key_scope(case: str, a: tuple[str | None, str, str],
                           b: tuple[str | None, str, str], same: bool) -> None:
    assert (session_key(*a) == session_key(*b)) is same


async def test_prepare_rekeys_when_tenant_set_later() -> None:
    scorer = session_scorer()
    r = req({"x-session-id": "s"})
    state = CycleState()
    await scorer.on_request(r, state)
    assert state.get(SESSION_KEY) == session_key(None, "m", "s")
    r.tenant = "acme"  # an auth hook declared after the session plugin
    await scorer.prepare(r, state, fleet(2))
    assert state.get(SESSION_KEY) == session_key("acme", "m", "s")


def test_params_validation() -> None:
    p = SessionAffinityScorer.Params.model_validate({"headers": ["X-Session-ID"]})
    assert p.headers == ("x-session-id",)
    assert SessionAffinityScorer.Params().headers == DEFAULT_HEADERS
    bad: list[dict[str, Any]] = [
        {"headers": []},
        {"headers": ["x session"]},
        {"headers": ["x-a", "X-A"]},
        {"load_factor": 0.9},
        {"decay": 1.0},
        {"unknown": 1},
        {"ttl_s": 0},
    ]
    for params in bad:
        with pytest.raises(ValidationError):
            SessionAffinityScorer.Params.model_validate(params)
    SessionAffinityScorer.Params.model_validate(SessionAffinityScorer.example_params)


def test_redis_url_is_secret() -> None:
    p = SessionAffinityScorer.Params.model_validate({"redis_url": "redis://:hunter2@h:6379/0"})
    assert "hunter2" not in repr(p)
    assert "hunter2" not in str(p)


# -- rendezvous hashing ------------------------------------------------------------------------


async def test_replicas_agree_without_shared_state() -> None:
    """Two independently built scorers (two gateway replicas) choose the same engine, whatever
    order the endpoint snapshot lists engines in."""
    eps = fleet(6)
    shuffled = list(eps)
    random.Random(3).shuffle(shuffled)
    a, b = session_scorer(), session_scorer()
    for i in range(300):
        s = f"session-{i}"
        assert await _choice(a, s, eps) == await _choice(b, s, shuffled)


def test_hash_is_stable_across_processes() -> None:
    """A separate interpreter with another PYTHONHASHSEED computes the same HRW order."""
    keys = [session_key("t", "m", f"s{i}") for i in range(50)]
    ids = [f"e{i}" for i in range(5)]
    here = [hrw_order(k, [ep(i) for i in ids])[0].id for k in keys]
    code = (
        "import json,sys\n"
        "from kvgate.middleware.framework.types import Endpoint\n"
        "from kvgate.plugins.load.session_affinity import hrw_order\n"
        "keys, ids = json.load(sys.stdin)\n"
        "eps = [Endpoint(id=i, url='http://' + i, kind='vllm') for i in ids]\n"
        "print(json.dumps([hrw_order(k, eps)[0].id for k in keys]))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], input=json.dumps([keys, ids]), capture_output=True,
        text=True, check=True, env=env, timeout=60, cwd=Path(__file__).resolve().parents[3],
    )
    assert json.loads(out.stdout) == here


def test_hash_golden_values() -> None:
    """Pins the hash (64-bit BLAKE2b of key NUL id, big-endian): changing it reshuffles every
    session of a fleet during a rolling upgrade, so it must be deliberate."""
    assert hrw_weight("k", "e0") == 9893143973634057498
    assert hrw_weight(session_key("t", "m", "s"), "engine-a") == 1538195428242336356


def test_removing_an_engine_moves_only_its_sessions() -> None:
    eps = fleet(8)
    without = [e for e in eps if e.id != "e3"]
    moved = kept = 0
    for i in range(2000):
        key = session_key("t", "m", f"s{i}")
        before = hrw_order(key, eps)[0].id
        after = hrw_order(key, without)[0].id
        if before == "e3":
            moved += 1
        else:
            assert after == before
            kept += 1
    assert moved > 0 and kept > 0


async def test_distribution_is_even() -> None:
    rng = random.Random(20261122)
    eps = fleet(8)
    scorer = session_scorer()
    counts: collections.Counter[str] = collections.Counter()
    n = 16000
    for _ in range(n):
        session = "ses_" + "".join(rng.choices("abcdefghijklmnopqrstuvwxyz0123456789", k=24))
        choice = await _choice(scorer, session, eps)
        assert choice is not None
        counts[choice] += 1
    expected = n / len(eps)
    assert set(counts) == {e.id for e in eps}
    for engine, count in counts.items():
        assert abs(count - expected) / expected < 0.06, (engine, count)


# -- soft affinity: load and health ------------------------------------------------------------

#: (case, in-flight requests by HRW rank, healthy by rank, params, expected chosen rank)
FALLBACKS: list[tuple[str, list[int], list[bool], dict[str, Any], int | None]] = [
    ("idle fleet: first choice", [0, 0, 0, 0], [True] * 4, {}, 0),
    ("first within bound", [4, 2, 2, 2], [True] * 4, {}, 0),  # bound 1.25*2.5+2 = 5.1
    ("first over bound", [10, 0, 0, 0], [True] * 4, {}, 1),  # bound 1.25*2.5+2 = 5.1
    ("first two over bound", [12, 12, 0, 0], [True] * 4, {}, 2),  # bound 9.5
    ("at the bound is kept", [3, 3, 3, 3], [True] * 4, {"load_factor": 1.0, "load_slack": 0}, 0),
    ("tight bound", [4, 3, 3, 2], [True] * 4, {"load_factor": 1.0, "load_slack": 0}, 1),
    ("slack absorbs small fleets", [2, 0, 0, 0], [True] * 4, {}, 0),  # bound 2.6
    ("unhealthy first", [0, 0, 0, 0], [False, True, True, True], {}, 1),
    ("unhealthy first two", [0, 0, 0, 0], [False, False, True, True], {}, 2),
    ("unhealthy load not in mean", [0, 9, 0, 0], [False, True, True, True], {}, 2),
    ("all unhealthy", [0, 0, 0, 0], [False] * 4, {}, None),
]


@pytest.mark.parametrize(("case", "loads", "healthy", "params", "expected"), FALLBACKS,
                         ids=[c[0] for c in FALLBACKS])
async def test_soft_affinity_fallback(case: str, loads: list[int], healthy: list[bool],
                                      params: dict[str, Any], expected: int | None) -> None:
    scorer = session_scorer(**params)
    key = session_key(None, "m", SES)
    ranked = [e.id for e in hrw_order(key, fleet(4))]
    eps = [ep(name, in_flight=loads[r], healthy=healthy[r]) for r, name in enumerate(ranked)]
    choice = await _choice(scorer, SES, eps)
    assert choice == (None if expected is None else ranked[expected])


async def test_filtered_out_engine_falls_to_next_in_hrw_order() -> None:
    scorer = session_scorer()
    ranked = [e.id for e in hrw_order(session_key(None, "m", SES), fleet(5))]
    remaining = [ep(name) for name in ranked if name != ranked[0]]
    assert await _choice(scorer, SES, remaining) == ranked[1]


async def test_decay_scores_the_next_choices() -> None:
    scorer = session_scorer(decay=0.5)
    ranked = [e.id for e in hrw_order(session_key(None, "m", SES), fleet(4))]
    eps = [ep(ranked[0], in_flight=20), *(ep(n) for n in ranked[1:])]
    state = await _state(scorer, {"x-session-affinity": SES})
    scores = scorer.score(req(), state, eps)
    assert scores == {ranked[1]: 1.0, ranked[2]: 0.5, ranked[3]: 0.25}


async def test_no_session_scores_nothing() -> None:
    scorer = session_scorer()
    state = await _state(scorer, {})
    assert scorer.score(req(), state, fleet(3)) == {}
