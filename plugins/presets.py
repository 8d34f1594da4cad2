"""The quick-start presets (entry-point group ``kvgate.presets``): what ``kvgate serve --engine``,
``kvgate serve --prefill/--decode``, ``kvgate deploy render`` and ``kvgate demo`` run.

``cache-aware`` (aggregated engines) and ``cache-aware-pd`` (prefill/decode pools) are the
product's default: cache-aware with no setup, precise when the fleet allows it.

* **Tokens.** With a tokenizer (``--tokenizer DIR``: a model folder; or the name of a
  ``kvgate.tokenizers`` entry point such as ``sim``) the gateway computes the engines' own token
  ids; without one, pseudo-tokens (plugins/prefix/approx_tokens.py) that share prefixes exactly when
  prompts do. Token-id prompts pass through either way.
* **Prefix.** ``prefix-cache-producer`` in ``auto`` mode: per engine, precise from the engine's
  KV events while they are attributed and agree with what the engine reports, else the
  gateway's own record of what it routed where (approximate, bounded by the engine's capacity).
  KV events are subscribed when the fleet publishes them (``--kv-events``).
* **Placement.** ``kv-placement-scorer`` decides alone (weight 1): cost in tokens of recompute,
  queue and cache pressure against each engine's KV capacity (docs/plugins/placement.md). The
  token-load scorer and the session-affinity scorer run as hooks only: the first keeps the
  in-flight work that placement reads, the second reads and echoes the session headers and
  produces the session key that placement pins. Neither is weighted: a second weighted opinion
  on the same facts is what made the old profile pile sessions onto one engine.
* **Async.** ``async-queue`` with its defaults (docs/async.md): queued requests
  (``x-kvgate-queue: true``), background responses (so the ``responses`` API accepts
  ``background: true``) and the Batch/Files API, in SQLite under ``.kvgate/`` (where the
  ledger's default lives), run while the engines have headroom.
* **Flow control.** ``flow-control`` with its defaults (docs/flow-control.md): while every
  engine is saturated live requests wait in the gateway (priority bands, fair across tenants
  by tokens and across agent sessions), the engine picked when they leave the queue; deferred
  work waits below every live band.
* **Isolation.** ``cache-salt``: with API keys on (``--keys``), every request to an engine
  carries its tenant's ``cache_salt`` (docs/operations.md "Tenant isolation"); without keys it
  does nothing.
* **P/D.** Decode first (placement over decode engines: the conversation's KV lives where it
  was decoded), then a prefill hop only when at least 256 prompt tokens are not on that decode
  engine (placement over prefill engines).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvgate.middleware.framework.composition.quickstart import QuickStart

#: ``pd-profile-handler``'s threshold: prefill hop when this many prompt tokens are not on the
#: chosen decode engine (docs/plugins/pd.md has why 256).
PD_MIN_UNCACHED_TOKENS = 256


def _producers(qs: QuickStart) -> list[dict[str, Any]]:
    """Tokenizer, KV events (when published), prefix producer, session and load hooks."""
    tokenizer: dict[str, Any] = {"kind": "module", "module": qs.tokenizer or "approx"}
    if qs.tokenizer is not None and ("/" in qs.tokenizer or Path(qs.tokenizer).is_dir()):
        tokenizer = {"kind": "hf", "model_dir": qs.tokenizer}
    out: list[dict[str, Any]] = [{"type": "tokenizer", "params": {"tokenizer": tokenizer}}]
    # tenant cache salts: inactive until api-keys is switched on (--keys), then injected
    out.append({"type": "cache-salt"})
    if qs.has_events:
        events: dict[str, Any] = {"connect": bool(qs.kv_events)}
        if qs.kv_events_bind:
            events["bind"] = qs.kv_events_bind
        out.append({"type": "kv-events", "params": events})
    out += [
        {"type": "prefix-cache-producer", "params": _prefix_params(qs)},
        {"type": "session-affinity-scorer"},
        {"type": "token-load-scorer"},
        {"type": "health-filter"}, {"type": "model-filter"},
        {"type": "kv-placement-scorer", "params": {"load": "token-load-scorer"}},
        {"type": "max-score-picker"},
    ]
    return out


def _prefix_params(qs: QuickStart) -> dict[str, Any]:
    return {"mode": "auto"}


_COMMON = [{"ref": "health-filter"}, {"ref": "model-filter"}, {"ref": "flow-control"}]
_TAIL = [{"ref": "kv-placement-scorer", "weight": 1.0}, {"ref": "max-score-picker"}]


#: The async queue with its defaults, and the Responses API accepting ``background: true``
#: (which the queue then runs and bills).
_ASYNC: list[dict[str, Any]] = [{"type": "async-queue"}, {"type": "flow-control"}]
_APIS: dict[str, Any] = {"responses": {"allow_background": True}}


def cache_aware(qs: QuickStart) -> dict[str, Any]:
    """Preset ``cache-aware``: one profile over every engine."""
    return {
        "plugins": [*_producers(qs), *_ASYNC],
        "profiles": [{"name": "default", "plugins": [*_COMMON, *_TAIL]}],
        "apis": _APIS,
    }


def cache_aware_pd(qs: QuickStart) -> dict[str, Any]:
    """Preset ``cache-aware-pd``: decode first, then a prefill hop when needed."""
    plugins = _producers(qs)
    picker = plugins.pop()
    plugins += [
        {"type": "role-filter", "name": "decode-role", "params": {"role": "decode"}},
        {"type": "role-filter", "name": "prefill-role", "params": {"role": "prefill"}},
        picker,
        {"type": "pd-profile-handler",
         "params": {"min_uncached_tokens": PD_MIN_UNCACHED_TOKENS}},
        *_ASYNC,
    ]
    return {
        "plugins": plugins,
        "apis": _APIS,
        "profiles": [
            {"name": "decode", "plugins": [*_COMMON, {"ref": "decode-role"}, *_TAIL]},
            {"name": "prefill", "plugins": [*_COMMON, {"ref": "prefill-role"}, *_TAIL]},
        ],
        "profile_handler": "pd-profile-handler",
    }
