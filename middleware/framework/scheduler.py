"""The scheduler: per profile, filters -> weighted scorers -> one picker. Pure and synchronous.

A profile handler (a plugin) decides which profiles run and how their results combine (e.g.
decode first, then prefill); a profile that finds no endpoint is left out of its results.
Without one, the single configured profile runs and its first endpoint is the target, the
others are retry alternates.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvgate.middleware.framework.errors import NoEndpointAvailable
from kvgate.middleware.framework.plugin import Filter, Picker, ProfileHandler, Scorer
from kvgate.middleware.framework.types import (
    CycleState,
    Endpoint,
    InferenceRequest,
    ProfileResult,
    RoutingDecision,
    ScoredEndpoint,
    StateKey,
)

#: Tracing's route span (middleware/observe/tracing.py): each profile's best totals, kept only when
#: ``Scheduler.keep_scores`` is set: profile -> ((engine, total score), ...) best first.
ROUTE_SCORES: StateKey[dict[str, tuple[tuple[str, float], ...]]] = StateKey("route-scores")
#: Engines kept per profile: enough to see the margin of the choice, bounded for big pools.
TOP_SCORES = 3


@dataclass(frozen=True, slots=True)
class WeightedScorer:
    name: str
    scorer: Scorer
    weight: float


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    filters: tuple[tuple[str, Filter], ...]
    scorers: tuple[WeightedScorer, ...]
    picker: Picker


class HookClock(Protocol):
    """What times plugin calls (middleware/observe/metrics.py's sampled ``HookTimer``): calls are
    timed while ``on`` is set."""

    on: bool

    def observe(self, plugin: object, hook: str, since: float) -> None: ...


def _keep_scores(state: CycleState, profile: str, totals: Mapping[str, float]) -> None:
    kept = state.get(ROUTE_SCORES)
    if kept is None:
        kept = {}
        state.put(ROUTE_SCORES, kept)
    best = sorted(totals.items(), key=lambda item: item[1], reverse=True)[:TOP_SCORES]
    kept[profile] = tuple(best)


class Scheduler:
    """Runs profiles over an endpoint snapshot. Owns the seeded RNG used by pickers."""

    def __init__(
        self, profiles: Mapping[str, Profile], handler: ProfileHandler | None, seed: int
    ) -> None:
        self.profiles = dict(profiles)
        self.handler = handler
        self.rng = random.Random(seed)
        # A handler may ask for profiles repeatedly; this bounds a buggy one.
        self._max_rounds = 2 * max(1, len(self.profiles))
        #: Keep each profile's top scores in the cycle state (ROUTE_SCORES): set when tracing.
        self.keep_scores = False
        #: Times filter, scorer and picker calls while its ``on`` is set: the app gives the
        #: metrics' sampled hook timer (middleware/observe/metrics.py); None: never timed.
        self.timer: HookClock | None = None

    def run_profile(
        self, profile: Profile, req: InferenceRequest, state: CycleState, eps: Sequence[Endpoint]
    ) -> ProfileResult:
        timer = self.timer if self.timer is not None and self.timer.on else None
        for name, flt in profile.filters:
            t = time.perf_counter() if timer else 0.0
            eps = flt.filter(req, state, eps)
            if timer:
                timer.observe(flt, "filter", t)
            if not eps:
                raise NoEndpointAvailable(
                    f"no engine can serve model {req.model!r} now (profile {profile.name!r}, "
                    f"filter {name!r} left none)"
                )
        if not eps:
            raise NoEndpointAvailable(f"no engine can serve model {req.model!r} now")
        totals = dict.fromkeys([ep.id for ep in eps], 0.0)  # a list: no generator frame
        for ws in profile.scorers:
            t = time.perf_counter() if timer else 0.0
            scores = ws.scorer.score(req, state, eps)
            if timer:
                timer.observe(ws.scorer, "score", t)
            weight = ws.weight
            for ep_id, v in scores.items():
                if ep_id in totals:  # the score clamped into [0, 1], NaN as 0 (inline: per engine)
                    totals[ep_id] += weight * (0.0 if not v > 0.0 else v if v < 1.0 else 1.0)
        scored = [ScoredEndpoint(ep, totals[ep.id]) for ep in eps]
        if self.keep_scores:
            _keep_scores(state, profile.name, totals)
        t = time.perf_counter() if timer else 0.0
        result = profile.picker.pick(state, scored, self.rng)
        if timer:
            timer.observe(profile.picker, "pick", t)
        return result

    def schedule_profile(
        self, name: str, req: InferenceRequest, state: CycleState, eps: Sequence[Endpoint]
    ) -> RoutingDecision:
        """Run the one named profile (a catalog entry's routing profile), no profile handler."""
        result = self.run_profile(self.profiles[name], req, state, eps)
        return RoutingDecision(target=result.target, alternates=result.endpoints[1:],
                               profiles={name: result})

    def schedule(
        self, req: InferenceRequest, state: CycleState, eps: Sequence[Endpoint]
    ) -> RoutingDecision:
        if self.handler is None:
            (profile,) = self.profiles.values()
            result = self.run_profile(profile, req, state, eps)
            return RoutingDecision(
                target=result.target,
                alternates=result.endpoints[1:],
                profiles={profile.name: result},
            )
        results: dict[str, ProfileResult] = {}
        failed: set[str] = set()
        names = tuple(self.profiles)
        for _ in range(self._max_rounds):
            todo = [n for n in self.handler.pick_profiles(req, state, names, results)
                    if n not in failed]
            if not todo:
                break
            for name in todo:
                try:
                    results[name] = self.run_profile(self.profiles[name], req, state, eps)
                except NoEndpointAvailable:
                    # Left out of ``results`` and not run again: the handler decides whether
                    # the request can go without it (e.g. no prefill engine: decode locally).
                    failed.add(name)
        if failed and not results:
            raise NoEndpointAvailable(f"no engine can serve model {req.model!r} now")
        return self.handler.finalize(req, state, results)
