"""docs/routing.md stays true: its default profile parses, and its worked example is what the
plugins compute (real session-affinity, token-load and imbalance-filter plugins; the prefix score
is the prefix-cache scorer's formula, device tokens / prompt tokens)."""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
import yaml

from middleware.config import parse_config
from middleware.plugin import Plugin, Scorer
from middleware.scheduler import Profile, Scheduler, WeightedScorer
from middleware.types import CycleState, Endpoint, EndpointId, InferenceRequest
from plugins.session_affinity import hrw_order, session_key
from plugins.state import PREFIX_MATCH, PrefixMatch
from plugins.token_load import Charge
from tests.unit.middleware.fakes import Best
from tests.unit.routing_load.helpers import (
    Lookup,
    fleet,
    imbalance_filter,
    load_scorer,
    req,
    session_scorer,
)

DOC = Path(__file__).resolve().parents[3] / "docs" / "routing.md"


def _default_profile() -> object:
    text = DOC.read_text()
    match = re.search(r"<!-- default-profile.*?-->\n```yaml\n(.*?)```", text, re.S)
    assert match, "docs/routing.md lost its default-profile block"
    return yaml.safe_load(match.group(1))


def test_default_profile_parses_with_documented_weights() -> None:
    config = parse_config(_default_profile(), "docs/routing.md")
    (profile,) = config.profiles
    weights = {ref.ref: ref.weight for ref in profile.plugins}
    assert weights == {
        "health-filter": None, "model-filter": None, "token-imbalance-filter": None,
        "prefix-cache-scorer": 3, "token-load-scorer": 2, "session-affinity-scorer": 1,
        "max-score-picker": None,
    }
    declared = [p.instance_name for p in config.plugins]
    assert declared.index("token-load-scorer") < declared.index("token-imbalance-filter")
    assert declared.index("tokenizer") < declared.index("prefix-cache-producer")


class PrefixFraction(Plugin, Scorer):
    type_name = "test-prefix"

    def score(self, req: InferenceRequest, state: CycleState, eps: Sequence[Endpoint]
              ) -> Mapping[EndpointId, float]:
        m = state.require(PREFIX_MATCH)
        return {e.id: m.device.get(e.id, 0) / m.prompt_tokens for e in eps}


def _session_with_order(order: list[str]) -> str:
    for i in itertools.count():
        s = f"conversation-{i}"
        if [e.id for e in hrw_order(session_key(None, "m", s), fleet(4))] == order:
            return s
    raise AssertionError("unreachable")


SYSTEM = 2048
#: (case, prompt, held per engine, in-flight work per engine, winner, documented totals)
EXAMPLES = [
    ("1 first turn", 2500, {}, {"e0": 6000, "e1": 2000, "e2": 10000, "e3": 4000}, "e2",
     {"e0": 4.06, "e1": 4.31, "e2": 4.82, "e3": 4.19}),
    ("2 turn six", 24000, {"e2": 23500}, {"e0": 6000, "e1": 2000, "e2": 11000, "e3": 4000}, "e2",
     {"e0": 0.55, "e1": 0.79, "e2": 5.24, "e3": 0.67}),
    ("3 turn six, e2 hot", 24000, {"e2": 23500},
     {"e0": 6000, "e1": 2000, "e2": 20000, "e3": 4000}, "e0",
     {"e0": 1.55, "e1": 0.79, "e3": 0.67}),
    ("4 side call", 8000, {"e1": 7000}, {"e0": 6000, "e1": 2000, "e2": 10000, "e3": 4000}, "e1",
     {"e0": 2.04, "e1": 4.44, "e2": 2.79, "e3": 2.16}),
]


@pytest.mark.parametrize(("case", "prompt", "held", "work", "winner", "totals"), EXAMPLES,
                         ids=[c[0] for c in EXAMPLES])
async def test_worked_example(case: str, prompt: int, held: dict[str, int],
                              work: dict[str, int], winner: str,
                              totals: dict[str, float]) -> None:
    session = _session_with_order(["e2", "e0", "e1", "e3"])
    sess = session_scorer()
    load = load_scorer()
    for engine, tokens in work.items():
        load.tracker.charge("x", [Charge(engine, tokens, 0)], now=0.0)
    guard = imbalance_filter(load, max_imbalance=1.25, slack_tokens=4096)
    prefix = PrefixFraction("prefix-cache-scorer", PrefixFraction.Params(), Lookup())
    scorers = (WeightedScorer("prefix", prefix, 3.0), WeightedScorer("load", load, 2.0),
               WeightedScorer("session", sess, 1.0))
    picker = Best("max-score-picker", Best.Params(), Lookup())
    scheduler = Scheduler({"p": Profile("p", (("guard", guard),), scorers, picker)}, None, 0)

    r = req({"x-session-affinity": session}, estimate=prompt)
    state = CycleState()
    await sess.on_request(r, state)
    device = {e.id: max(SYSTEM, held.get(e.id, 0)) for e in fleet(4)}
    state.put(PREFIX_MATCH, PrefixMatch(prompt, device, {}, precise=True))

    eps = guard.filter(r, state, fleet(4))
    computed = {e.id: 0.0 for e in eps}
    for ws in scorers:
        for engine, value in ws.scorer.score(r, state, eps).items():
            computed[engine] += ws.weight * value
    assert computed == pytest.approx(totals, abs=0.011)
    assert scheduler.schedule(r, state, fleet(4)).target.id == winner
