"""``kvgate deploy render``: launch commands and configs for a prefill/decode fleet, from one YAML.

Input (see docs/disaggregation.md, "Deploying a fleet")::

    model: meta-llama/Llama-3.1-8B-Instruct
    protocol: nixl            # nixl | mooncake | lmcache-mooncake | sglang
    gateway: {host: 0.0.0.0, port: 8080}
    mooncake_master: {host: 10.0.0.1, rpc_port: 50051, metrics_port: 9003}  # lmcache-mooncake
    engine_args: ["--max-model-len", "32768"]     # appended to every engine command
    pools:
      prefill: [{host: 10.0.0.2, port: 8100, gpus: "0"}]
      decode:  [{host: 10.0.0.3, port: 8200, gpus: "0"}]

Output files (a name -> text mapping; the command writes them into a directory):

* ``<role>-<i>.sh`` per engine: environment and the engine command (vLLM with NixlConnector,
  MooncakeConnector or LMCacheConnectorV1; SGLang with ``--disaggregation-mode``);
* ``lmcache-<role>-<i>.yaml`` (lmcache-mooncake): LMCache with a Mooncake Store backend;
* ``mooncake-master.sh`` (lmcache-mooncake): the Mooncake master;
* ``kvgate.yaml``: the gateway config (engines with roles and bootstrap labels, the P/D
  profile, the matching connector);
* ``README.txt``: start order.

Rendering is pure (:func:`render`); only the command writes files.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvgate.engines.deploy.k8s_spec import KubernetesSpec
from kvgate.middleware.framework.composition.quickstart import QuickStart, quick_start_config
from kvgate.middleware.framework.errors import ConfigError

Protocol = Literal["nixl", "mooncake", "lmcache-mooncake", "sglang"]
_STRICT = ConfigDict(extra="forbid", frozen=True)

#: Gateway connector per protocol (``kvgate.connectors`` names).
CONNECTOR: dict[str, str] = {"nixl": "vllm-nixl", "mooncake": "vllm-mooncake",
                             "lmcache-mooncake": "shared-store", "sglang": "sglang"}


class EngineSpec(BaseModel):
    model_config = _STRICT
    host: str = Field(min_length=1)
    port: int = Field(ge=1, le=65535)
    #: ``CUDA_VISIBLE_DEVICES`` of the engine (e.g. ``"0"`` or ``"0,1"``).
    gpus: str = "0"
    #: NIXL side channel / Mooncake or SGLang bootstrap port. Default: 5600 + i for NIXL,
    #: 8998 + i otherwise (unique per engine on a host).
    side_port: int | None = Field(None, ge=1, le=65535)
    #: Extra arguments for this engine only.
    args: tuple[str, ...] = ()


class Pools(BaseModel):
    """Either ``prefill`` and ``decode`` (P/D disaggregation) or ``engines`` alone (no P/D:
    each engine serves whole requests; the gateway names them ``engine-<i>``)."""

    model_config = _STRICT
    prefill: tuple[EngineSpec, ...] = ()
    decode: tuple[EngineSpec, ...] = ()
    engines: tuple[EngineSpec, ...] = ()

    @model_validator(mode="after")
    def _one_shape(self) -> Pools:
        pd = bool(self.prefill) and bool(self.decode)
        if pd == bool(self.engines) or (not pd and (self.prefill or self.decode)):
            raise ValueError("give pools.prefill and pools.decode (P/D), or pools.engines "
                             "alone (no P/D)")
        return self

    def of(self, role: str) -> tuple[EngineSpec, ...]:
        """The engines of ``role`` (``prefill``, ``decode`` or ``engine``)."""
        return self.engines if role == "engine" else getattr(self, role)

    def roles(self) -> list[tuple[str, tuple[EngineSpec, ...]]]:
        """The non-empty pools in gateway order."""
        return [(r, self.of(r)) for r in ("prefill", "decode", "engine") if self.of(r)]


class MasterSpec(BaseModel):
    model_config = _STRICT
    host: str = "127.0.0.1"
    rpc_port: int = Field(50051, ge=1, le=65535)
    metrics_port: int = Field(9003, ge=1, le=65535)
    #: Address of the master's HTTP admin/metrics server (``/metrics``, ``/health``,
    #: ``/get_all_keys``: it lists every key). Default: ``host``; ``mooncake_master`` alone would
    #: bind it to 0.0.0.0.
    metrics_host: str | None = None


class GatewaySpec(BaseModel):
    model_config = _STRICT
    host: str = "0.0.0.0"
    port: int = Field(8080, ge=1, le=65535)


class FleetSpec(BaseModel):
    model_config = _STRICT
    model: str = Field(min_length=1)
    protocol: Protocol = "nixl"
    pools: Pools
    gateway: GatewaySpec = Field(default_factory=GatewaySpec)
    mooncake_master: MasterSpec = Field(default_factory=MasterSpec)
    engine_args: tuple[str, ...] = ()
    #: LMCache chunk size in tokens (256: LMCache's default; keys hash 256-token chunks).
    lmcache_chunk_size: int = Field(256, ge=16)
    #: Mooncake transfer protocol: ``rdma`` on GPU fleets, ``tcp`` where there is no RDMA.
    transfer_protocol: Literal["rdma", "tcp"] = "rdma"
    #: First port of the engines' KV-event publishers: each engine binds ``tcp://*:<port>``,
    #: the n-th engine on a host ``kv_events_port + n`` (5557: vLLM's default endpoint).
    kv_events_port: int = Field(5557, ge=1, le=65535)
    #: First port of the vLLM engines' KV-event replay sockets (vLLM's ``replay_endpoint``:
    #: the last 10,000 batches, asked for by the gateway on a lost batch and at first contact
    #: for the history), counted up per host like ``kv_events_port``; 200 above it keeps
    #: clear of the publishers' and the NIXL side channels' (5600 + i) ranges. ``None``: no
    #: replay socket. SGLang engines get none (their publisher is not configured with one).
    kv_events_replay_port: int | None = Field(5757, ge=1, le=65535)
    #: The model's folder *on the gateway host* (tokenizer.json + chat template): with it the
    #: gateway matches the engines' KV events exactly; without it routing is approximate.
    tokenizer: str | None = None
    #: The model's tool-call parser (vLLM: ``hermes``, ``llama3_json``, ``qwen3_coder`` ...;
    #: SGLang: ``qwen25``, ``llama3`` ...): engines get ``--enable-auto-tool-choice
    #: --tool-call-parser NAME`` (vLLM) / ``--tool-call-parser NAME`` (SGLang). Coding agents
    #: need it: Claude Code and Codex send tools with automatic choice, which vLLM refuses
    #: (400) without it. It depends on the model, so there is no default; README.txt says so.
    tool_call_parser: str | None = None
    #: vLLM's Responses store (``VLLM_ENABLE_RESPONSES_API_STORE=1``): ``previous_response_id``
    #: and ``GET /v1/responses/{id}`` answered by the engine. Off by default: vLLM keeps every
    #: stored response in the engine's memory, never evicted, and loses them on a restart
    #: (Codex sends ``store: false`` with the whole input and needs none of it).
    responses_store: bool = False
    #: lmcache-mooncake only: LMCache stores its chunks in the Mooncake Store through the
    #: lossless BF16 KV codec (``engines/kvcodec/lmcache_plugin.py``, a remote storage plugin;
    #: ~1/3 fewer bytes on real K/V, docs/shared-tier.md). ``false``: LMCache's own Mooncake
    #: connector with ``remote_serde: naive`` (raw bytes). With it on, the engine needs the
    #: ``kvgate`` package importable: on Kubernetes an init container copies it from the
    #: gateway image (engines/deploy/k8s.py); elsewhere ``pip install --no-deps kvgate``.
    kv_codec: bool = True
    #: ``--target k8s`` / ``helm`` only (docs/kubernetes.md): images, replicas, Secret names.
    kubernetes: KubernetesSpec = Field(default_factory=KubernetesSpec)


def _side_port(spec: EngineSpec, protocol: str, i: int) -> int:
    if spec.side_port is not None:
        return spec.side_port
    return (5600 if protocol == "nixl" else 8998) + i


def _compact(data: dict[str, Any]) -> str:
    return json.dumps(data, separators=(",", ":"))


def kv_events_ports(fleet: FleetSpec) -> dict[tuple[str, int], int]:
    """The KV-event port of each engine (by role and index): per host, counting up."""
    ports: dict[tuple[str, int], int] = {}
    per_host: dict[str, int] = {}
    for role, specs in fleet.pools.roles():
        for i, spec in enumerate(specs):
            n = per_host.get(spec.host, 0)
            per_host[spec.host] = n + 1
            ports[(role, i)] = fleet.kv_events_port + n
    return ports


def replay_port(fleet: FleetSpec, events_port: int) -> int | None:
    """The replay socket's port of the vLLM engine publishing on ``events_port`` (None: off)."""
    if fleet.kv_events_replay_port is None or fleet.protocol == "sglang":
        return None
    return fleet.kv_events_replay_port + events_port - fleet.kv_events_port


