"""``kvgate deploy render --target k8s|helm``: the fleet as Kubernetes manifests or a Helm chart.

Layout (docs/kubernetes.md): each engine pool (prefill, decode) is a StatefulSet behind a
headless Service, so pod ``i`` of a pool has the stable name
``kvgate-<role>-<i>.kvgate-<role>.<ns>.svc.cluster.local``: the gateway's ``kvgate.yaml``
(a ConfigMap) lists every engine by that name, and connects one ZMQ socket to each pod's KV
events (the engines bind ``tcp://*:<kv_events_port>``, the gateway replicas connect). The
headless Services publish not-ready addresses, so names resolve while a model loads.

The gateway is a Deployment (``kvgate serve --config ... --redis ...``) with a Service, a
PodDisruptionBudget (at most one pod down voluntarily) and, when ``gateway_max_replicas`` is
above ``gateway_replicas``, an ``autoscaling/v2`` HPA on the Pods metric
``kvgate_requests_per_second`` (needs a metrics adapter). Readiness is ``/health``: 200 while at
least one engine is healthy, 503 otherwise, so a gateway that cannot route gets no traffic;
liveness is ``/metrics`` on the admin port (``server.admin_port``, :data:`ADMIN_PORT`: no key
needed there, while the API port answers ``/metrics`` to admin keys only), which answers
regardless of the engines (an engine outage must not restart gateways). The admin port is a
container port only, not in the Service: Prometheus scrapes the pods. Redis
(``redis: in-cluster``) is a one-pod StatefulSet; the Mooncake master
(``lmcache-mooncake``) a one-pod Deployment and Service; the Mooncake store is the engines'
own segments (``global_segment_size`` in each LMCache config), not a separate process.

Secrets are referenced by name (``secretKeyRef``, a mounted Secret), never rendered.
Rendering is pure; the command writes the files.
"""

from __future__ import annotations

import hashlib
import re
import shlex
from typing import Any

import yaml

from kvgate.engines.deploy.k8s_spec import KubernetesSpec
from kvgate.engines.deploy.render import (
    FleetSpec,
    _gateway_config,
    _side_port,
    engine_launch,
    replay_port,
)
from kvgate.middleware.framework.errors import ConfigError

Obj = dict[str, Any]
_CONFIG_DIR = "/etc/kvgate"
_HPA_METRIC = "kvgate_requests_per_second"
_KEYS_FILE = "/etc/kvgate-keys/keys.yaml"


def _labels(component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "kvgate", "app.kubernetes.io/component": component}


def _meta(name: str, k: KubernetesSpec, component: str) -> Obj:
    return {"name": name, "namespace": k.namespace, "labels": _labels(component)}


def _dns(name: str, service: str, k: KubernetesSpec) -> str:
    return f"{name}.{service}.{k.namespace}.svc.cluster.local"


def _master_host(k: KubernetesSpec) -> str:
    return f"kvgate-mooncake-master.{k.namespace}.svc.cluster.local"


def _pool_specs(fleet: FleetSpec, role: str) -> Any:
    return fleet.pools.of(role)


def _check_pool(fleet: FleetSpec, role: str) -> None:
    """A StatefulSet has one pod template: the pool's engines must agree."""
    specs = _pool_specs(fleet, role)
    first = specs[0]
    for spec in specs[1:]:
        if (spec.port, len(spec.gpus.split(",")), spec.args) != (
                first.port, len(first.gpus.split(",")), first.args):
            raise ConfigError(f"--target k8s: the {role} pool's engines differ (port, GPU count "
                              "or args): one StatefulSet runs them all")


def k8s_fleet(fleet: FleetSpec) -> FleetSpec:
    """The fleet with each engine's host replaced by its pod's stable DNS name (the gateway
    config's view) and one side port per pool (every pod has its own address)."""
    k = fleet.kubernetes
    pools: dict[str, Any] = {}
    for role, specs in fleet.pools.roles():
        side = _side_port(specs[0], fleet.protocol, 0)
        pools["engines" if role == "engine" else role] = tuple(s.model_copy(update={
            "host": _dns(f"kvgate-{role}-{i}", f"kvgate-{role}", k), "side_port": side,
            "gpus": ",".join(str(g) for g in range(len(s.gpus.split(","))))})
            for i, s in enumerate(specs))
    master = fleet.mooncake_master.model_copy(update={"host": _master_host(k)})
    return fleet.model_copy(update={"pools": fleet.pools.model_copy(update=pools),
                                    "mooncake_master": master})


