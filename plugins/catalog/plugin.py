"""``catalog``: the public model list -- names and aliases mapped to a self-hosted pool or a
third-party model, with metadata -- behind ``GET /v1/models`` and every inference request.

Catalog file (YAML, one per gateway)::

    models:
      - name: llama-8b                 # public name (what clients send, what is billed)
        aliases: [llama, default]      # other names accepted for it
        pool:                          # self-hosted: engines of the gateway config
          engines: [e0, e1]            # optional subset (default: every engine)
          profile: cache-aware         # optional routing profile (default: the configured ones)
        context_length: 131072         # tokens (metadata)
        modalities: [text]             # text | image | audio (metadata)
        fallbacks: [claude-haiku]      # catalog names tried in order when this one fails
        fallback_on: [429, 502, 503, 504]
      - name: claude-haiku
        provider:                      # third party, through an in-process backend (LiteLLM)
          model: anthropic/claude-haiku-4-5    # LiteLLM's provider/model
          api_key_env: ANTHROPIC_API_KEY       # NAME of the variable; the key is never stored
          env: []                      # other variables LiteLLM reads itself (names, checked)
          api_base: https://api.anthropic.com  # optional
          timeout_s: 60
          retries: 1                   # same-provider retries on 429/5xx before the first byte
          retry_backoff_s: 0.5         # doubled after each retry

Algorithm. At startup the file is validated strictly (unknown keys, duplicate names or
aliases, a fallback that is not in the catalog, an environment variable that is not set, and
-- once the gateway config is known -- an engine, profile or backend kind that does not exist
refuse to start with a ConfigError naming the file, the entry and the problem). One
:class:`~kvgate.middleware.framework.backend.ModelPlan` per entry is built then (its backend, then
each fallback's). Per request (RequestHook): the model name or alias is resolved (404 naming the
closest names otherwise), the request's model is rewritten to the public name before
scheduling, and the plan is put in the request state for the gateway. Prices come from the
price book (``prices`` param, the billing plugin's file); ``cached_tokens_discounted`` says
whether the cached-input price is below the input price. State: the parsed file (bounded by
it); nothing grows per request.

Reload (plugins/common/reload.py): with ``api-keys`` (its ``reload`` names ``catalog`` by default)
the catalog file and its price book are re-read when they change (polled about every second)
or on ``POST /v1/admin/reload`` (every replica). A new version is validated like at startup and
checked against the same gateway config (engines, profiles, installed backends; a backend kind
not started with the gateway needs a restart); a bad one is refused and the last good catalog
keeps serving (WARNING, ``/health``, ``kvgate_config_reloads``).
"""

from __future__ import annotations

import datetime as dt
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvgate.middleware.framework.backend import (
    DEFAULT_FALLBACK_ON,
    MODEL_PLAN,
    BackendStep,
    ModelPlan,
    PoolStep,
)
from kvgate.middleware.framework.errors import ConfigError, model_not_found
from kvgate.middleware.framework.plugin import (
    ModelCatalog,
    Plugin,
    PluginLookup,
    RequestHook,
    allowed_models,
)
from kvgate.middleware.framework.types import CycleState, InferenceRequest, Principal, StateKey
from kvgate.pricing.money import MILLION
from kvgate.pricing.prices import PriceBook, PriceError, load_book

_STRICT = ConfigDict(extra="forbid", frozen=True)
_NAME = r"^[A-Za-z0-9][A-Za-z0-9._:/@-]{0,127}$"
_ENV = r"^[A-Za-z_][A-Za-z0-9_]*$"


class PoolSpec(BaseModel):
    model_config = _STRICT
    engines: tuple[str, ...] | None = Field(None, min_length=1)
    profile: str | None = Field(None, min_length=1)


