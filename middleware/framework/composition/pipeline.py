"""Builds and validates the plugin pipeline from a config and the registry.

Every problem is found here, at startup, and reported as a ConfigError naming the config
file, the plugin instance or profile, and the problem. Nothing is validated at request time.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError

from kvgate.middleware.framework.backend import Backend
from kvgate.middleware.framework.composition.config import (
    GatewayConfig,
    PluginConfig,
    ProfileConfig,
    plugin_param_defaults,
)
from kvgate.middleware.framework.composition.registry import Registry
from kvgate.middleware.framework.connector import Connector
from kvgate.middleware.framework.engine import EngineAdapter
from kvgate.middleware.framework.errors import ConfigError
from kvgate.middleware.framework.plugin import (
    AdmissionGate,
    AsgiApp,
    AsgiMount,
    Authenticator,
    CompletionHook,
    DataProducer,
    DispatchHook,
    EndpointSetListener,
    Filter,
    Lifecycle,
    ModelCatalog,
    NeedsLoopback,
    Picker,
    Plugin,
    PrefillHook,
    ProfileHandler,
    RequestDeferral,
    RequestEndHook,
    RequestHook,
    Route,
    RouteProvider,
    Scorer,
    StateResolver,
    UsageHook,
    slots_of,
)
from kvgate.middleware.framework.scheduler import Profile, Scheduler, WeightedScorer


@dataclass(frozen=True)
class Pipeline:
    """The composed plugins, by slot: in config order, except that a plugin consuming a state
    key runs after the plugins producing it (:func:`order_by_state`)."""

    plugins: Mapping[str, Plugin]
    scheduler: Scheduler
    adapters: Mapping[str, EngineAdapter]
    request_hooks: tuple[RequestHook, ...] = ()
    producers: tuple[DataProducer, ...] = ()
    dispatch_hooks: tuple[DispatchHook, ...] = ()
    usage_hooks: tuple[UsageHook, ...] = ()
    completion_hooks: tuple[CompletionHook, ...] = ()
    request_end_hooks: tuple[RequestEndHook, ...] = ()
    prefill_hooks: tuple[PrefillHook, ...] = ()
    #: Flow control: awaited before scheduling (middleware/framework/plugin.py AdmissionGate).
    gates: tuple[AdmissionGate, ...] = ()
    listeners: tuple[EndpointSetListener, ...] = ()
    lifecycles: tuple[Lifecycle, ...] = field(default=())
    authenticator: Authenticator | None = None
    #: (method, path) -> route, from RouteProvider plugins
    routes: Mapping[tuple[str, str], Route] = field(default_factory=dict)
    #: The KV-transfer connector for two-hop (prefill/decode) dispatch, if configured.
    connector: Connector | None = None
    #: In-process model backends by kind (``kvgate.engines`` entries implementing Backend).
    backends: Mapping[str, Backend] = field(default_factory=dict)
    #: The model catalog plugin (serves /v1/models), if one is configured.
    catalog: ModelCatalog | None = None
    #: Consulted before dispatch (queued requests, background responses).
    deferrals: tuple[RequestDeferral, ...] = ()
    #: Consulted before the StateMap on by-id routes.
    resolvers: tuple[StateResolver, ...] = ()
    #: (path prefix, ASGI app) from AsgiMount plugins (overlaps checked by the app).
    mounts: tuple[tuple[str, AsgiApp], ...] = ()
    #: Plugins the app hands its loopback to.
    loopback_users: tuple[NeedsLoopback, ...] = ()


class _Lookup:
    """The handle plugin constructors use to find plugins declared before them."""

    def __init__(self, source: str, built: Mapping[str, Plugin]) -> None:
        self._source = source
        self._built = built

    def lookup(self, name: str) -> object:
        try:
            return self._built[name]
        except KeyError:
            raise ConfigError(
                f"{self._source}: plugin {name!r} is referenced but not declared before it"
            ) from None


def _instantiate(
    source: str, idx: int, pc: PluginConfig, registry: Registry, built: dict[str, Plugin],
    defaults: Mapping[str, Any],
) -> Plugin:
    where = f"{source}: plugins[{idx}] (name {pc.instance_name!r}, type {pc.type!r})"
    cls = registry.plugin_class(pc.type)
    if cls is None:
        known = ", ".join(sorted(registry.plugins)) or "none"
        raise ConfigError(f"{where}: unknown plugin type (known: {known})")
    if pc.instance_name in built:
        raise ConfigError(f"{where}: duplicate plugin name {pc.instance_name!r}")
    try:
        fields = cls.Params.model_fields
        inherited = {k: v for k, v in defaults.items() if k in fields and k not in pc.params}
        params: BaseModel = cls.Params.model_validate({**inherited, **pc.params})
    except ValidationError as exc:
        detail = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'params'}: {err['msg']}"
            for err in exc.errors()
        )
        raise ConfigError(f"{where}: bad params: {detail}") from None
    try:
        plugin = cls(pc.instance_name, params, _Lookup(source, built))
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    if not slots_of(plugin):
        raise ConfigError(f"{where}: implements no extension point")
    return plugin


def _build_profile(
    source: str, pc: ProfileConfig, plugins: Mapping[str, Plugin]
) -> Profile:
    where = f"{source}: profile {pc.name!r}"
    filters: list[tuple[str, Filter]] = []
    scorers: list[WeightedScorer] = []
    pickers: list[Picker] = []
    for ref in pc.plugins:
        plugin = plugins.get(ref.ref)
        if plugin is None:
            raise ConfigError(f"{where}: refers to undeclared plugin {ref.ref!r}")
        if ref.weight is not None and not isinstance(plugin, Scorer):
            raise ConfigError(f"{where}: {ref.ref!r} is not a scorer, so it takes no weight")
        if isinstance(plugin, Filter):
            filters.append((ref.ref, plugin))
        elif isinstance(plugin, Scorer):
            weight = 1.0 if ref.weight is None else ref.weight
            scorers.append(WeightedScorer(ref.ref, plugin, weight))
        elif isinstance(plugin, Picker):
            pickers.append(plugin)
        else:
            raise ConfigError(
                f"{where}: {ref.ref!r} is not a filter, scorer or picker "
                f"(it is: {', '.join(sorted(slots_of(plugin)))})"
            )
    if len(pickers) != 1:
        raise ConfigError(f"{where}: needs exactly one picker, has {len(pickers)}")
    return Profile(pc.name, tuple(filters), tuple(scorers), pickers[0])


def _check_state_keys(source: str, plugins: Mapping[str, Plugin]) -> None:
    produced = {key for p in plugins.values() for key in p.produces}
    for name, plugin in plugins.items():
        missing = sorted(plugin.consumes - produced)
        if missing:
            raise ConfigError(
                f"{source}: plugin {name!r} consumes {', '.join(missing)} but no configured "
                "plugin produces it"
            )


def order_by_state(source: str, plugins: Mapping[str, Plugin]) -> list[Plugin]:
    """Plugins ordered so that each runs after every plugin producing a state key it consumes
    (within a slot: hooks and producers run in this order); ties keep the config order. A
    cycle is a ConfigError naming its plugins."""
    names = list(plugins)
    after: dict[str, set[str]] = {
        n: {m for m in names if m != n and plugins[n].consumes & plugins[m].produces}
        for n in names
    }
    placed: list[str] = []
    done: set[str] = set()
    while len(placed) < len(names):
        ready = next((n for n in names if n not in done and after[n] <= done), None)
        if ready is None:
            stuck = ", ".join(repr(n) for n in names if n not in done)
            raise ConfigError(f"{source}: plugins {stuck} consume state keys each other "
                              "produce (a cycle): no order can run them")
        placed.append(ready)
        done.add(ready)
    return [plugins[n] for n in placed]


def _pick_handler(
    config: GatewayConfig, plugins: Mapping[str, Plugin], profiles: Mapping[str, Profile]
) -> ProfileHandler | None:
    source = config.source
    if config.profile_handler is None:
        if len(profiles) != 1:
            raise ConfigError(
                f"{source}: {len(profiles)} profiles need a profile_handler (exactly one profile "
                "runs without one)"
            )
        return None
    handler = plugins.get(config.profile_handler)
    if handler is None:
        raise ConfigError(f"{source}: profile_handler {config.profile_handler!r} is not declared")
    if not isinstance(handler, ProfileHandler):
        raise ConfigError(f"{source}: profile_handler {config.profile_handler!r} is not one")
    return handler


def _adapters(config: GatewayConfig, registry: Registry) -> dict[str, EngineAdapter]:
    adapters: dict[str, EngineAdapter] = {}
    names: set[str] = set()
    for idx, ec in enumerate(config.engines):
        where = f"{config.source}: engines[{idx}] (name {ec.name!r})"
        if ec.name in names:
            raise ConfigError(f"{where}: duplicate engine name")
        names.add(ec.name)
        if ec.kind not in adapters:
            adapter = registry.adapter(ec.kind)
            if adapter is None:
                known = ", ".join(sorted(registry.engines)) or "none"
                raise ConfigError(f"{where}: unknown engine kind {ec.kind!r} (known: {known})")
            if not isinstance(adapter, EngineAdapter):
                raise ConfigError(f"{where}: engine kind {ec.kind!r} is not an HTTP engine "
                                  "(use it from the model catalog)")
            adapters[ec.kind] = adapter
    return adapters


#: Paths the core serves itself; plugins may not take them (nor an API adapter's routes: the
#: app refuses those overlaps when it builds its route table).
RESERVED_PATHS = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"}
)


def _routes(source: str, plugins: Mapping[str, Plugin]) -> dict[tuple[str, str], Route]:
    routes: dict[tuple[str, str], Route] = {}
    for name, plugin in plugins.items():
        if not isinstance(plugin, RouteProvider):
            continue
        for route in plugin.routes():
            key = (route.method.upper(), route.path)
            if route.path in RESERVED_PATHS or key in routes:
                raise ConfigError(
                    f"{source}: plugin {name!r} route {key[0]} {route.path} is already taken"
                )
            routes[key] = route
    return routes


def _authenticator(source: str, plugins: Mapping[str, Plugin]) -> Authenticator | None:
    found = [(n, p) for n, p in plugins.items() if isinstance(p, Authenticator)]
    if len(found) > 1:
        names = ", ".join(repr(n) for n, _ in found)
        raise ConfigError(f"{source}: at most one authenticator plugin, found {names}")
    return found[0][1] if found else None


def _connector(config: GatewayConfig, registry: Registry) -> Connector | None:
    dc = config.disaggregation
    if dc is None:
        return None
    where = f"{config.source}: disaggregation"
    cls = registry.connectors.get(dc.connector)
    if cls is None:
        known = ", ".join(sorted(registry.connectors)) or "none"
        raise ConfigError(f"{where}: unknown connector {dc.connector!r} (known: {known})")
    params_model = getattr(cls, "Params", None)
    if not (isinstance(params_model, type) and issubclass(params_model, BaseModel)):
        raise ConfigError(f"{where}: connector {dc.connector!r} has no Params model")
    try:
        params = params_model.model_validate(dc.params)
    except ValidationError as exc:
        detail = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'params'}: {err['msg']}"
            for err in exc.errors()
        )
        raise ConfigError(f"{where}: bad params: {detail}") from None
    connector = cls(params)
    if not isinstance(connector, Connector):
        raise ConfigError(f"{where}: {dc.connector!r} is not a Connector")
    return connector


def _backends(registry: Registry) -> dict[str, Backend]:
    """Every registered engine kind that is an in-process Backend (construction is cheap)."""
    found: dict[str, Backend] = {}
    for kind in registry.engines:
        obj = registry.adapter(kind)
        if isinstance(obj, Backend):
            found[kind] = obj
    return found


def _catalog(
    config: GatewayConfig, plugins: Mapping[str, Plugin], backends: Mapping[str, Backend]
) -> tuple[ModelCatalog | None, dict[str, Backend]]:
    """The catalog plugin (checked against the config) and the backends it uses."""
    found = [(n, p) for n, p in plugins.items() if isinstance(p, ModelCatalog)]
    if len(found) > 1:
        names = ", ".join(repr(n) for n, _ in found)
        raise ConfigError(f"{config.source}: at most one model catalog plugin, found {names}")
    if not found:
        return None, {}
    catalog = found[0][1]
    engines = {ec.name: frozenset(ec.models) for ec in config.engines}
    profiles = frozenset(pc.name for pc in config.profiles)
    catalog.check(engines, profiles, frozenset(backends))
    return catalog, {k: backends[k] for k in catalog.backend_kinds() if k in backends}


def build_pipeline(config: GatewayConfig, registry: Registry) -> Pipeline:
    """Instantiate and validate everything; raises ConfigError on the first problem."""
    source = config.source
    adapters = _adapters(config, registry)
    built: dict[str, Plugin] = {}
    defaults = plugin_param_defaults(config)
    for idx, pc in enumerate(config.plugins):
        built[pc.instance_name] = _instantiate(source, idx, pc, registry, built, defaults)
    if not config.profiles:
        raise ConfigError(f"{source}: at least one profile is required")
    profiles: dict[str, Profile] = {}
    for prof in config.profiles:
        if prof.name in profiles:
            raise ConfigError(f"{source}: duplicate profile name {prof.name!r}")
        profiles[prof.name] = _build_profile(source, prof, built)
    _check_state_keys(source, built)
    handler = _pick_handler(config, built, profiles)
    catalog, backends = _catalog(config, built, _backends(registry))
    values = order_by_state(source, built)
    return Pipeline(
        plugins=built,
        scheduler=Scheduler(profiles, handler, config.server.seed),
        adapters=adapters,
        request_hooks=tuple(p for p in values if isinstance(p, RequestHook)),
        producers=tuple(p for p in values if isinstance(p, DataProducer)),
        dispatch_hooks=tuple(p for p in values if isinstance(p, DispatchHook)),
        usage_hooks=tuple(p for p in values if isinstance(p, UsageHook)),
        completion_hooks=tuple(p for p in values if isinstance(p, CompletionHook)),
        request_end_hooks=tuple(p for p in values if isinstance(p, RequestEndHook)),
        prefill_hooks=tuple(p for p in values if isinstance(p, PrefillHook)),
        gates=tuple(p for p in values if isinstance(p, AdmissionGate)),
        listeners=tuple(p for p in values if isinstance(p, EndpointSetListener)),
        lifecycles=(*(p for p in values if isinstance(p, Lifecycle)),
                    *(b for b in backends.values() if isinstance(b, Lifecycle))),
        routes=_routes(source, built),
        authenticator=_authenticator(source, built),
        connector=_connector(config, registry),
        backends=backends,
        catalog=catalog,
        deferrals=tuple(p for p in values if isinstance(p, RequestDeferral)),
        resolvers=tuple(p for p in values if isinstance(p, StateResolver)),
        mounts=tuple(m for p in values if isinstance(p, AsgiMount) for m in p.mounts()),
        loopback_users=tuple(p for p in values if isinstance(p, NeedsLoopback)),
    )