#: The gateway pod's admin port: /metrics and the full /health without a key (the liveness
#: probe, Prometheus). 9090 unless the API port is 9090.
ADMIN_PORT = 9090


def _admin_port(fleet: FleetSpec) -> int:
    return ADMIN_PORT if fleet.gateway.port != ADMIN_PORT else ADMIN_PORT + 1


def _gateway_yaml(fleet: FleetSpec) -> str:
    """The script target's gateway config over the pods' names, listening on all addresses,
    with the ``api-keys`` plugin reading the mounted keys Secret (``kvgate serve --keys`` is a
    billing flag: it needs ``--prices``)."""
    text = _gateway_config(k8s_fleet(fleet))
    data = yaml.safe_load(text)
    data["server"] = {"host": "0.0.0.0", "port": fleet.gateway.port,
                      "admin_port": _admin_port(fleet)}
    if fleet.kubernetes.keys_secret is not None:
        data["plugins"].insert(0, {"type": "api-keys", "params": {"file": _KEYS_FILE}})
    return yaml.safe_dump(data, sort_keys=False)


def _config_map(fleet: FleetSpec) -> Obj:
    data = {"kvgate.yaml": _gateway_yaml(fleet)}
    if fleet.protocol == "lmcache-mooncake":
        for role, _ in fleet.pools.roles():
            _, _, files = _engine(fleet, role)
            data.update({f"lmcache-{role}.yaml": text for text in files.values()})
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": _meta("kvgate-config", fleet.kubernetes, "config"), "data": data}


def _engine(fleet: FleetSpec, role: str) -> tuple[list[tuple[str, str]], str, dict[str, str]]:
    """Environment and command of one pod of the pool: addresses are the pod's own IP
    (``$(POD_IP)``, expanded by the kubelet), the GPUs are the container's."""
    spec = k8s_fleet(fleet).pools.of(role)[0]
    local = spec.model_copy(update={"host": "$(POD_IP)"})
    return engine_launch(k8s_fleet(fleet), role, 0, local)


def _secret_env(name: str, ref: Any, *, optional: bool) -> Obj:
    return {"name": name, "valueFrom": {"secretKeyRef": {
        "name": ref.name, "key": ref.key, "optional": optional}}}


def _engine_container(fleet: FleetSpec, role: str) -> Obj:
    k = fleet.kubernetes
    env_pairs, cmd, _ = _engine(fleet, role)
    spec = _pool_specs(fleet, role)[0]
    env: list[Obj] = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    command = shlex.split(cmd)
    for name, value in env_pairs:
        if name == "CUDA_VISIBLE_DEVICES":  # the device plugin gives the container its GPUs
            continue
        if name == "LMCACHE_CONFIG_FILE":  # the ConfigMap's file with this pod's address
            value = "/tmp/lmcache.yaml"
            command = ["sh", "-c", f"sed 's/[$][(]POD_IP[)]/'\"$POD_IP\"'/g' "
                       f"{_CONFIG_DIR}/lmcache-{role}.yaml > {value} && exec {cmd}"]
        env.append({"name": name, "value": value})
    if k.hf_token is not None:
        env.append(_secret_env("HF_TOKEN", k.hf_token, optional=True))
    side = _side_port(k8s_fleet(fleet).pools.of(role)[0], fleet.protocol, 0)
    probe = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10}
    ports = [{"name": "http", "containerPort": spec.port},
             {"name": "kv-events", "containerPort": fleet.kv_events_port},
             {"name": "side", "containerPort": side}]
    replay = replay_port(fleet, fleet.kv_events_port)
    if replay is not None:
        ports.insert(2, {"name": "kv-replay", "containerPort": replay})
    return {
        "name": "engine", "image": k.engine_image, "command": command, "env": env,
        "ports": ports,
        "resources": {"limits": {"nvidia.com/gpu": len(spec.gpus.split(","))}},
        # Loading a model takes minutes: the startup probe allows 30 min before liveness.
        "startupProbe": {**probe, "failureThreshold": 180},
        "readinessProbe": {**probe, "failureThreshold": 3},
        "livenessProbe": {**probe, "failureThreshold": 6},
        "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"},
                         {"name": "cache", "mountPath": "/root/.cache"},
                         {"name": "config", "mountPath": _CONFIG_DIR}],
    }


