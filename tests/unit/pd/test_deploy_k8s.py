"""``kvgate deploy render --target k8s|helm``: every manifest validates against the Kubernetes
1.33 schemas (kubernetes-validate, offline), Secrets are referenced never inlined, the
ConfigMap's kvgate.yaml loads with kvgate's own parser, the committed chart is the render of
docs/examples/fleet.yaml, and Helm itself (the Helm v4 library of helm-python-sdk, offline)
renders it to manifests that validate and lints it clean."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml
from helm_python.chart import Chart
from helm_python.chart import lint as helm_lint

from kvgate.engines.deploy.k8s import render_chart, render_k8s
from kvgate.engines.deploy.render import FleetSpec, load_fleet, render
from kvgate.middleware import cli
from kvgate.middleware.framework.composition.config import parse_config

K8S_VERSION = "1.33.0"
ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "docs/examples/fleet.yaml"
CHART = ROOT / "deploy/helm/kvgate"


def _fleet(protocol: str, replicas: int, redis: str, pd: bool = True) -> FleetSpec:
    engines = [{"host": f"10.0.0.{i}", "port": 8000, "gpus": "0,1"} for i in range(2)]
    pools = {"prefill": engines, "decode": engines[:1]} if pd else {"engines": engines}
    return FleetSpec.model_validate({
        "model": "org/model-8b", "protocol": protocol, "tool_call_parser": "hermes",
        "pools": pools,
        "kubernetes": {"gateway_replicas": replicas, "gateway_max_replicas": max(replicas, 1),
                       "redis": redis, "provider_keys": {
                           "OPENAI_API_KEY": {"name": "provider-keys", "key": "openai"}}}})


#: (protocol, P/D, gateway replicas, redis); "nixl" without P/D: plain vLLM engines.
CASES = [("nixl", False, 1, "none"), ("nixl", False, 2, "in-cluster"),
         ("nixl", True, 1, "none"), ("nixl", True, 3, "in-cluster"),
         ("mooncake", True, 2, "external"), ("lmcache-mooncake", True, 2, "in-cluster"),
         ("lmcache-mooncake", False, 1, "in-cluster"), ("sglang", True, 1, "in-cluster")]
PARAMS = ("protocol", "pd", "replicas", "redis")


def _docs(files: dict[str, str]) -> list[dict[str, Any]]:
    return [d for name, text in sorted(files.items()) if name.endswith(".yaml")
            for d in yaml.safe_load_all(text) if d]


def _validate(docs: list[dict[str, Any]]) -> None:
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def _envs(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for d in docs if d["kind"] in ("Deployment", "StatefulSet")
            for c in d["spec"]["template"]["spec"]["containers"] for e in c.get("env", [])}


@pytest.mark.parametrize(PARAMS, CASES)
def test_manifests_validate_and_reference_secrets(protocol: str, pd: bool, replicas: int,
                                                  redis: str) -> None:
    docs = _docs(render_k8s(_fleet(protocol, replicas, redis, pd)))
    _validate(docs)
    kinds = [d["kind"] for d in docs]
    assert "Secret" not in kinds
    assert kinds.count("StatefulSet") == 1 + pd + (redis == "in-cluster")
    assert ("Deployment" in kinds) and ("PodDisruptionBudget" in kinds)
    env = _envs(docs)
    secret_names = ["KVGATE_SECRET", "OPENAI_API_KEY", "HF_TOKEN"]
    secret_names += ["KVGATE_REDIS_URL"] if redis == "external" else []
    for name in secret_names:
        assert "value" not in env[name] and "secretKeyRef" in env[name]["valueFrom"], name
    gateway = next(d for d in docs if d["kind"] == "Deployment"
                   and d["metadata"]["name"] == "kvgate-gateway")
    command = gateway["spec"]["template"]["spec"]["containers"][0]["command"]
    assert ("--redis" in command) == (redis != "none")
    assert gateway["spec"]["replicas"] == replicas


@pytest.mark.parametrize(PARAMS, CASES)
def test_config_map_is_a_valid_gateway_config(protocol: str, pd: bool, replicas: int,
                                              redis: str) -> None:
    docs = _docs(render_k8s(_fleet(protocol, replicas, redis, pd)))
    config_map = next(d for d in docs if d["kind"] == "ConfigMap")
    config = parse_config(yaml.safe_load(config_map["data"]["kvgate.yaml"]), "kvgate.yaml")
    first = "prefill" if pd else "engine"
    names = [e.name for e in config.engines]
    assert names == (["prefill-0", "prefill-1", "decode-0"] if pd else ["engine-0", "engine-1"])
    assert str(config.engines[1].kv_events) == \
        f"tcp://kvgate-{first}-1.kvgate-{first}.kvgate.svc.cluster.local:5557"
    assert (config.disaggregation is not None) == pd
    pool = next(d for d in docs if d["kind"] == "StatefulSet"
                and d["metadata"]["name"] == f"kvgate-{first}")
    assert pool["spec"]["replicas"] == 2
    container = pool["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 2}
    transfer = "--disaggregation-mode" if protocol == "sglang" else "--kv-transfer-config"
    assert (transfer in " ".join(container["command"])) == (pd or protocol == "lmcache-mooncake")


def test_hpa_on_a_kvgate_pods_metric() -> None:
    docs = _docs(render_k8s(load_fleet(EXAMPLE)))
    _validate(docs)
    hpa = next(d for d in docs if d["kind"] == "HorizontalPodAutoscaler")
    metric = hpa["spec"]["metrics"][0]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == "kvgate_requests_per_second"
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)


def test_committed_chart_is_the_example_render() -> None:
    expected = render_chart(load_fleet(EXAMPLE))
    committed = {str(p.relative_to(CHART)): p.read_text(encoding="utf-8")
                 for p in CHART.rglob("*") if p.is_file()}
    assert committed == expected


@pytest.mark.parametrize(("values", "replicas"), [(None, 2), ({"gateway": {"replicas": 3}}, 3)])
def test_helm_renders_the_chart_to_valid_manifests(values: dict[str, Any] | None,
                                                   replicas: int) -> None:
    rendered = Chart.load(str(CHART)).render(values, name="kvgate", namespace="team-a",
                                             is_install=True)
    docs = _docs(rendered)
    _validate(docs)
    assert {d["metadata"].get("namespace") for d in docs} == {"team-a"}
    gateway = next(d for d in docs if d["kind"] == "Deployment"
                   and d["metadata"]["name"] == "kvgate-gateway")
    assert gateway["spec"]["replicas"] == replicas
    config_map = next(d for d in docs if d["kind"] == "ConfigMap")
    config = parse_config(yaml.safe_load(config_map["data"]["kvgate.yaml"]), "kvgate.yaml")
    assert str(config.engines[0].url).startswith("http://kvgate-prefill-0.kvgate-prefill.team-a.")


def test_helm_lint_strict_finds_no_warning() -> None:
    report = helm_lint(str(CHART), strict=True, namespace="team-a", kube_version="v1.33.0")
    assert report["errors"] == []
    assert report["total_charts_linted"] == 1
    # severity 1 is informational (Helm's "icon is recommended"); 2 warning, 3 error
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_cli_renders_the_example_stack(tmp_path: Path) -> None:
    out = tmp_path / "k8s"
    assert cli.main(["deploy", "render", str(EXAMPLE), "--target", "k8s", "--out", str(out)]) == 0
    written = {p.name: p.read_text(encoding="utf-8") for p in out.iterdir()}
    assert written == render_k8s(load_fleet(EXAMPLE))
    docs = _docs(written)
    _validate(docs)
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {("StatefulSet", "kvgate-redis"), ("Deployment", "kvgate-mooncake-master"),
            ("StatefulSet", "kvgate-prefill"), ("StatefulSet", "kvgate-decode"),
            ("Deployment", "kvgate-gateway")} <= names


def test_a_pool_with_differing_engines_is_refused(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump({"model": "m", "pools": {
        "prefill": [{"host": "a", "port": 8000}, {"host": "b", "port": 8001}],
        "decode": [{"host": "c", "port": 8000}]}}), encoding="utf-8")
    code = cli.main(["deploy", "render", str(fleet), "--target", "k8s",
                     "--out", str(tmp_path / "out")])
    assert code == 2
    assert not (tmp_path / "out").exists()


def test_example_fleet_renders_as_scripts_too() -> None:
    files = render(load_fleet(EXAMPLE))
    assert {"mooncake-master.sh", "prefill-0.sh", "prefill-1.sh", "decode-0.sh", "decode-1.sh",
            "kvgate.yaml"} <= files.keys()
    parse_config(yaml.safe_load(files["kvgate.yaml"]), "kvgate.yaml")


@pytest.mark.parametrize(("protocol", "transfer"), [("nixl", False), ("sglang", False),
                                                    ("lmcache-mooncake", True)])
def test_a_fleet_without_pd_renders_plain_engines(protocol: str, transfer: bool) -> None:
    files = render(_fleet(protocol, 1, "none", pd=False))
    assert {"engine-0.sh", "engine-1.sh"} <= files.keys()
    assert not any(name.startswith(("prefill", "decode")) for name in files)
    script = files["engine-0.sh"]
    assert ("--kv-transfer-config" in script) == transfer
    assert "--disaggregation-mode" not in script and "--kv-events-config" in script
    config = parse_config(yaml.safe_load(files["kvgate.yaml"]), "kvgate.yaml")
    assert config.disaggregation is None
    assert [str(e.kv_events) for e in config.engines] == ["tcp://10.0.0.0:5557",
                                                          "tcp://10.0.0.1:5557"]


@pytest.mark.parametrize(("protocol", "codec", "init"), [
    ("lmcache-mooncake", True, True), ("lmcache-mooncake", False, False), ("nixl", True, False)])
def test_engine_pods_get_kvgate_for_the_codec(protocol: str, codec: bool, init: bool) -> None:
    """With the codec in LMCache's data path, each engine pod copies kvgate from the gateway
    image (an init container) into a volume on the engine's PYTHONPATH; otherwise nothing."""
    fleet = _fleet(protocol, 1, "none").model_copy(update={"kv_codec": codec})
    docs = _docs(render_k8s(fleet))
    _validate(docs)
    pod = next(d for d in docs if d["kind"] == "StatefulSet")["spec"]["template"]["spec"]
    engine = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in engine["env"]}
    assert ("initContainers" in pod) == init
    assert (env.get("PYTHONPATH") == "/opt/kvgate-lib") == init
    if init:
        (copy,) = pod["initContainers"]
        assert copy["image"] == fleet.kubernetes.gateway_image
        assert copy["volumeMounts"] == [{"name": "kvgate-lib", "mountPath": "/opt/kvgate-lib"}]
        assert {"name": "kvgate-lib", "mountPath": "/opt/kvgate-lib"} in engine["volumeMounts"]
