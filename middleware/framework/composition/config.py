"""Configuration: a strictly validated YAML file (or CLI flags) composing engines and plugins.

Schema errors are reported as :class:`ConfigError` naming the file, the instance and the
problem. Semantic checks that need the plugin registry (unknown types, slots, refs, state keys)
live in :mod:`kvgate.middleware.framework.composition.pipeline`. Every key is documented in
docs/config.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from kvgate.middleware.framework.errors import ConfigError
from kvgate.middleware.framework.types import Role

_STRICT = ConfigDict(extra="forbid", frozen=True)


class AccessLogConfig(BaseModel):
    """The per-request JSON access log (middleware/observe/access_log.py; docs/observability.md)."""

    model_config = _STRICT
    #: False: no line is built or written (no work per request).
    enabled: bool = True
    #: File the lines are appended to; unset: stderr (the ``kvgate.access`` logger).
    path: str | None = Field(None, min_length=1)


class ServerConfig(BaseModel):
    """HTTP server and request-path settings."""

    model_config = _STRICT
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    #: A second listener on ``host`` that serves ``/metrics`` and the full ``/health`` without
    #: a key (middleware/transport/admin_port.py), for a Prometheus scraper and probes on a network
    #: the clients do not reach. None (the default): no second listener, nothing more is exposed
    #: than before; with API keys on, those views then need an admin key on ``port``.
    admin_port: int | None = Field(None, ge=0, le=65535)
    #: Largest accepted request body. 8 MiB fits a 128k-token prompt as text (~4 bytes/token)
    #: with JSON overhead, yet bounds what one request can make the gateway hold.
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    #: Upper bound on one upstream request, connect to last byte (long generations take minutes).
    request_timeout_s: float = Field(600.0, gt=0)
    connect_timeout_s: float = Field(5.0, gt=0)
    #: Longest silence of an engine's stream after its first byte before the stream counts as
    #: broken (the client gets the API's error event, the engine's circuit breaker a failure).
    #: Decode steps are milliseconds and a preempted request resumes within seconds; 120 s
    #: finds a wedged engine (a hung GPU, a deadlocked collective) five times sooner than
    #: ``request_timeout_s`` without cutting off a merely slow one.
    stream_idle_timeout_s: float = Field(120.0, gt=0)
    #: Retries on another engine when the upstream fails before the first byte (issue: once).
    retries: int = Field(1, ge=0, le=3)
    #: Connection pool size per engine (keep-alive connections kept by the HTTP client).
    connections_per_engine: int = Field(256, ge=1)
    #: The engine call's transport for ``http://`` engines (middleware/transport/engine_call.py):
    #: ``lean``, kvgate's own HTTP/1.1 client (middleware/transport/h1client.py), or ``aiohttp``
    #: (what
    #: every other engine, ``https://`` ones, gets in any case).
    engine_client: Literal["lean", "aiohttp"] = "lean"
    #: Seed of the scheduler's random tie-breaks (reproducible routing for a given seed).
    seed: int = 0
    #: Plugin hooks are timed (``kvgate_plugin_hook_duration_seconds``) on one API request in
    #: this many: 1 times every call, 0 none. Timing every call cost ~6 % of the gateway's CPU
    #: per 1 KiB request (two clock reads and an update per hook, ~15 hooks); one in 8 keeps
    #: the latency distribution and averages, and ``_count`` counts the timed calls.
    hook_timing_every: int = Field(8, ge=0)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    access_log: AccessLogConfig = Field(default_factory=AccessLogConfig)
    #: Directory of the routing state kept across restarts (session pins, cache pressure;
    #: middleware/serving/routing_state.py), one file per fleet; relative to the working directory
    #: like ``.kvgate/secret``. ``None``: not kept.
    routing_state_dir: str | None = ".kvgate/routing-state"
    #: Seconds between routing-state snapshots (also written at shutdown): a killed gateway
    #: loses at most this much. 30 s: a snapshot of 65k pins takes a few ms on the loop.
    routing_state_save_s: float = Field(30.0, gt=0)
    # -- HTTP front-end limits (middleware/transport/h1limits.py; docs/security.md has the table)
    # --------
    #: Longest request target (the request line less its method and version) [bytes]; longer:
    #: 414. 8 KiB: the request line nginx (large_client_header_buffers 8k) and Apache
    #: (LimitRequestLine 8190) accept; kvgate's routes are short paths without queries.
    max_url_bytes: int = Field(8 * 1024, ge=256, le=1 << 20)
    #: Largest request head, request line and headers [bytes]; larger: 431. 32 KiB: nginx's
    #: default total (4 x 8k), so no client that works through nginx needs more; twice h11's
    #: and Node's 16 KiB for long bearer tokens and tracing headers. Go's 1 MiB would let the
    #: ``max_connections`` connections hold 4 GiB of heads.
    max_head_bytes: int = Field(32 * 1024, ge=1024, le=1 << 24)
    #: Most request headers [count]; more: 431. 100: Apache's LimitRequestFields and Tomcat's
    #: maxHeaderCount; an SDK sends ~15, proxies and tracing add a few dozen at most.
    max_headers: int = Field(100, ge=8)
    #: Time to receive a whole request head [s], from the connection's opening for its first
    #: request, from the head's first byte for later ones; then 408 and close (a new connection
    #: that sent nothing is just closed). 10 s: a head is one or two packets and three
    #: retransmissions of a lost one (1 + 2 + 4 s) fit; nginx's 60 s lets a slow client hold a
    #: connection six times longer (uvicorn and Go's http.Server have none by default).
    head_timeout_s: float = Field(10.0, gt=0)
    #: Time for a request body to start [s] (after its head, or its ``100 Continue``); every
    #: ``body_min_bytes_per_s`` bytes received buy one second more; slower: 408 and close.
    #: 20 s and 500 bytes/s: Apache's mod_reqtimeout default (body=20,MinRate=500): an 8 MiB
    #: body on a slow link passes, a trickle meant to hold the connection does not.
    body_timeout_s: float = Field(20.0, gt=0)
    #: Minimum body rate after ``body_timeout_s`` [bytes/s]; 0: the whole body within it.
    body_min_bytes_per_s: int = Field(500, ge=0)
    #: Time an idle keep-alive connection is kept after a response [whole s: uvicorn's setting
    #: is an int]; then closed. 30 s: longer than the client pools of the OpenAI SDK (httpx,
    #: 5 s) and aiohttp (15 s), so a client rarely sends on a connection being closed; behind
    #: a load balancer, set it above the balancer's own idle timeout (AWS ALB: 60 s).
    keep_alive_timeout_s: int = Field(30, ge=1)
    #: Most client connections one process serves at once [count]; beyond, a connection's
    #: first request gets 503 with ``Retry-After: 1`` and the connection is closed. 4096: 16
    #: engines' worth of vLLM's 256 concurrent sequences, within a service's usual file limit
    #: (65536) with the engine connections. Per process: ``--workers N`` serves N times it.
    max_connections: int = Field(4096, ge=1)

    @model_validator(mode="after")
    def _two_ports(self) -> ServerConfig:
        if self.admin_port is not None and self.admin_port == self.port != 0:
            raise ValueError(f"admin_port {self.admin_port} is the API port: give another one")
        return self


class PoolConfig(BaseModel):
    """Engine health probing and metrics scraping."""

    model_config = _STRICT
    health_interval_s: float = Field(2.0, gt=0)
    health_timeout_s: float = Field(2.0, gt=0)
    metrics_interval_s: float = Field(2.0, gt=0)
    #: Consecutive failed probes before an engine is marked unhealthy (a connection error on the
    #: request path marks it at once).
    unhealthy_after: int = Field(2, ge=1)
    #: How long startup waits for the first probe round before serving.
    startup_probe_timeout_s: float = Field(5.0, ge=0)
    #: Request failures in a row (timeouts, 5xx, broken streams) that open an engine's circuit
    #: breaker (middleware/fleet/breaker.py). 3: one or two failures are routine (a retried 503, a
    #: restart), three in a row is an engine that fails what it is sent.
    breaker_failures: int = Field(3, ge=1)


class EngineConfig(BaseModel):
    """One engine endpoint."""

    model_config = _STRICT
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    url: str
    kind: str = "vllm"
    role: Role = Role.BOTH
    #: Models it serves; empty: discovered from the engine's ``/v1/models``.
    models: tuple[str, ...] = ()
    #: ZMQ address of its KV events (used by the KV-event plugins).
    kv_events: str | None = None
    #: ZMQ address of its KV-event replay socket (vLLM's ``replay_endpoint``, a ROUTER the
    #: engine binds; a ``*`` host becomes the URL's host): lost batches are asked for there.
    kv_events_replay: str | None = None
    #: Name of an environment variable holding the engine's API key (never the key itself).
    api_key_env: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {value!r}")
        return value.rstrip("/")


class PluginConfig(BaseModel):
    """A plugin instance: its registered ``type``, an optional unique ``name``, its params."""

    model_config = _STRICT
    type: str = Field(min_length=1)
    name: str | None = None
    params: dict[str, Any] = Field(default_factory=dict)

    @property
    def instance_name(self) -> str:
        return self.name or self.type


class ProfileRef(BaseModel):
    model_config = _STRICT
    ref: str = Field(min_length=1)
    #: Only for scorers: the scorer's [0, 1] score is multiplied by this.
    weight: float | None = Field(None, ge=0)


class ProfileConfig(BaseModel):
    """A scheduling profile: filters, weighted scorers and exactly one picker, in order."""

    model_config = _STRICT
    name: str = Field(min_length=1)
    plugins: tuple[ProfileRef, ...]


class DisaggregationConfig(BaseModel):
    """Prefill/decode disaggregation: how a request with a prefill target is split in two hops.

    Used when the profile handler's decision names a prefill engine (docs/disaggregation.md).
    """

    model_config = _STRICT
    #: A ``kvgate.connectors`` entry point (e.g. ``vllm-nixl``, ``vllm-mooncake``, ``sglang``).
    connector: str = Field(min_length=1)
    #: The connector's own parameters (validated by its ``Params`` model at startup).
    params: dict[str, Any] = Field(default_factory=dict)
    #: Concurrent connectors: once decode has answered, how long to wait for the prefill hop's
    #: answer (its cache hit, for usage) before giving up on it. 1 s: the prefill answer is due
    #: before decode's first token, so only a lost answer waits this long.
    settle_timeout_s: float = Field(1.0, ge=0)


class SharedStateConfig(BaseModel):
    """State that several gateway replicas (or ``--workers``) must agree on (docs/operations.md).

    ``redis_url`` is the default of every plugin parameter named ``redis_url`` that the config
    leaves unset: one key turns sharing on for every plugin able to share. It may embed a
    password and is never logged.
    """

    model_config = _STRICT
    redis_url: str = Field(pattern=r"^rediss?://")
    #: How long each Responses id the gateway hands out stays resolvable on every replica
    #: (its owner and engine in Redis; middleware/serving/shared_states.py) [s]. Default one day.
    state_ids_ttl_s: float = Field(86_400.0, gt=0, le=30 * 86_400)


class TracingConfig(BaseModel):
    """OpenTelemetry tracing (middleware/observe/tracing.py; docs/observability.md). Needs the
    ``tracing`` extra; absent: off, no cost per request."""

    model_config = _STRICT
    #: OTLP/HTTP base URL (spans go to its ``/v1/traces``); unset: the standard
    #: ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``..._TRACES_ENDPOINT``) environment variable.
    otlp_endpoint: str | None = Field(None, pattern=r"^https?://")
    #: The ``service.name`` resource attribute of every span.
    service_name: str = Field("kvgate", min_length=1)
    #: Share of new traces kept (a client's sampled ``traceparent`` is always followed).
    sample_ratio: float = Field(1.0, ge=0, le=1)


class GatewayConfig(BaseModel):
    """The whole gateway configuration."""

    model_config = _STRICT
    server: ServerConfig = Field(default_factory=ServerConfig)
    pool: PoolConfig = Field(default_factory=PoolConfig)
    engines: tuple[EngineConfig, ...] = ()
    plugins: tuple[PluginConfig, ...] = ()
    profiles: tuple[ProfileConfig, ...] = ()
    #: Plugin instance implementing ProfileHandler; required with more than one profile.
    profile_handler: str | None = None
    #: Two-hop dispatch settings; ``None``: decisions naming a prefill engine are served by
    #: their decode target alone.
    disaggregation: DisaggregationConfig | None = None
    #: Options of client API adapters by adapter name (``kvgate.apis`` entry point), each
    #: validated at startup against that adapter's ``Params`` model
    #: (middleware/framework/composition/registry.py).
    apis: dict[str, dict[str, Any]] = Field(default_factory=dict)
    #: Shared state between replicas (``kvgate serve --redis URL``); ``None``: each process
    #: keeps its own (one replica).
    shared_state: SharedStateConfig | None = None
    #: OpenTelemetry tracing; ``None``: off.
    tracing: TracingConfig | None = None
    #: Where this config came from (for error messages); not a YAML key.
    source: str = Field("<config>", exclude=True)


def _format_loc(loc: tuple[int | str, ...], data: dict[str, Any]) -> str:
    """``plugins[2] (name 'x', type 'y').params`` from a pydantic error location."""
    out = ""
    node: Any = data
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
            node = node[part] if isinstance(node, list) and part < len(node) else None
            if isinstance(node, dict) and ("name" in node or "type" in node):
                desc = ", ".join(f"{k} {node[k]!r}" for k in ("name", "type") if k in node)
                out += f" ({desc})"
        else:
            out += f".{part}" if out else str(part)
            node = node.get(part) if isinstance(node, dict) else None
    return out or "<top level>"


def parse_config(data: object, source: str) -> GatewayConfig:
    """Validate a parsed YAML document; errors name the source and the offending instance."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping, got {type(data).__name__}")
    try:
        return GatewayConfig.model_validate({**data, "source": source})
    except ValidationError as exc:
        problems = [
            f"{source}: {_format_loc(tuple(err['loc']), data)}: {err['msg']}"
            for err in exc.errors()
        ]
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems)) from None