class ProviderSpec(BaseModel):
    model_config = _STRICT
    #: ``provider/model`` as LiteLLM names it.
    model: str = Field(pattern=r"^[A-Za-z0-9_-]+/\S+$")
    #: In-process backend kind (``kvgate.engines`` entry point).
    backend: str = "litellm"
    api_key_env: str | None = Field(None, pattern=_ENV)
    #: Other variables the provider needs that LiteLLM reads from the environment itself
    #: (e.g. AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION_NAME for bedrock/...):
    #: names only, checked at startup.
    env: tuple[Annotated[str, Field(pattern=_ENV)], ...] = ()
    api_base: str | None = Field(None, pattern=r"^https?://\S+$")
    #: Upper bound on one provider call, seconds.
    timeout_s: float = Field(600.0, gt=0)
    #: Retries on the same provider (429, 5xx, connection) before the first byte; 0: none.
    retries: int = Field(0, ge=0, le=5)
    #: Wait before the first retry, doubled after each (seconds).
    retry_backoff_s: float = Field(0.5, ge=0, le=60)


class ModelEntry(BaseModel):
    model_config = _STRICT
    name: str = Field(pattern=_NAME)
    aliases: tuple[str, ...] = ()
    pool: PoolSpec | None = None
    provider: ProviderSpec | None = None
    context_length: int | None = Field(None, ge=1)
    modalities: tuple[Literal["text", "image", "audio"], ...] = ("text",)
    fallbacks: tuple[str, ...] = ()
    fallback_on: frozenset[int] = DEFAULT_FALLBACK_ON
    owned_by: str | None = None

    @model_validator(mode="after")
    def _one_backend(self) -> ModelEntry:
        if (self.pool is None) == (self.provider is None):
            raise ValueError("needs exactly one of pool or provider")
        if any(not 400 <= s <= 599 for s in self.fallback_on):
            raise ValueError("fallback_on holds HTTP error statuses (400-599)")
        return self


class CatalogFile(BaseModel):
    model_config = _STRICT
    models: tuple[ModelEntry, ...] = Field(min_length=1)


#: The catalog entry a request resolved to (after alias resolution).
CATALOG_ENTRY: StateKey[ModelEntry] = StateKey("catalog-entry")


def _where(path: Path, data: object, loc: Sequence[int | str]) -> str:
    """``file: models[i] (name 'x')`` for a validation error location."""
    if len(loc) >= 2 and loc[0] == "models" and isinstance(loc[1], int):
        name = None
        models = data.get("models") if isinstance(data, dict) else None
        if isinstance(models, list) and loc[1] < len(models) and isinstance(models[loc[1]], dict):
            name = models[loc[1]].get("name")
        rest = ".".join(str(p) for p in loc[2:]) or "entry"
        return f"{path}: models[{loc[1]}] (name {name!r}): {rest}"
    return f"{path}: {'.'.join(str(p) for p in loc) or 'top level'}"


