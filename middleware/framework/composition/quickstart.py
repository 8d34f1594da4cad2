"""Configs built from command-line flags (``kvgate serve --engine ...``, ``--prefill/--decode``)
and by generators (``kvgate deploy render``, ``kvgate demo``).

The core knows engines, addresses and flags; which plugins make a good default is a *preset*,
found by name in the ``kvgate.presets`` entry-point group (``name = module:function``), where
``function(QuickStart) -> dict`` returns the ``plugins`` / ``profiles`` / ``profile_handler``
part of a config. The core never names a plugin.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

from kvgate.middleware.framework.composition.config import (
    PD_CONNECTORS,
    GatewayConfig,
    parse_config,
)
from kvgate.middleware.framework.errors import ConfigError

PRESET_GROUP = "kvgate.presets"
#: The preset of ``kvgate serve --engine`` and of the P/D quick start.
DEFAULT_PRESET = "cache-aware"
PD_PRESET = "cache-aware-pd"

Preset = Callable[["QuickStart"], dict[str, Any]]


@dataclass(frozen=True)
class QuickStart:
    """What the quick-start flags say about a fleet.

    ``kv_events``: one address per engine in flag order (prefill engines first, then decode
    ones), or a single address for all of them whose ``*`` host stands for each engine's own
    host (every engine binds the same port: ``tcp://*:5557``). ``kv_events_bind``: the gateway
    binds this address and the engines connect to it (then their topics must be
    ``kv@<engine name>``). ``kv_events_replay``: the engines' replay sockets (vLLM's
    ``replay_endpoint``), given like ``kv_events``: lost batches are asked for there, and the
    history at first contact (docs/plugins/kv-events.md). ``tokenizer``: the model's folder
    (tokenizer.json + chat template) for exact token ids; without it routing works on
    pseudo-tokens (approximate).
    """

    engines: tuple[str, ...] = ()
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    pd_protocol: str = "nixl"
    kv_events: tuple[str, ...] = ()
    kv_events_bind: str | None = None
    kv_events_replay: tuple[str, ...] = ()
    tokenizer: str | None = None
    kind: str = "vllm"
    server: Mapping[str, Any] = field(default_factory=dict)

    @property
    def pd(self) -> bool:
        return bool(self.prefill or self.decode)

    @property
    def has_events(self) -> bool:
        return bool(self.kv_events or self.kv_events_bind)

    @property
    def precise(self) -> bool:
        """Exact token ids and KV events: the index can match what the engines hold."""
        return self.has_events and self.tokenizer is not None

    def engine_list(self) -> list[dict[str, Any]]:
        """The ``engines`` section: names ``engine-i`` or ``prefill-i`` / ``decode-i``."""
        if self.pd:
            named = [(f"prefill-{i}", u, "prefill") for i, u in enumerate(self.prefill)]
            named += [(f"decode-{i}", u, "decode") for i, u in enumerate(self.decode)]
        else:
            named = [(f"engine-{i}", u, "both") for i, u in enumerate(self.engines)]
        events = _per_engine(self.kv_events, len(named), "--kv-events")
        replays = _per_engine(self.kv_events_replay, len(named), "--kv-events-replay")
        out = []
        for (name, url, role), address, replay in zip(named, events, replays, strict=True):
            entry: dict[str, Any] = {"name": name, "url": url, "kind": self.kind, "role": role}
            if address:
                entry["kv_events"] = address
            if replay:
                entry["kv_events_replay"] = replay
            out.append(entry)
        return out


def _per_engine(addresses: tuple[str, ...], count: int, flag: str) -> list[str | None]:
    """One address per engine: as given (in engine order), or one ``tcp://*:PORT`` for all."""
    if not addresses:
        return [None] * count
    if len(addresses) == 1 and count > 1:
        if "://*:" not in addresses[0]:
            raise ConfigError(
                f"one {flag} address for several engines must use the '*' host "
                "(tcp://*:PORT: each engine binds PORT on its own host); otherwise give "
                f"one {flag} per engine, in --engine order"
            )
        return [addresses[0]] * count
    if len(addresses) != count:
        raise ConfigError(f"{len(addresses)} {flag} addresses for {count} engines: "
                          "give one per engine (in order) or one tcp://*:PORT for all")
    return list(addresses)


def presets() -> dict[str, Preset]:
    found: dict[str, Preset] = {}
    for ep in entry_points(group=PRESET_GROUP):
        found[ep.name] = ep.load()
    return found


def quick_start_config(qs: QuickStart, preset: str | None = None) -> GatewayConfig:
    """The config of a quick start: its engines behind the named (or default) preset."""
    if qs.pd and qs.engines:
        raise ConfigError("give either --engine URL ... or --prefill URL ... --decode URL ..., "
                          "not both")
    if qs.pd and (not qs.prefill or not qs.decode):
        raise ConfigError("prefill/decode disaggregation needs at least one --prefill and one "
                          "--decode engine")
    if not qs.pd and not qs.engines:
        raise ConfigError("no engine given")
    name = preset or (PD_PRESET if qs.pd else DEFAULT_PRESET)
    known = presets()
    if name not in known:
        raise ConfigError(f"unknown preset {name!r} (known: {', '.join(sorted(known))})")
    data: dict[str, Any] = {"server": dict(qs.server), "engines": qs.engine_list(),
                            **known[name](qs)}
    if qs.pd:
        if qs.pd_protocol not in PD_CONNECTORS:
            raise ConfigError(f"unknown P/D protocol {qs.pd_protocol!r} "
                              f"(known: {', '.join(PD_CONNECTORS)})")
        data.setdefault("disaggregation", {"connector": PD_CONNECTORS[qs.pd_protocol]})
    return parse_config(data, "<command line>")


def config_from_engines(
    urls: list[str], *, host: str | None = None, port: int | None = None, kind: str = "vllm"
) -> GatewayConfig:
    """``kvgate serve --engine URL ...`` with no other flag: the default preset."""
    server = {k: v for k, v in (("host", host), ("port", port)) if v is not None}
    return quick_start_config(QuickStart(engines=tuple(urls), kind=kind, server=server))


def pd_config_data(
    prefill: list[str], decode: list[str], protocol: str = "nixl", kind: str = "vllm",
) -> dict[str, Any]:
    """Config data of ``kvgate serve --prefill URL ... --decode URL ...`` (to extend in tests)."""
    qs = QuickStart(prefill=tuple(prefill), decode=tuple(decode), pd_protocol=protocol, kind=kind)
    return quick_start_config(qs).model_dump(mode="json", exclude={"source"})