def load_config(path: str | Path) -> GatewayConfig:
    """Read and validate a YAML config file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from None
    return parse_config(data, str(p))


def with_billing(
    config: GatewayConfig, *, prices: str | None = None, ledger: str | None = None,
    keys: str | None = None,
) -> GatewayConfig:
    """``config`` with ``kvgate serve --prices FILE --ledger URL --keys FILE`` applied.

    Flags override the params of the config's ``billing`` / ``api-keys`` plugins; when the
    config has none, ``--prices`` adds both in front of its plugins (API keys from ``--keys``,
    or authentication switched off, which the api-keys plugin announces at startup); with
    ``--keys``, a ``cache-salt`` plugin too when it has none (tenants' cache salts). Plugins
    are named by type only: this is configuration data, the core imports none of them.
    """
    if prices is None and ledger is None and keys is None:
        return config
    data = config.model_dump(exclude={"source"})
    plugins: list[dict[str, Any]] = data["plugins"]
    has = {p["type"] for p in plugins}
    if "billing" not in has and prices is None:
        raise ConfigError("--ledger and --keys need --prices (or a billing plugin in the config)")
    added = [] if "api-keys" in has else [{"type": "api-keys", "params": {"disabled": True}}]
    if "billing" not in has:
        added.append({"type": "billing", "params": {}})
    if keys is not None and "cache-salt" not in has:  # tenant isolation of the engines' caches
        added.append({"type": "cache-salt", "params": {}})
    for plugin in [*added, *plugins]:
        params = plugin["params"]
        if plugin["type"] == "billing":
            params.update({k: v for k, v in (("prices", prices), ("ledger", ledger)) if v})
        elif plugin["type"] == "api-keys" and keys is not None:
            params.update({"file": keys, "disabled": False})
    data["plugins"] = [*added, *plugins]
    return parse_config(data, config.source)


def with_quotas(config: GatewayConfig) -> GatewayConfig:
    """``config`` with a ``quotas`` plugin when it authenticates with API keys (a keys file, or
    keys in Redis) and has none:
    the limits and budgets written in the keys file are enforced without more configuration.
    It goes after the ``api-keys`` and ``billing`` plugins (it prices budgets with billing).
    """
    data = config.model_dump(exclude={"source"})
    plugins: list[dict[str, Any]] = list(data["plugins"])
    types = [p["type"] for p in plugins]
    shared = config.shared_state is not None  # keys may live in Redis alone (no file)
    keyed = any(p["type"] == "api-keys" and not p["params"].get("disabled")
                and (p["params"].get("file") or p["params"].get("redis_url") or shared)
                for p in plugins)
    if not keyed or "quotas" in types:
        return config
    after = max(i for i, t in enumerate(types) if t in ("api-keys", "billing"))
    plugins.insert(after + 1, {"type": "quotas", "params": {}})
    data["plugins"] = plugins
    return parse_config(data, config.source)


def with_shared_state(config: GatewayConfig, redis_url: str | None) -> GatewayConfig:
    """``config`` with ``kvgate serve --redis URL`` applied (the flag wins over the file)."""
    if redis_url is None:
        return config
    data = config.model_dump(exclude={"source"})
    data["shared_state"] = {**(data.get("shared_state") or {}), "redis_url": redis_url}
    return parse_config(data, config.source)


def plugin_param_defaults(config: GatewayConfig) -> dict[str, Any]:
    """Top-level settings that become defaults of plugin params of the same name."""
    if config.shared_state is None:
        return {}
    return {"redis_url": config.shared_state.redis_url}


#: ``kvgate serve --pd-protocol`` values -> ``kvgate.connectors`` names.
PD_CONNECTORS: dict[str, str] = {
    "nixl": "vllm-nixl", "mooncake": "vllm-mooncake", "sglang": "sglang",
}
