"""Prefill/decode disaggregation: the decode-first profile handler and its decider.

``pd-profile-handler`` (ProfileHandler)
    1. Runs the decode profile (``decode_profile``; typically role-filter decode + prefix,
       session and token-load scorers) and takes its choice as the decode engine.
    2. The decider: the prompt's tokens that the chosen decode engine does *not* hold,

       ``uncached = prompt_tokens - held(decode engine)``

       where ``prompt_tokens`` is ``len(TOKEN_IDS)`` (tokenizer), else
       ``PREFIX_MATCH.prompt_tokens``, else the gateway's estimate, and ``held`` is the
       ``PREFIX_MATCH`` device + slower-tier match on that engine (0 without match data).
       A prefill hop pays when ``uncached >= min_uncached_tokens``.
    3. If it pays, runs the prefill profile (``prefill_profile``; role-filter prefill + prefix
       affinity + in-flight prefill tokens) and names its choice as the decision's ``prefill``.
       If the prefill profile finds no engine, or picks the decode engine itself, the request is
       decoded locally (no prefill hop).

    The decision's target is always the decode engine (it streams the answer); its retry
    alternates are the decode profile's other engines. The gateway's connector
    (``disaggregation`` in the config) carries out the two hops.

Params (units in brackets):

* ``decode_profile`` / ``prefill_profile`` — profile names (default ``decode`` / ``prefill``).
* ``min_uncached_tokens`` [tokens] — 256. A prefill hop costs an extra HTTP round trip, a
  second scheduling and a KV transfer setup (a few ms, plus the transfer itself); a decode
  engine prefilling 256 tokens itself costs one chunk that chunked prefill slips into a decode
  step (≈ 6 ms of GEMM on the simulator's H100 calibration, 256 * 23 µs), which stalls the
  running decodes by about one step. Above a few hundred tokens the local prefill's stall on
  every co-running decode outgrows the hop's fixed cost; below it the hop is pure overhead.
  It is also the value the wire notes give (PROTOCOLS.md, "skip the prefill hop when the
  decode engine already holds most of the prefix"). A follow-up turn of an agentic session
  whose history is cached on its decode engine therefore stays local.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field

from kvgate.middleware.framework.errors import NoEndpointAvailable
from kvgate.middleware.framework.plugin import Plugin, PluginLookup, ProfileHandler
from kvgate.middleware.framework.types import (
    CycleState,
    Endpoint,
    InferenceRequest,
    ProfileResult,
    RoutingDecision,
)
from kvgate.plugins.common.state import PREFIX_MATCH
from kvgate.plugins.load.token_load import prompt_tokens, uncached_tokens


def prefill_pays(
    req: InferenceRequest, state: CycleState, decode: Endpoint, min_uncached: int
) -> bool:
    """The decider: does the decode engine lack at least ``min_uncached`` prompt tokens?"""
    uncached = uncached_tokens(prompt_tokens(req, state), state.get(PREFIX_MATCH), decode.id)
    return uncached >= min_uncached


class PdProfileHandler(Plugin, ProfileHandler):
    """``pd-profile-handler``: decode first, then a prefill hop if it pays (module docstring)."""

    type_name = "pd-profile-handler"
    example_params: ClassVar[Mapping[str, object]] = {
        "decode_profile": "decode", "prefill_profile": "prefill", "min_uncached_tokens": 256,
    }

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)

        decode_profile: str = Field(default="decode", min_length=1)
        prefill_profile: str = Field(default="prefill", min_length=1)
        min_uncached_tokens: int = Field(default=256, ge=0)

    def __init__(self, name: str, params: BaseModel, plugins: PluginLookup) -> None:
        super().__init__(name, params, plugins)
        assert isinstance(params, PdProfileHandler.Params)
        self.p = params

    def pick_profiles(
        self, req: InferenceRequest, state: CycleState, profiles: Sequence[str],
        results: Mapping[str, ProfileResult],
    ) -> Sequence[str]:
        decode, prefill = self.p.decode_profile, self.p.prefill_profile
        if decode not in profiles:
            return []
        if decode not in results:
            return [decode]  # not run again if it found no engine (the scheduler drops it)
        if prefill in results or prefill not in profiles:
            return []
        if prefill_pays(req, state, results[decode].target, self.p.min_uncached_tokens):
            return [prefill]
        return []

    def finalize(
        self, req: InferenceRequest, state: CycleState, results: Mapping[str, ProfileResult]
    ) -> RoutingDecision:
        decode = results.get(self.p.decode_profile)
        if decode is None:
            raise NoEndpointAvailable(f"no decode engine can serve model {req.model!r} now")
        prefill = results.get(self.p.prefill_profile)
        target = decode.target
        prefill_ep = None if prefill is None or prefill.target.id == target.id else prefill.target
        return RoutingDecision(
            target=target, alternates=decode.endpoints[1:], prefill=prefill_ep, profiles=results
        )