#: Where an engine pod finds the kvgate package copied from the gateway image (the codec's
#: LMCache plugin, engines/kvcodec/lmcache_plugin.py: torch and LMCache come from the engine
#: image, only kvgate's own files are added).
KVGATE_LIB = "/opt/kvgate-lib"
_COPY_KVGATE = ("import kvgate, pathlib, shutil; shutil.copytree(pathlib.Path(kvgate.__file__)"
                f".parent, '{KVGATE_LIB}/kvgate', dirs_exist_ok=True)")


def _with_codec(fleet: FleetSpec, container: Obj, spec: Obj, volumes: list[Obj]) -> None:
    """LMCache's remote tier through the codec (``kv_codec``): an init container copies the
    kvgate package from the gateway image into a volume on the engine's PYTHONPATH, so the
    engine image needs no kvgate install."""
    if fleet.protocol != "lmcache-mooncake" or not fleet.kv_codec:
        return
    volumes.append({"name": "kvgate-lib", "emptyDir": {}})
    mount = {"name": "kvgate-lib", "mountPath": KVGATE_LIB}
    spec["initContainers"] = [{"name": "kvgate-lib", "image": fleet.kubernetes.gateway_image,
                               "command": ["python", "-c", _COPY_KVGATE],
                               "volumeMounts": [mount]}]
    container["volumeMounts"].append(mount)
    container["env"].append({"name": "PYTHONPATH", "value": KVGATE_LIB})


