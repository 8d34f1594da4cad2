"""``cache-salt``: tenant isolation of the engines' prefix caches (docs/operations.md "Tenant
isolation").

Why. An engine with prefix caching answers a prompt whose prefix it holds faster (and reports
it in ``cached_tokens``). Without isolation, tenant B can learn whether tenant A recently sent
a prompt starting with some text by timing B's own request with that text: a prefix-caching
timing side channel. vLLM keys its cache by an optional ``cache_salt`` per request (in the
first block's extra keys, so every block of the chain depends on it): requests with different
salts never share a block.

What (RequestHook, runs before any data producer hashes the prompt):

* For an authenticated request (a principal with a tenant) of an API in ``apis`` (those vLLM
  0.32 accepts ``cache_salt`` on: chat, completions, responses, messages, embeddings), the
  engine body gets ``cache_salt = "kvg1." + base64url(HMAC-SHA256(K, "tenant\\0" + tenant)[:24])``
  with ``K`` the gateway secret's ``cache-salt`` key (plugins/tenancy/gateway_secret.py): 37
  characters of ``[A-Za-z0-9_.-]``, within vLLM's rule (at most 128 characters, no ``@ / \\``
  or NUL), 192 bits, not computable from the tenant name without the secret. Replicas with the
  same secret derive the same salt.
* Opt-in sharing: the tenants of a group in ``share_groups`` all get the group's salt
  (``"group\\0" + name``): their requests share cached prefixes (a public system prompt), and
  can therefore time each other's. A tenant is in at most one group.
* A client's own ``cache_salt`` is replaced (``client_salt: replace``, the default: a tenant
  must not pick a salt, another tenant's included). ``client_salt: keep`` forwards a client's
  salt as sent (deployments whose clients salt per end-user themselves) and injects the
  derived salt only when the body has none.
* The salt is put in the ``cache-salt`` state key (plugins/common/state.py): the prefix-cache
  producer hashes the prompt with it exactly as vLLM does (so predictions match the engines'
  KV events and reported ``cached_tokens``) and keys its own record by it.

The plugin is active only when the authenticator named by ``auth`` (``api-keys``) is declared
before it and switched on; then it loads the gateway secret at startup. Inactive (no
authenticator: the default preset without ``--keys``; ``disabled: true``: one local tenant),
it injects nothing and the client's body goes to the engine unchanged; an authenticated request
reaching an inactive plugin is said once in a WARNING (declare ``api-keys`` first). Only vLLM
takes ``cache_salt``; an SGLang engine ignores unknown fields and isolates nothing: tenants
whose requests reach it share its prefix cache (a timing side channel). So an SGLang engine in
the pool (kind ``sglang``, or labelled ``engine: sglang``, as ``kvgate deploy`` labels an SGLang
fleet) while salting is on (or the keys hold more than one tenant) is named in a WARNING at
startup, in this plugin's ``/health`` section (``unisolated_engines``) and by the gauge
``kvgate_cache_salt_unisolated_engines`` (docs/security.md, "SGLang and cache_salt"). State:
none per request beyond the state key; counters per outcome (bounded: four labels); the SGLang
engines' names (bounded by the pool).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import ClassVar, Literal

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from kvgate.middleware.framework.errors import ConfigError
from kvgate.middleware.framework.plugin import (
    EndpointSetListener,
    HealthSource,
    MetricsSource,
    Plugin,
    PluginLookup,
    RequestHook,
)
from kvgate.middleware.framework.types import CycleState, Endpoint, InferenceRequest
from kvgate.plugins.common.state import CACHE_SALT
from kvgate.plugins.tenancy.gateway_secret import (
    CACHE_SALT_PURPOSE,
    DEFAULT_ENV,
    DEFAULT_FILE,
    GatewaySecret,
    load_secret,
)

log = logging.getLogger("kvgate.plugins.cache_salt")

#: Prefix of a derived salt (versioned with the derivation).
SALT_PREFIX = "kvg1."
#: The APIs vLLM 0.32 accepts ``cache_salt`` on (docs/simulator.md lists the file:line).
SALTED_APIS = frozenset({"chat", "completions", "responses", "messages", "embeddings"})
_NAME = r"^[A-Za-z0-9._:-]{1,128}$"
#: Outcomes counted in ``kvgate_cache_salt_requests_total``.
OUTCOMES = ("tenant", "group", "client_kept", "not_salted")


def derive_salt(key: bytes, scope: str) -> str:
    """The salt of one scope (``tenant\\0<name>`` or ``group\\0<name>``): ``kvg1.`` + 32
    base64url characters of ``HMAC-SHA256(key, scope)`` (its first 24 bytes)."""
    mac = hmac.new(key, scope.encode(), hashlib.sha256).digest()[:24]
    return SALT_PREFIX + base64.urlsafe_b64encode(mac).decode()


def is_sglang(ep: Endpoint) -> bool:
    """An SGLang engine: kind ``sglang``, or labelled ``engine: sglang``."""
    return ep.kind == "sglang" or ep.labels.get("engine") == "sglang"


def tenant_scope(tenant: str) -> str:
    return "tenant\x00" + tenant


def group_scope(group: str) -> str:
    return "group\x00" + group


class CacheSalt(Plugin, RequestHook, MetricsSource, HealthSource, EndpointSetListener):
    """Plugin ``cache-salt`` (see the module docstring and docs/operations.md)."""

    type_name: ClassVar[str] = "cache-salt"
    produces: ClassVar[frozenset[str]] = frozenset({CACHE_SALT.name})

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)
        #: Environment variable holding the gateway secret (>= 32 characters); shared by
        #: every replica.
        secret_env: str = DEFAULT_ENV
        #: The secret's file when the variable is unset (created, mode 0600, if absent).
        secret_file: str = DEFAULT_FILE
        #: Shared state: the secret is kept in Redis (default ``shared_state.redis_url``), so
        #: every replica derives the same salts; wins over ``secret_file``.
        redis_url: SecretStr | None = None
        #: APIs whose engine body gets the salt (adapter names).
        apis: frozenset[str] = SALTED_APIS
        #: ``replace``: a client's ``cache_salt`` is replaced; ``keep``: forwarded as sent.
        client_salt: Literal["replace", "keep"] = "replace"
        #: Opt-in sharing: group name -> tenants that share one salt (a public system prompt).
        share_groups: dict[str, frozenset[str]] = Field(default_factory=dict)
        #: The authenticator plugin, declared before this one; absent or switched off
        #: (``disabled``): the plugin is inactive and injects nothing.
        auth: str = "api-keys"

        @model_validator(mode="after")
        def _one_group_each(self) -> CacheSalt.Params:
            seen: dict[str, str] = {}
            for group, tenants in self.share_groups.items():
                for tenant in tenants:
                    if tenant in seen:
                        raise ValueError(f"tenant {tenant!r} is in share_groups {seen[tenant]!r}"
                                         f" and {group!r}: at most one group per tenant")
                    seen[tenant] = group
            return self

    example_params: ClassVar[Mapping[str, object]] = {
        "secret_file": "/tmp/kvgate-example-secret", "share_groups": {"public": ["acme"]},
    }

    def __init__(self, name: str, params: BaseModel, plugins: PluginLookup,
                 secret: GatewaySecret | None = None) -> None:
        super().__init__(name, params, plugins)
        assert isinstance(params, CacheSalt.Params)
        self.p = params
        self._groups = {t: g for g, ts in params.share_groups.items() for t in ts}
        self.counts = dict.fromkeys(OUTCOMES, 0)
        self._auth: object = None
        self.active = self._auth_on(plugins)
        #: SGLang engines in the pool (they ignore cache_salt).
        self.sglang: set[str] = set()
        self.secret: GatewaySecret | None = None
        self._key = b""
        self._warned = False
        if self.active:
            url = params.redis_url.get_secret_value() if params.redis_url else None
            self.secret = secret or load_secret(params.secret_env, params.secret_file,
                                                redis_url=url)
            self._key = self.secret.derive(CACHE_SALT_PURPOSE)
        else:
            log.info("cache-salt: no authenticator %r switched on before it: no salt is "
                     "injected", params.auth)

    def _auth_on(self, plugins: PluginLookup) -> bool:
        try:
            found = self._auth = plugins.lookup(self.p.auth)
        except (ConfigError, KeyError):  # not declared (before this plugin)
            return False
        return getattr(found, "disabled", False) is not True

    def _tenants(self) -> int:
        """Tenants of the authenticator's live keys (0 when it has no key index)."""
        by_id = getattr(getattr(self._auth, "index", None), "by_id", None)
        if not isinstance(by_id, Mapping):
            return 0
        return len({getattr(key, "tenant", None) for key in by_id.values()})

    def unisolated(self) -> list[str]:
        """The SGLang engines whose cache tenants share while salting is on (or the keys hold
        several tenants): a prefix-caching timing side channel between them."""
        if not self.sglang or not (self.active or self._tenants() > 1):
            return []
        return sorted(self.sglang)

    def on_endpoints_changed(self, added: Sequence[Endpoint],
                             removed: Sequence[Endpoint]) -> None:
        """Track the SGLang engines; new ones that tenants would share are said in a WARNING
        (at startup: the pool announces every engine)."""
        before = set(self.sglang)
        self.sglang = (before - {ep.id for ep in removed}) | {
            ep.id for ep in added if is_sglang(ep)}
        new = sorted(set(self.unisolated()) - before)
        if new:
            log.warning("cache-salt: SGLang engine(s) %s ignore cache_salt: tenants whose "
                        "requests reach them share their prefix cache and can time each "
                        "other's prompts (docs/security.md, SGLang and cache_salt)",
                        ", ".join(new))

    def salt_for(self, tenant: str) -> str:
        """The salt of ``tenant``'s requests (its group's when it shares one)."""
        group = self._groups.get(tenant)
        scope = tenant_scope(tenant) if group is None else group_scope(group)
        return derive_salt(self._key, scope)

    async def on_request(self, req: InferenceRequest, state: CycleState) -> None:
        tenant = req.tenant
        if not self.active or tenant is None or req.api_name not in self.p.apis:
            self.counts["not_salted"] += 1
            if not self.active and tenant is not None and not self._warned:
                self._warned = True
                log.warning("cache-salt: requests are authenticated but no salt is injected: "
                            "declare the authenticator %r before cache-salt", self.p.auth)
            return
        sent = req.body.get("cache_salt")
        if self.p.client_salt == "keep" and isinstance(sent, str) and sent:
            self.counts["client_kept"] += 1
            state.put(CACHE_SALT, sent)
            return
        salt = self.salt_for(tenant)
        self.counts["group" if tenant in self._groups else "tenant"] += 1
        if sent != salt:
            req.update_body(cache_salt=salt)
        state.put(CACHE_SALT, salt)

    def collector(self) -> Collector:
        return _Counts(self)

    def health(self) -> Mapping[str, object]:
        """Where the secret came from (never the secret or a salt) and the groups' sizes."""
        out: dict[str, object] = {
            "secret": None if self.secret is None else self.secret.source.split(" ", 1)[0],
            "injecting": self.active,
            "client_salt": self.p.client_salt,
            "share_groups": {g: len(ts) for g, ts in sorted(self.p.share_groups.items())},
        }
        unisolated = self.unisolated()
        if unisolated:
            out["unisolated_engines"] = unisolated
            out["warning"] = ("SGLang ignores cache_salt: tenants share these engines' prefix "
                              "caches (a timing side channel; docs/security.md)")
        return out


class _Counts(Collector):
    def __init__(self, plugin: CacheSalt) -> None:
        self._plugin = plugin
        self._counts = plugin.counts

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "kvgate_cache_salt_requests", "Requests by cache-salt outcome (tenant: the tenant's "
            "own salt; group: an opt-in sharing group's; client_kept: the client's salt, "
            "client_salt keep; not_salted: no principal, auth off, or an API without salts)",
            labels=["outcome"])
        for outcome in OUTCOMES:
            family.add_metric([outcome], self._counts[outcome])
        yield family
        yield GaugeMetricFamily(
            "kvgate_cache_salt_unisolated_engines", "SGLang engines in the pool while tenants "
            "are salted apart (or several): they ignore cache_salt, so tenants share their "
            "prefix caches", value=len(self._plugin.unisolated()))


__all__ = ["SALTED_APIS", "CacheSalt", "derive_salt", "group_scope", "is_sglang",
           "tenant_scope"]