def _kv_events_config(port: int, replay: int | None = None) -> str:
    """Prefix-cache events published on ``tcp://*:<port>`` with the engine's default (empty)
    topic: the gateway connects one socket per engine, so no topic convention is needed;
    with ``replay``, vLLM's replay socket on ``tcp://*:<replay>``."""
    config: dict[str, Any] = {"enable_kv_cache_events": True, "publisher": "zmq",
                              "endpoint": f"tcp://*:{port}"}
    if replay is not None:
        config["replay_endpoint"] = f"tcp://*:{replay}"
    return _compact(config)


def _vllm(
    fleet: FleetSpec, spec: EngineSpec, kv_config: dict[str, Any] | None, events: int
) -> str:
    transfer = [] if kv_config is None else ["--kv-transfer-config", _compact(kv_config)]
    args = ["vllm", "serve", fleet.model, "--host", "0.0.0.0", "--port", str(spec.port),
            "--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--kv-events-config", _kv_events_config(events, replay_port(fleet, events)),
            *transfer,
            *_tool_args(fleet, auto_flag=True), *fleet.engine_args, *spec.args]
    return shlex.join(args)


def _agent_notes(fleet: FleetSpec) -> str:
    if fleet.tool_call_parser is not None:
        return ""
    return ("\nNote: no tool_call_parser in the fleet file: the engines refuse requests with "
            "automatic tool choice (Claude Code, Codex and most coding agents send them) with "
            "a 400. Set tool_call_parser to the model's parser (vLLM --tool-call-parser).\n")


