"""Pickers: order scored endpoints best first (first = target, rest = retry order)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from pydantic import BaseModel

from kvgate.middleware.framework.errors import NoEndpointAvailable
from kvgate.middleware.framework.plugin import Picker, Plugin, PluginLookup
from kvgate.middleware.framework.types import CycleState, ProfileResult, ScoredEndpoint


def _require(scored: Sequence[ScoredEndpoint]) -> None:
    if not scored:
        raise NoEndpointAvailable("no engine left to pick from")


class MaxScorePicker(Plugin, Picker):
    """``max-score-picker``: highest total score first.

    Ties are broken by the scheduler's seeded RNG (a random key per endpoint), so equal engines
    share load instead of the first one in config order taking everything, and the same seed
    gives the same routing. No params.
    """

    type_name = "max-score-picker"

    def pick(
        self, state: CycleState, scored: Sequence[ScoredEndpoint], rng: random.Random
    ) -> ProfileResult:
        _require(scored)
        # (score, draw, position): ties in both keep the input order, as a stable sort by
        # (score, draw) would; sorted on tuples alone, with no key call per endpoint
        keyed = sorted([(-s.score, rng.random(), i) for i, s in enumerate(scored)])
        return ProfileResult(tuple([scored[t[2]].endpoint for t in keyed]))


class WeightedRandomPicker(Plugin, Picker):
    """``weighted-random-picker``: draws without replacement, probability ∝ score.

    Algorithm: Efraimidis-Spirakis keys ``u ** (1 / w)`` sorted descending, which is an exact
    weighted draw without replacement in one pass. Endpoints scoring 0 get a floor weight of
    1e-6 (relative to the scores' scale): they are drawn only after every positive one, so a
    zero score still leaves them as retry fallbacks. All-zero scores → uniform order. No params.
    """

    type_name = "weighted-random-picker"
    #: Weight of a zero score: small enough to never compete with a real score in practice.
    FLOOR = 1e-6

    def pick(
        self, state: CycleState, scored: Sequence[ScoredEndpoint], rng: random.Random
    ) -> ProfileResult:
        _require(scored)
        keyed = []
        for s in scored:
            weight = s.score if s.score > 0 else self.FLOOR
            keyed.append((rng.random() ** (1.0 / weight), s.endpoint))
        keyed.sort(key=lambda t: -t[0])
        return ProfileResult(tuple(t[1] for t in keyed))


class RoundRobinPicker(Plugin, Picker):
    """``round-robin-picker``: ignores scores; rotates over the candidates in stable id order.

    State: one counter (bounded). With a changing candidate set the rotation continues from the
    counter modulo the current count. No params.
    """

    type_name = "round-robin-picker"

    def __init__(self, name: str, params: BaseModel, plugins: PluginLookup) -> None:
        super().__init__(name, params, plugins)
        self._next = 0

    def pick(
        self, state: CycleState, scored: Sequence[ScoredEndpoint], rng: random.Random
    ) -> ProfileResult:
        _require(scored)
        ordered = sorted((s.endpoint for s in scored), key=lambda ep: ep.id)
        start = self._next % len(ordered)
        self._next = (self._next + 1) % (1 << 62)
        return ProfileResult(tuple(ordered[start:] + ordered[:start]))