def load_catalog(path: Path) -> CatalogFile:
    """Parse and schema-check a catalog file (ConfigError naming the file and entry)."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read catalog: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from None
    try:
        return CatalogFile.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise ConfigError(f"{_where(path, data, err['loc'])}: {err['msg']}") from None


def _check_names(path: Path, parsed: CatalogFile) -> dict[str, ModelEntry]:
    """Name/alias -> entry; duplicates, bad fallbacks and unset variables are errors."""
    names: dict[str, ModelEntry] = {}
    for i, entry in enumerate(parsed.models):
        where = f"{path}: models[{i}] (name {entry.name!r})"
        for name in (entry.name, *entry.aliases):
            if name in names:
                raise ConfigError(f"{where}: {name!r} is already the name or an alias of "
                                  f"{names[name].name!r}")
            names[name] = entry
        spec = entry.provider
        needed = [] if spec is None else [(spec.api_key_env, "api_key_env")] + [
            (name, "env") for name in spec.env]
        for env, key in needed:
            if env is not None and env not in os.environ:
                raise ConfigError(f"{where}: environment variable {env} ({key}) is not set")
    canonical = {e.name for e in parsed.models}
    for i, entry in enumerate(parsed.models):
        where = f"{path}: models[{i}] (name {entry.name!r})"
        for fb in entry.fallbacks:
            if fb not in canonical or fb == entry.name:
                raise ConfigError(f"{where}: fallback {fb!r} is not another catalog model "
                                  "(use public names, not aliases)")
        if len(set(entry.fallbacks)) != len(entry.fallbacks):
            raise ConfigError(f"{where}: fallbacks list a model twice")
    return names


def _step(entry: ModelEntry) -> PoolStep | BackendStep:
    if entry.pool is not None:
        engines = None if entry.pool.engines is None else frozenset(entry.pool.engines)
        return PoolStep(entry.name, engines, entry.pool.profile)
    spec = entry.provider
    assert spec is not None
    options = {"api_key_env": spec.api_key_env, "api_base": spec.api_base,
               "timeout_s": spec.timeout_s, "retries": spec.retries,
               "retry_backoff_s": spec.retry_backoff_s}
    return BackendStep(entry.name, spec.backend, spec.model, options)


def _price_card(book: PriceBook | None, model: str) -> tuple[dict[str, str] | None, bool | None]:
    price = None if book is None else book.price(model, dt.datetime.now(dt.UTC))
    if price is None:
        return None, None
    card = {"currency": "USD", "input_per_mtok": _mtok(price.input),
            "cached_input_per_mtok": _mtok(price.cached_input),
            "output_per_mtok": _mtok(price.output)}
    if price.cache_write is not None:
        card["cache_write_per_mtok"] = _mtok(price.cache_write)
    return card, price.cached_input < price.input


def _mtok(rate: Any) -> str:
    return format((rate * MILLION).normalize(), "f")


#: The principal's model allow-list (api-keys' ``models``); None: every model.
allowed = allowed_models


@dataclass(frozen=True, slots=True)
class _Loaded:
    """One version of the catalog: swapped whole by ``Catalog.commit``."""

    file: CatalogFile
    names: dict[str, ModelEntry]
    entries: dict[str, ModelEntry]
    book: PriceBook | None
    plans: dict[str, ModelPlan]
    created: int


def _load(path: Path, prices: str | None) -> _Loaded:
    file = load_catalog(path)
    names = _check_names(path, file)
    entries = {e.name: e for e in file.models}
    try:
        book = None if prices is None else load_book(prices)
    except PriceError as exc:
        raise ConfigError(str(exc)) from None
    plans = {e.name: ModelPlan(
        (_step(e), *(_step(entries[f]) for f in e.fallbacks)), e.fallback_on)
        for e in file.models}
    try:
        created = int(path.stat().st_mtime)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read catalog: {exc.strerror}") from None
    return _Loaded(file, names, entries, book, plans, created)


def _kinds(file: CatalogFile) -> frozenset[str]:
    return frozenset(e.provider.backend for e in file.models if e.provider is not None)


def _check(file: CatalogFile, path: Path, engines: Mapping[str, frozenset[str]],
           profiles: frozenset[str], backends: frozenset[str]) -> None:
    for i, entry in enumerate(file.models):
        where = f"{path}: models[{i}] (name {entry.name!r})"
        if entry.pool is not None:
            _check_pool(where, entry.name, entry.pool, engines, profiles)
        elif entry.provider is not None and entry.provider.backend not in backends:
            known = ", ".join(sorted(backends)) or "none installed"
            raise ConfigError(f"{where}: provider backend {entry.provider.backend!r} is "
                              f"not installed (known: {known})")


def _check_pool(where: str, model: str, pool: PoolSpec,
                engines: Mapping[str, frozenset[str]], profiles: frozenset[str]) -> None:
    for engine in pool.engines or ():
        if engine not in engines:
            raise ConfigError(f"{where}: pool engine {engine!r} is not in the gateway "
                              f"config (engines: {', '.join(sorted(engines)) or 'none'})")
        served = engines[engine]
        if served and model not in served:
            raise ConfigError(f"{where}: engine {engine!r} is configured to serve "
                              f"{sorted(served)}, not {model!r}")
    if pool.profile is not None and pool.profile not in profiles:
        raise ConfigError(f"{where}: routing profile {pool.profile!r} is not in the "
                          f"gateway config (profiles: {', '.join(sorted(profiles))})")


class Catalog(Plugin, RequestHook, ModelCatalog):
    """See the module docstring and docs/catalog.md.

    Params: ``file`` (catalog YAML, required), ``prices`` (price book for the metadata:
    kvgate YAML or LiteLLM JSON, usually the billing plugin's; optional).
    """

    type_name = "catalog"
    produces: ClassVar[frozenset[str]] = frozenset({CATALOG_ENTRY.name, MODEL_PLAN.name})

    class Params(BaseModel):
        model_config = _STRICT
        file: str = Field(min_length=1)
        prices: str | None = None

    example_params = {"file": "docs/examples/catalog.yaml"}

    def __init__(self, name: str, params: BaseModel, plugins: PluginLookup) -> None:
        super().__init__(name, params, plugins)
        assert isinstance(params, Catalog.Params)
        self.path = Path(params.file)
        self.prices = params.prices
        #: What ``check`` was given (a reload is checked against the same config) and the
        #: backend kinds started with the app (a reload may not need another).
        self._checked: tuple[Mapping[str, frozenset[str]], frozenset[str],
                             frozenset[str]] | None = None
        self._started_kinds: frozenset[str] | None = None
        self.commit(self.load_new())

    # -- reload (plugins/common/reload.py)
    # -----------------------------------------------------------
    def watched(self) -> Sequence[Path]:
        return (self.path,) if self.prices is None else (self.path, Path(self.prices))

    def load_new(self) -> object:
        """The parsed and checked catalog (ConfigError: bad; the current one stays)."""
        loaded = _load(self.path, self.prices)
        if self._checked is not None:
            _check(loaded.file, self.path, *self._checked)
            new_kinds = _kinds(loaded.file) - (self._started_kinds or frozenset())
            if new_kinds:
                raise ConfigError(f"{self.path}: backend kind(s) {sorted(new_kinds)} were not "
                                  "started with the gateway: restart to add them")
        return loaded

    def commit(self, new: object) -> str:
        assert isinstance(new, _Loaded)
        self.file, self.names, self.entries = new.file, new.names, new.entries
        self.book, self.plans, self.created = new.book, new.plans, new.created
        return f"{len(self.file.models)} models"

    # -- startup ----------------------------------------------------------------------------
    def check(self, engines: Mapping[str, frozenset[str]], profiles: frozenset[str],
              backends: frozenset[str]) -> None:
        _check(self.file, self.path, engines, profiles, backends)
        self._checked = (engines, profiles, backends)
        self._started_kinds = _kinds(self.file)

    def backend_kinds(self) -> frozenset[str]:
        return _kinds(self.file)

    # -- lookups ----------------------------------------------------------------------------
    def canonical(self, name: str) -> str | None:
        """The public name for a name or alias; None when the catalog has neither."""
        entry = self.names.get(name)
        return None if entry is None else entry.name

    def _visible(self, principal: Principal | None) -> list[str]:
        allow = allowed(principal)
        return [n for n, e in self.names.items() if allow is None or e.name in allow]

    # -- request path -------------------------------------------------------------------------
    async def on_request(self, req: InferenceRequest, state: CycleState) -> None:
        entry = self.names.get(req.model)
        if entry is None:
            raise model_not_found(req.model, self._visible(req.principal))
        if req.model != entry.name:
            req.model = entry.name
            req.update_body(model=entry.name)
        state.put(CATALOG_ENTRY, entry)
        state.put(MODEL_PLAN, self.plans[entry.name])

    # -- /v1/models -----------------------------------------------------------------------------
    def card(self, entry: ModelEntry) -> dict[str, object]:
        """An OpenAI model object with kvgate's metadata added."""
        pricing, discounted = _price_card(self.book, entry.name)
        provider = entry.provider.model.split("/", 1)[0] if entry.provider else None
        return {
            "id": entry.name, "object": "model", "created": self.created,
            "owned_by": entry.owned_by or provider or "kvgate",
            "aliases": list(entry.aliases), "backend": "pool" if entry.pool else "provider",
            "context_length": entry.context_length, "modalities": list(entry.modalities),
            "pricing": pricing, "cached_tokens_discounted": discounted,
            "fallbacks": list(entry.fallbacks),
        }

    def list_models(self, principal: Principal | None) -> Sequence[Mapping[str, object]]:
        allow = allowed(principal)
        return [self.card(e) for e in self.file.models if allow is None or e.name in allow]

    def get_model(self, model_id: str, principal: Principal | None) -> Mapping[str, object]:
        entry = self.names.get(model_id)
        allow = allowed(principal)
        if entry is None or (allow is not None and entry.name not in allow):
            raise model_not_found(model_id, self._visible(principal))
        return self.card(entry)


__all__ = ["CATALOG_ENTRY", "Catalog", "ModelEntry", "load_catalog"]
