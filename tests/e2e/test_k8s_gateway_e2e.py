"""The gateway container of ``kvgate deploy render --target k8s``, run as a real process: the
Deployment's own command (``kvgate serve --config ... --redis $(KVGATE_REDIS_URL)``) with the
ConfigMap's ``kvgate.yaml`` (its api-keys plugin reads the mounted keys Secret) and a real
redis-server. The
engines' pod names do not resolve here, which is what a gateway sees before the engine pods
exist: the readiness path (``/health``) must be 503 from the start (no probe has passed) and
stay so once the gateway's probes have failed, while the liveness path (``/metrics`` on the
admin port) keeps answering 200 (an engine outage must never restart gateways). The API port's
``/health`` says only its status and its ``/metrics`` wants an admin key (the keys are on)."""

from __future__ import annotations

import contextlib
import re
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from kvgate.engines.deploy.k8s import manifests
from kvgate.engines.deploy.render import load_fleet
from kvgate.plugins.tenancy.keys_model import hash_key, new_key
from tests.servers import REDIS_SERVER, RedisServer, free_port, running_process

pytestmark = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server not installed")

KVGATE = str(Path(sys.executable).with_name("kvgate"))
EXAMPLE = Path(__file__).resolve().parents[2] / "docs/examples/fleet.yaml"


def _gateway_container(objs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    deploy = next(o for o in objs["50-gateway.yaml"] if o["kind"] == "Deployment")
    container: dict[str, Any] = deploy["spec"]["template"]["spec"]["containers"][0]
    return container


def _command(container: dict[str, Any], env: dict[str, str], mounts: dict[str, Path]) -> list[str]:
    """The container command with ``$(VAR)`` expanded as the kubelet does and the mount paths
    mapped to local folders."""
    out = []
    for arg in container["command"]:
        arg = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg)
        for mount, local in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
            if arg.startswith(mount + "/"):
                arg = str(local) + arg[len(mount):]
        out.append(arg)
    return out


def _until_unready(url: str, deadline: float) -> httpx.Response:
    """``url`` until it answers 503 with no engine healthy left (the probes have failed)."""
    while True:
        resp = httpx.get(url, timeout=2)
        unready = resp.status_code == 503 and resp.json()["engines_healthy"] == 0
        if unready or time.monotonic() > deadline:
            return resp
        time.sleep(0.2)


def test_rendered_gateway_command_serves_and_probes_mean_what_the_guide_says(
        tmp_path: Path) -> None:
    objs = manifests(load_fleet(EXAMPLE))
    config_dir, keys_dir = tmp_path / "config", tmp_path / "keys"
    config_dir.mkdir()
    keys_dir.mkdir()
    container = _gateway_container(objs)
    mounts = {m["mountPath"]: {"config": config_dir, "keys": keys_dir,
                               "state": tmp_path}[m["name"]]
              for m in container["volumeMounts"]}
    config_map = objs["10-config.yaml"][0]
    for name, text in config_map["data"].items():  # the mounts' paths, as in the pod
        for mount, local in mounts.items():
            text = text.replace(mount + "/", f"{local}/")
        (config_dir / name).write_text(text, encoding="utf-8")
    admin = new_key()
    (keys_dir / "keys.yaml").write_text(yaml.safe_dump({"keys": [
        {"id": "root", "tenant": "ops", "sha256": hash_key(admin), "admin": True}]}))
    redis = RedisServer()
    redis.start()
    port, admin_port = free_port(), free_port()
    args = _command(container, {"KVGATE_REDIS_URL": redis.url}, mounts)
    assert args[:2] == ["kvgate", "serve"] and "--redis" in args
    base, admin_base = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}"
    ports = {p["name"]: admin_base if p["name"] == "admin" else base for p in container["ports"]}
    with contextlib.ExitStack() as stack:
        stack.callback(redis.stop)
        stack.enter_context(running_process(
            [KVGATE, *args[1:], "--host", "127.0.0.1", "--port", str(port), "--admin-port",
             str(admin_port)], f"{admin_base}/metrics", log=tmp_path / "kvgate.log",
            cwd=tmp_path))
        ready_get, live_get = (container[p]["httpGet"] for p in ("readinessProbe",
                                                                  "livenessProbe"))
        readiness = ports[ready_get["port"]] + ready_get["path"]
        liveness = ports[live_get["port"]] + live_get["path"]
        assert readiness.startswith(base) and liveness == f"{admin_base}/metrics"
        # not ready from the start (no probe has passed: "starting"), then the probes fail
        first = httpx.get(readiness, timeout=2)
        assert first.status_code == 503 and first.json() == {"status": "starting"}
        resp = _until_unready(f"{admin_base}/health", time.monotonic() + 30)
        body = resp.json()
        assert resp.status_code == 503 and body["engines_total"] == 4
        assert body["engines_healthy"] == 0 and body["status"] == "starting"
        assert httpx.get(readiness, timeout=2).status_code == 503
        assert "svc.cluster.local" not in httpx.get(readiness, timeout=2).text
        assert httpx.get(liveness, timeout=2).status_code == 200
        assert httpx.get(f"{base}/metrics", timeout=2).status_code == 401
        chat = {"model": "Qwen/Qwen3-8B", "messages": [{"role": "user", "content": "hi"}]}
        denied = httpx.post(f"{base}/v1/chat/completions", json=chat, timeout=5)
        assert denied.status_code == 401  # the mounted keys file is in force
        admin_view = httpx.get(readiness, timeout=2,
                               headers={"Authorization": f"Bearer {admin}"})
        assert "svc.cluster.local" in admin_view.text  # the admin key from the Secret works