def _pool(fleet: FleetSpec, role: str) -> list[Obj]:
    _check_pool(fleet, role)
    k = fleet.kubernetes
    name = f"kvgate-{role}"
    container = _engine_container(fleet, role)
    service = {"apiVersion": "v1", "kind": "Service", "metadata": _meta(name, k, role),
               "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                        "selector": _labels(role),
                        "ports": [{"name": p["name"], "port": p["containerPort"],
                                   "targetPort": p["name"]} for p in container["ports"]]}}
    volumes = [{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": k.engine_shm}},
               {"name": "cache", "emptyDir": {}},
               {"name": "config", "configMap": {"name": "kvgate-config"}}]
    pod: Obj = {"containers": [container], "volumes": volumes}
    _with_codec(fleet, container, pod, volumes)
    sts = {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": _meta(name, k, role),
           "spec": {"serviceName": name, "replicas": len(_pool_specs(fleet, role)),
                    "podManagementPolicy": "Parallel",
                    "selector": {"matchLabels": _labels(role)},
                    "template": {"metadata": {"labels": _labels(role)}, "spec": pod}}}
    return [service, sts]


def _redis(k: KubernetesSpec) -> list[Obj]:
    """A one-pod Redis for trials (append-only file on a 1 GiB volume: API keys and budgets
    survive a restart); production: a managed Redis (``redis: external``)."""
    name = "kvgate-redis"
    container = {"name": "redis", "image": k.redis_image,
                 "args": ["--appendonly", "yes", "--maxmemory-policy", "noeviction"],
                 "ports": [{"name": "redis", "containerPort": 6379}],
                 "readinessProbe": {"exec": {"command": ["redis-cli", "ping"]},
                                    "periodSeconds": 5},
                 "volumeMounts": [{"name": "data", "mountPath": "/data"}]}
    claim = {"metadata": {"name": "data"}, "spec": {
        "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}}
    return [
        {"apiVersion": "v1", "kind": "Service", "metadata": _meta(name, k, "redis"),
         "spec": {"clusterIP": "None", "selector": _labels("redis"),
                  "ports": [{"name": "redis", "port": 6379, "targetPort": "redis"}]}},
        {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": _meta(name, k, "redis"),
         "spec": {"serviceName": name, "replicas": 1,
                  "selector": {"matchLabels": _labels("redis")},
                  "template": {"metadata": {"labels": _labels("redis")},
                               "spec": {"containers": [container]}},
                  "volumeClaimTemplates": [claim]}}]


def _mooncake_master(fleet: FleetSpec) -> list[Obj]:
    k, m = fleet.kubernetes, fleet.mooncake_master
    name = "kvgate-mooncake-master"
    ports = [{"name": "rpc", "containerPort": m.rpc_port},
             {"name": "metrics", "containerPort": m.metrics_port}]
    container = {"name": "master", "image": k.mooncake_image or k.engine_image,
                 "command": ["mooncake_master", "-rpc_port", str(m.rpc_port),
                             "-rpc_address", "0.0.0.0", "-metrics_host", "0.0.0.0",
                             "-metrics_port", str(m.metrics_port)],
                 "ports": ports,
                 "readinessProbe": {"tcpSocket": {"port": "rpc"}, "periodSeconds": 5}}
    return [
        {"apiVersion": "v1", "kind": "Service", "metadata": _meta(name, k, "mooncake-master"),
         "spec": {"selector": _labels("mooncake-master"),
                  "ports": [{"name": p["name"], "port": p["containerPort"],
                             "targetPort": p["name"]} for p in ports]}},
        {"apiVersion": "apps/v1", "kind": "Deployment",
         "metadata": _meta(name, k, "mooncake-master"),
         "spec": {"replicas": 1, "strategy": {"type": "Recreate"},
                  "selector": {"matchLabels": _labels("mooncake-master")},
                  "template": {"metadata": {"labels": _labels("mooncake-master")},
                               "spec": {"containers": [container]}}}}]


def _gateway_env(k: KubernetesSpec) -> list[Obj]:
    env: list[Obj] = []
    if k.redis == "in-cluster":  # no password: the URL is not a secret
        env.append({"name": "KVGATE_REDIS_URL",
                    "value": f"redis://{_dns('kvgate-redis-0', 'kvgate-redis', k)}:6379/0"})
    elif k.redis == "external":
        env.append(_secret_env("KVGATE_REDIS_URL", k.redis_secret, optional=False))
    env.append(_secret_env("KVGATE_SECRET", k.secret, optional=True))
    env += [_secret_env(name, ref, optional=False) for name, ref in sorted(k.provider_keys.items())]
    return env


def _gateway_container(fleet: FleetSpec, checksum: str) -> Obj:
    k = fleet.kubernetes
    args = ["kvgate", "serve", "--config", f"{_CONFIG_DIR}/kvgate.yaml"]
    mounts = [{"name": "config", "mountPath": _CONFIG_DIR, "readOnly": True},
              {"name": "state", "mountPath": "/var/lib/kvgate"}]
    if k.redis != "none":
        args += ["--redis", "$(KVGATE_REDIS_URL)"]
    if k.keys_secret is not None:  # read by the api-keys plugin of kvgate.yaml
        mounts.append({"name": "keys", "mountPath": "/etc/kvgate-keys", "readOnly": True})
    return {"name": "kvgate", "image": k.gateway_image, "command": args,
            "workingDir": "/var/lib/kvgate", "env": _gateway_env(k),
            "ports": [{"name": "http", "containerPort": fleet.gateway.port},
                      {"name": "admin", "containerPort": _admin_port(fleet)}],
            "resources": {"requests": {"cpu": "500m", "memory": "512Mi"},
                          "limits": {"memory": "2Gi"}},
            "readinessProbe": {"httpGet": {"path": "/health", "port": "http"},
                               "periodSeconds": 5, "failureThreshold": 2},
            "livenessProbe": {"httpGet": {"path": "/metrics", "port": "admin"},
                              "initialDelaySeconds": 10, "periodSeconds": 10,
                              "failureThreshold": 6},
            "volumeMounts": mounts}


def _gateway(fleet: FleetSpec, checksum: str, hpa: bool) -> list[Obj]:
    k = fleet.kubernetes
    name = "kvgate-gateway"
    volumes: list[Obj] = [{"name": "config", "configMap": {"name": "kvgate-config"}},
                          {"name": "state", "emptyDir": {}}]
    if k.keys_secret is not None:
        volumes.append({"name": "keys", "secret": {"secretName": k.keys_secret}})
    pod = {"metadata": {"labels": _labels("gateway"),
                        "annotations": {"kvgate/config-sha256": checksum}},
           "spec": {"containers": [_gateway_container(fleet, checksum)], "volumes": volumes}}
    objs: list[Obj] = [
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(name, k, "gateway"),
         "spec": {"replicas": k.gateway_replicas,
                  "selector": {"matchLabels": _labels("gateway")}, "template": pod}},
        {"apiVersion": "v1", "kind": "Service", "metadata": _meta("kvgate", k, "gateway"),
         "spec": {"selector": _labels("gateway"),
                  "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}},
        {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
         "metadata": _meta(name, k, "gateway"),
         "spec": {"maxUnavailable": 1, "selector": {"matchLabels": _labels("gateway")}}}]
    if hpa:
        objs.append({
            "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": _meta(name, k, "gateway"),
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment",
                                        "name": name},
                     "minReplicas": k.gateway_replicas, "maxReplicas": k.gateway_max_replicas,
                     "metrics": [{"type": "Pods", "pods": {
                         "metric": {"name": _HPA_METRIC},
                         "target": {"type": "AverageValue",
                                    "averageValue": str(k.hpa_requests_per_second)}}}]}})
    return objs


def manifests(fleet: FleetSpec, hpa: bool | None = None) -> dict[str, list[Obj]]:
    """Every object, by output file (applied in name order); ``hpa``: render the HPA
    (default: when ``gateway_max_replicas`` is above ``gateway_replicas``)."""
    k = fleet.kubernetes
    if hpa is None:
        hpa = k.gateway_max_replicas > k.gateway_replicas
    config = _config_map(fleet)
    checksum = hashlib.sha256(yaml.safe_dump(config["data"]).encode()).hexdigest()[:16]
    out: dict[str, list[Obj]] = {}
    if k.create_namespace:
        out["00-namespace.yaml"] = [{"apiVersion": "v1", "kind": "Namespace",
                                     "metadata": {"name": k.namespace}}]
    out["10-config.yaml"] = [config]
    if k.redis == "in-cluster":
        out["20-redis.yaml"] = _redis(k)
    if fleet.protocol == "lmcache-mooncake":
        out["30-mooncake-master.yaml"] = _mooncake_master(fleet)
    for n, (role, _) in enumerate(fleet.pools.roles()):
        out[f"4{n}-{role}.yaml"] = _pool(fleet, role)
    out["50-gateway.yaml"] = _gateway(fleet, checksum, hpa)
    return out


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the ConfigMap's files) as literal blocks, readable in the output."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def _dump(objs: list[Obj]) -> str:
    # No line folding: a folded line would split a chart's ``{{ ... }}`` action.
    return yaml.dump_all(objs, Dumper=_Dumper, sort_keys=False, width=10**6)


def render_k8s(fleet: FleetSpec) -> dict[str, str]:
    """Manifest files by name (``kubectl apply -f DIR``), plus README.txt."""
    files = {name: _dump(objs) for name, objs in manifests(fleet).items()}
    files["README.txt"] = _README.format(ns=fleet.kubernetes.namespace)
    return files


_README = """Kubernetes manifests from kvgate deploy render --target k8s (docs/kubernetes.md).
1. Create the Secrets the manifests reference (never rendered here): kvgate-keys (keys.yaml),
   optionally kvgate-secret (secret), hf-token (token), kvgate-redis (url, redis: external),
   and each provider key, in namespace {ns}.
2. kubectl apply -f .
3. kubectl -n {ns} port-forward svc/kvgate 8080:80, then curl localhost:8080/health
"""

#: Chart values: (values.yaml path, KubernetesSpec field).
_CHART_VALUES = (("gateway.image", "gateway_image"), ("gateway.replicas", "gateway_replicas"),
                 ("gateway.maxReplicas", "gateway_max_replicas"),
                 ("engines.image", "engine_image"), ("redis.image", "redis_image"))


def render_chart(fleet: FleetSpec) -> dict[str, str]:
    """A Helm chart of the fleet: the k8s target's manifests with the namespace as
    ``.Release.Namespace`` and images and gateway replicas as values. Pools stay as rendered
    (the gateway config lists each engine): change them in the fleet file and render again.
    Templates use ``{{ .Values.a.b }}`` and ``{{ .Release.Namespace }}`` only."""
    k = fleet.kubernetes
    update: dict[str, Any] = {f: f"{{{{ .Values.{v} }}}}" for v, f in _CHART_VALUES}
    update.update(namespace="{{ .Release.Namespace }}", create_namespace=False)
    templated = fleet.model_copy(update={"kubernetes": k.model_copy(update=update)})
    hpa = k.gateway_max_replicas > k.gateway_replicas
    files = {f"templates/{name}": re.sub(r"'(\{\{ [^'{}]+ \}\})'", r"\1", _dump(objs))
             for name, objs in manifests(templated, hpa).items()}
    values: dict[str, Any] = {}
    for path, field in _CHART_VALUES:
        top, _, leaf = path.partition(".")
        values.setdefault(top, {})[leaf] = getattr(k, field)
    files["values.yaml"] = ("# Rendered by kvgate deploy render --target helm "
                            "(docs/kubernetes.md)\n" + yaml.safe_dump(values, sort_keys=False))
    files["Chart.yaml"] = yaml.safe_dump({
        "apiVersion": "v2", "name": "kvgate", "version": "0.1.0", "type": "application",
        "description": "kvgate cache-aware gateway over a prefill/decode vLLM fleet"},
        sort_keys=False)
    return files