def _tool_args(fleet: FleetSpec, *, auto_flag: bool) -> list[str]:
    if fleet.tool_call_parser is None:
        return []
    auto = ["--enable-auto-tool-choice"] if auto_flag else []
    return [*auto, "--tool-call-parser", fleet.tool_call_parser]


def _env(pairs: list[tuple[str, str]]) -> str:
    return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in pairs)


def _script(name: str, env: list[tuple[str, str]], command: str) -> str:
    return (f"#!/bin/sh\n# kvgate deploy render: {name}\nset -e\ncd \"$(dirname \"$0\")\"\n"
            f"{_env(env)}exec {command}\n")


def _engine_files(fleet: FleetSpec, role: str, i: int, spec: EngineSpec) -> dict[str, str]:
    env, cmd, files = engine_launch(fleet, role, i, spec)
    files[f"{role}-{i}.sh"] = _script(f"{role}-{i}", env, cmd)
    return files


def engine_launch(
    fleet: FleetSpec, role: str, i: int, spec: EngineSpec
) -> tuple[list[tuple[str, str]], str, dict[str, str]]:
    """One engine's environment, command line and extra files (LMCache config)."""
    name = f"{role}-{i}"
    events = kv_events_ports(fleet)[(role, i)]
    proto = fleet.protocol
    side = _side_port(spec, proto, i)
    env = [("CUDA_VISIBLE_DEVICES", spec.gpus)]
    if fleet.responses_store and proto != "sglang":
        env.append(("VLLM_ENABLE_RESPONSES_API_STORE", "1"))
    files: dict[str, str] = {}
    kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
    if role == "engine" and proto != "lmcache-mooncake":  # no P/D: no KV transfer
        return env, _plain(fleet, spec, events), files
    if proto == "nixl":
        env += [("VLLM_NIXL_SIDE_CHANNEL_HOST", spec.host),
                ("VLLM_NIXL_SIDE_CHANNEL_PORT", str(side))]
        cmd = _vllm(fleet, spec, {"kv_connector": "NixlConnector", "kv_role": kv_role}, events)
    elif proto == "mooncake":
        mooncake_env, kv_config = _mooncake(fleet, role, spec, side)
        env += mooncake_env
        cmd = _vllm(fleet, spec, kv_config, events)
    elif proto == "lmcache-mooncake":
        env += [("LMCACHE_CONFIG_FILE", f"lmcache-{name}.yaml")]
        files[f"lmcache-{name}.yaml"] = _lmcache_config(fleet, spec)
        cmd = _vllm(fleet, spec, {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"},
                    events)
    else:
        cmd = shlex.join([
            "python", "-m", "sglang.launch_server", "--model-path", fleet.model,
            "--host", "0.0.0.0", "--port", str(spec.port), "--disaggregation-mode", role,
            "--disaggregation-bootstrap-port", str(side),
            "--disaggregation-transfer-backend", "mooncake", "--enable-cache-report",
            "--kv-events-config", _kv_events_config(events),
            *_tool_args(fleet, auto_flag=False), *fleet.engine_args, *spec.args])
    return env, cmd, files


def _plain(fleet: FleetSpec, spec: EngineSpec, events: int) -> str:
    if fleet.protocol != "sglang":
        return _vllm(fleet, spec, None, events)
    return shlex.join([
        "python", "-m", "sglang.launch_server", "--model-path", fleet.model, "--host", "0.0.0.0",
        "--port", str(spec.port), "--enable-cache-report",
        "--kv-events-config", _kv_events_config(events),
        *_tool_args(fleet, auto_flag=False), *fleet.engine_args, *spec.args])


def _mooncake(
    fleet: FleetSpec, role: str, spec: EngineSpec, side: int
) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    """Environment and ``--kv-transfer-config`` of a vLLM 0.32 MooncakeConnector engine.

    Prefill (``kv_producer``) engines start the bootstrap server on
    ``VLLM_MOONCAKE_BOOTSTRAP_PORT`` (bound on 0.0.0.0, so unique per host: ``side``); decode
    (``kv_consumer``) engines start none and learn the address per request. ``VLLM_HOST_IP``
    is the address the engine's workers register (prefill) and its transfer engine uses; vLLM
    guesses one from the interfaces otherwise. ``mooncake_protocol``: the transfer engine's
    transport (vLLM's default is ``rdma``).
    """
    env = [("VLLM_HOST_IP", spec.host)]
    if role == "prefill":
        env.append(("VLLM_MOONCAKE_BOOTSTRAP_PORT", str(side)))
    kv_config = {"kv_connector": "MooncakeConnector",
                 "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
                 "kv_connector_extra_config": {"mooncake_protocol": fleet.transfer_protocol}}
    return env, kv_config


#: LMCache remote storage plugin of the codec (engines/kvcodec/lmcache_plugin.py; named here
#: as text: the gateway side never imports the engine side).
CODEC_PLUGIN = "kvcodec"
CODEC_PLUGIN_KEYS = {
    f"remote_storage_plugin.{CODEC_PLUGIN}.module_path": "kvgate.engines.kvcodec.lmcache_plugin",
    f"remote_storage_plugin.{CODEC_PLUGIN}.class_name": "KvcodecMooncakeConnector",
}
#: The media of a shared tier's KV events, per protocol: LMCache's cache engine publishes its
#: stored chunks with ``medium: "cpu"`` (lmcache/v1/cache_engine.py, 0.5.6), so the gateway's
#: ``kv-events`` files them under the shared tier (plugins/prefix/shared_tier.py).
SHARED_MEDIA: dict[str, list[str]] = {"lmcache-mooncake": ["cpu"]}


def _lmcache_config(fleet: FleetSpec, spec: EngineSpec) -> str:
    master = fleet.mooncake_master
    remote: dict[str, Any] = (
        {"remote_storage_plugins": [CODEC_PLUGIN]} if fleet.kv_codec
        else {"remote_url": f"mooncakestore://{master.host}:{master.rpc_port}/"})
    data = {
        "chunk_size": fleet.lmcache_chunk_size,
        "local_cpu": False,
        **remote,
        "remote_serde": "naive",  # the codec, when on, is in the connector: no serde after it
        "extra_config": {
            **(CODEC_PLUGIN_KEYS if fleet.kv_codec else {}),
            "local_hostname": spec.host,
            "metadata_server": "P2PHANDSHAKE",
            "protocol": fleet.transfer_protocol,
            "master_server_address": f"{master.host}:{master.rpc_port}",
            # LMCache >= 0.5 passes ``mooncake_<name>`` keys to Mooncake's dict ``setup()`` as
            # ``<name>``; Mooncake 0.3.13 reads the master there as ``master_server_addr`` and
            # ignores ``master_server_address`` (the key of its positional ``setup()``).
            "mooncake_master_server_addr": f"{master.host}:{master.rpc_port}",
            "global_segment_size": 4 << 30,
            "local_buffer_size": 1 << 30,
        },
    }
    return yaml.safe_dump(data, sort_keys=False)


def _master_script(fleet: FleetSpec) -> str:
    m = fleet.mooncake_master
    cmd = shlex.join(["mooncake_master", "-rpc_port", str(m.rpc_port), "-rpc_address", m.host,
                      "-metrics_host", m.metrics_host or m.host,
                      "-metrics_port", str(m.metrics_port)])
    return _script("mooncake-master", [], cmd)


def _gateway_config(fleet: FleetSpec) -> str:
    """The quick start's cache-aware P/D preset over the fleet, consuming every engine's KV
    events (one socket per engine), plus the protocol's connector and bootstrap labels."""
    ports = kv_events_ports(fleet)
    pools = fleet.pools.roles()
    qs = QuickStart(
        engines=tuple(f"http://{s.host}:{s.port}" for s in fleet.pools.engines),
        prefill=tuple(f"http://{s.host}:{s.port}" for s in fleet.pools.prefill),
        decode=tuple(f"http://{s.host}:{s.port}" for s in fleet.pools.decode),
        kv_events=tuple(f"tcp://{spec.host}:{ports[(role, i)]}"
                        for role, specs in pools for i, spec in enumerate(specs)),
        kv_events_replay=tuple(f"tcp://{spec.host}:{replay_port(fleet, ports[(role, i)])}"
                               for role, specs in pools for i, spec in enumerate(specs)
                               if replay_port(fleet, ports[(role, i)]) is not None),
        tokenizer=fleet.tokenizer,
        server={"host": fleet.gateway.host, "port": fleet.gateway.port},
    )
    data = quick_start_config(qs).model_dump(mode="json", exclude={"source"},
                                             exclude_defaults=True)
    for eng in data["engines"]:
        role, _, index = eng["name"].partition("-")
        i = int(index)
        spec = fleet.pools.of(role)[i]
        if role == "prefill" and fleet.protocol in ("mooncake", "sglang"):
            eng["labels"] = {"bootstrap_host": spec.host,
                             "bootstrap_port": str(_side_port(spec, fleet.protocol, i))}
        if fleet.protocol == "sglang":  # it ignores cache_salt: cache-salt warns about it
            eng["labels"] = {**eng.get("labels", {}), "engine": "sglang"}
    if fleet.protocol in SHARED_MEDIA:  # tier-aware routing on wherever there is a tier
        for plugin in data["plugins"]:
            if plugin["type"] == "kv-events":
                plugin.setdefault("params", {})["shared_media"] = SHARED_MEDIA[fleet.protocol]
    if not fleet.pools.engines:
        data["disaggregation"] = {"connector": CONNECTOR[fleet.protocol]}
    return yaml.safe_dump(data, sort_keys=False)


def render(fleet: FleetSpec) -> dict[str, str]:
    """Every output file, by name."""
    files: dict[str, str] = {}
    order: list[str] = []
    if fleet.protocol == "lmcache-mooncake":
        files["mooncake-master.sh"] = _master_script(fleet)
        order.append("mooncake-master.sh (on the master host)")
    for role, specs in fleet.pools.roles():
        for i, spec in enumerate(specs):
            files.update(_engine_files(fleet, role, i, spec))
            order.append(f"{role}-{i}.sh (on {spec.host})")
    files["kvgate.yaml"] = _gateway_config(fleet)
    order.append("kvgate serve --config kvgate.yaml")
    files["README.txt"] = ("Start in this order:\n"
                           + "".join(f"  {n}. {s}\n" for n, s in enumerate(order, 1))
                           + _agent_notes(fleet) + _codec_note(fleet))
    return files


def _codec_note(fleet: FleetSpec) -> str:
    if fleet.protocol != "lmcache-mooncake" or not fleet.kv_codec:
        return ""
    return ("\nNote: LMCache stores KV in the Mooncake Store through kvgate's lossless KV codec "
            "(lmcache-*.yaml: remote_storage_plugins [kvcodec]): the engine image needs the "
            "kvgate package importable (pip install --no-deps kvgate). kv_codec: false in the "
            "fleet file renders LMCache's own Mooncake connector instead.\n")


def load_fleet(path: str | Path) -> FleetSpec:
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{p}: cannot read: {exc}") from None
    try:
        return FleetSpec.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}"
                             for e in exc.errors())
        raise ConfigError(f"{p}: {problems}") from None
