"""Plugin and engine-adapter registry, fed by entry points (or an explicit mapping in tests).

Entry-point groups:

* ``kvgate.plugins``: ``<type_name> = module:PluginClass``
* ``kvgate.engines``: ``<kind> = module:AdapterClass``
* ``kvgate.commands``: ``<name> = module:register`` where ``register(subparsers)`` adds CLI commands
* ``kvgate.connectors``: ``<name> = module:ConnectorClass`` (prefill/decode KV transfer)
* ``kvgate.apis``: ``<name> = module:AdapterClass`` (client-facing APIs,
middleware/framework/api.py)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

from pydantic import BaseModel, ValidationError

from kvgate.middleware.framework.api import ApiAdapter
from kvgate.middleware.framework.engine import EngineAdapter
from kvgate.middleware.framework.errors import ConfigError
from kvgate.middleware.framework.plugin import Plugin

PLUGIN_GROUP = "kvgate.plugins"
ENGINE_GROUP = "kvgate.engines"
COMMAND_GROUP = "kvgate.commands"
CONNECTOR_GROUP = "kvgate.connectors"
API_GROUP = "kvgate.apis"


def _load_group(group: str) -> dict[str, Any]:
    loaded: dict[str, Any] = {}
    for ep in entry_points(group=group):
        if ep.name in loaded:
            raise ConfigError(f"entry point group {group}: {ep.name!r} is registered twice")
        loaded[ep.name] = ep.load()
    return loaded


def load_apis() -> dict[str, Callable[..., ApiAdapter]]:
    """API adapter classes from the ``kvgate.apis`` group, checked against their ``name``."""
    apis = _load_group(API_GROUP)
    for name, cls in apis.items():
        if getattr(cls, "name", None) != name:
            raise ConfigError(f"API entry point {name!r} points at {cls!r}, whose name is "
                              f"{getattr(cls, 'name', None)!r}")
    return apis


@dataclass(frozen=True)
class Registry:
    """Known plugin types and engine kinds. Build once at startup, then read-only."""

    plugins: Mapping[str, type[Plugin]] = field(default_factory=dict)
    engines: Mapping[str, Callable[[], EngineAdapter]] = field(default_factory=dict)
    #: KV-transfer connector classes by name (see kvgate.middleware.framework.connector).
    connectors: Mapping[str, type] = field(default_factory=dict)
    #: Client-facing API adapters by name; by default the ``kvgate.apis`` entry points.
    apis: Mapping[str, Callable[..., ApiAdapter]] = field(default_factory=load_apis)

    @classmethod
    def from_entry_points(cls) -> Registry:
        plugins = _load_group(PLUGIN_GROUP)
        for name, plugin_cls in plugins.items():
            if not (isinstance(plugin_cls, type) and issubclass(plugin_cls, Plugin)):
                raise ConfigError(f"plugin entry point {name!r} is not a Plugin subclass")
            if plugin_cls.type_name != name:
                raise ConfigError(
                    f"plugin entry point {name!r} points at a class whose type_name is "
                    f"{plugin_cls.type_name!r}"
                )
        return cls(
            plugins=plugins, engines=_load_group(ENGINE_GROUP),
            connectors=_load_group(CONNECTOR_GROUP), apis=load_apis(),
        )

    def plugin_class(self, type_name: str) -> type[Plugin] | None:
        return self.plugins.get(type_name)

    def api_adapters(self, options: Mapping[str, Mapping[str, Any]] | None = None,
                     source: str = "<config>") -> list[ApiAdapter]:
        """One instance of each API adapter (adapters are pure: one serves every request),
        built with its ``options`` (the config's ``apis`` section): validated against the
        adapter class's optional ``Params`` pydantic model and passed as keyword arguments.
        An unknown adapter name, an adapter without ``Params`` or an invalid option is a
        ConfigError naming ``apis.<name>``."""
        options = options or {}
        unknown = sorted(set(options) - set(self.apis))
        if unknown:
            raise ConfigError(f"{source}: apis: unknown API adapter(s) {', '.join(unknown)} "
                              f"(known: {', '.join(sorted(self.apis))})")
        out = []
        for name, factory in sorted(self.apis.items()):
            adapter = factory(**_adapter_options(name, factory, options.get(name), source))
            if not isinstance(adapter, ApiAdapter):
                raise ConfigError(f"API {name!r} does not implement "
                                  "kvgate.middleware.framework.api.ApiAdapter")
            out.append(adapter)
        return out

    def adapter(self, kind: str) -> EngineAdapter | None:
        factory = self.engines.get(kind)
        return factory() if factory is not None else None


def _adapter_options(name: str, factory: Callable[..., ApiAdapter],
                     given: Mapping[str, Any] | None, source: str) -> dict[str, Any]:
    """Keyword arguments for adapter ``name`` from its config options (none: defaults)."""
    if given is None:
        return {}
    params = getattr(factory, "Params", None)
    if not (isinstance(params, type) and issubclass(params, BaseModel)):
        raise ConfigError(f"{source}: apis.{name}: the {name!r} API adapter takes no options")
    try:
        validated = params.model_validate(given)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<options>'}: {err['msg']}"
            for err in exc.errors())
        raise ConfigError(f"{source}: apis.{name}: {problems}") from None
    return {field: getattr(validated, field) for field in type(validated).model_fields}


def command_registrars() -> dict[str, Callable[[Any], None]]:
    """CLI command contributors from the ``kvgate.commands`` group."""
    return _load_group(COMMAND_GROUP)
