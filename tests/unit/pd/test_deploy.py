"""``kvgate deploy render``: rendered scripts and configs match expectations per protocol."""

from __future__ import annotations

import ast
import json
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvgate.engines.connectors import VllmMooncakeConnector
from kvgate.engines.deploy.render import CODEC_PLUGIN, CODEC_PLUGIN_KEYS, FleetSpec, render
from kvgate.middleware import cli
from kvgate.middleware.framework.composition.config import parse_config
from kvgate.middleware.framework.composition.pipeline import build_pipeline
from kvgate.middleware.framework.composition.registry import Registry
from kvgate.middleware.framework.connector import HopContext
from kvgate.middleware.framework.types import Endpoint, Role


def _fleet(protocol: str, **extra: Any) -> FleetSpec:
    return FleetSpec.model_validate({
        "model": "org/model-8b", "protocol": protocol,
        "mooncake_master": {"host": "10.0.0.1"},
        "engine_args": ["--max-model-len", "32768"],
        "pools": {"prefill": [{"host": "10.0.0.2", "port": 8100, "gpus": "0"},
                              {"host": "10.0.0.2", "port": 8101, "gpus": "1"}],
                  "decode": [{"host": "10.0.0.3", "port": 8200, "gpus": "0,1"}]},
        **extra})


NIXL_PREFILL_0 = """#!/bin/sh
# kvgate deploy render: prefill-0
set -e
cd "$(dirname "$0")"
export CUDA_VISIBLE_DEVICES=0
export VLLM_NIXL_SIDE_CHANNEL_HOST=10.0.0.2
export VLLM_NIXL_SIDE_CHANNEL_PORT=5600
exec vllm serve org/model-8b --host 0.0.0.0 --port 8100 --enable-prefix-caching \
--enable-prompt-tokens-details \
--kv-events-config \
'{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5757"}' \
--kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_producer"}' \
--max-model-len 32768
"""

SGLANG_DECODE_0 = """#!/bin/sh
# kvgate deploy render: decode-0
set -e
cd "$(dirname "$0")"
export CUDA_VISIBLE_DEVICES=0,1
exec python -m sglang.launch_server --model-path org/model-8b --host 0.0.0.0 --port 8200 \
--disaggregation-mode decode --disaggregation-bootstrap-port 8998 \
--disaggregation-transfer-backend mooncake --enable-cache-report \
--kv-events-config '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557"}' \
--max-model-len 32768
"""


def _one_line(script: str) -> str:
    return script.replace(" \\\n", " ")


def test_nixl_scripts_exact() -> None:
    files = render(_fleet("nixl"))
    assert files["prefill-0.sh"] == _one_line(NIXL_PREFILL_0)
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT=5601" in files["prefill-1.sh"]
    assert '"kv_role":"kv_consumer"' in files["decode-0.sh"]
    assert set(files) == {"prefill-0.sh", "prefill-1.sh", "decode-0.sh", "kvgate.yaml",
                          "README.txt"}


def test_sglang_scripts_exact() -> None:
    files = render(_fleet("sglang"))
    assert files["decode-0.sh"] == _one_line(SGLANG_DECODE_0)
    assert "--disaggregation-mode prefill --disaggregation-bootstrap-port 8999" \
        in files["prefill-1.sh"]


def _exports(script: str) -> dict[str, str]:
    pairs = (shlex.split(line[len("export "):])[0].split("=", 1)
             for line in script.splitlines() if line.startswith("export "))
    return {k: v for k, v in pairs}


def _kv_transfer_config(script: str) -> Any:
    args = shlex.split(next(line for line in script.splitlines() if line.startswith("exec ")))
    return json.loads(args[args.index("--kv-transfer-config") + 1])


@pytest.mark.parametrize("transport", ["rdma", "tcp"])
def test_mooncake_engines(transport: str) -> None:
    """vLLM 0.32 MooncakeConnector: producers start the bootstrap server on
    ``VLLM_MOONCAKE_BOOTSTRAP_PORT`` (one per host port), consumers none; every engine
    registers / transfers on its own address; the transport is the fleet's."""
    files = render(_fleet("mooncake", transfer_protocol=transport))
    for name, host, kv_role, port in (("prefill-0", "10.0.0.2", "kv_producer", "8998"),
                                      ("prefill-1", "10.0.0.2", "kv_producer", "8999"),
                                      ("decode-0", "10.0.0.3", "kv_consumer", None)):
        env = _exports(files[f"{name}.sh"])
        assert env.get("VLLM_MOONCAKE_BOOTSTRAP_PORT") == port, name
        assert env["VLLM_HOST_IP"] == host
        assert _kv_transfer_config(files[f"{name}.sh"]) == {
            "kv_connector": "MooncakeConnector", "kv_role": kv_role,
            "kv_connector_extra_config": {"mooncake_protocol": transport}}


def test_mooncake_gateway_asks_each_prefill_engines_bootstrap_server() -> None:
    """The gateway's connector (from the rendered kvgate.yaml) queries and names, as
    ``remote_bootstrap_addr``, the very host and port each prefill script binds."""
    files = render(_fleet("mooncake"))
    config = parse_config(yaml.safe_load(files["kvgate.yaml"]), "kvgate.yaml")
    conn = build_pipeline(config, Registry.from_entry_points()).connector
    assert isinstance(conn, VllmMooncakeConnector)
    prefill = [e for e in config.engines if e.role.value == "prefill"]
    assert len(prefill) == 2
    for i, eng in enumerate(prefill):
        env = _exports(files[f"prefill-{i}.sh"])
        endpoint = Endpoint(eng.name, eng.url, "vllm", role=Role.PREFILL, labels=eng.labels)
        url = conn.bootstrap(HopContext("r", endpoint, endpoint, room=0))
        assert url == f"http://{env['VLLM_HOST_IP']}:{env['VLLM_MOONCAKE_BOOTSTRAP_PORT']}"


def test_lmcache_mooncake_store() -> None:
    files = render(_fleet("lmcache-mooncake", transfer_protocol="tcp"))
    assert files["mooncake-master.sh"].endswith(
        "exec mooncake_master -rpc_port 50051 -rpc_address 10.0.0.1 -metrics_host 10.0.0.1 "
        "-metrics_port 9003\n")
    lm = yaml.safe_load(files["lmcache-decode-0.yaml"])
    assert lm == {  # the codec in the data path: LMCache's remote storage plugin framework
        "chunk_size": 256, "local_cpu": False, "remote_storage_plugins": ["kvcodec"],
        "remote_serde": "naive",
        "extra_config": {
            "remote_storage_plugin.kvcodec.module_path": "kvgate.engines.kvcodec.lmcache_plugin",
            "remote_storage_plugin.kvcodec.class_name": "KvcodecMooncakeConnector",
            **STORE_SETUP}}
    assert "export LMCACHE_CONFIG_FILE=lmcache-prefill-1.yaml\n" in files["prefill-1.sh"]
    assert files["README.txt"].splitlines()[1] == "  1. mooncake-master.sh (on the master host)"
    assert "kvgate's lossless KV codec" in files["README.txt"]


STORE_SETUP = {"local_hostname": "10.0.0.3", "metadata_server": "P2PHANDSHAKE",
               "protocol": "tcp", "master_server_address": "10.0.0.1:50051",
               "mooncake_master_server_addr": "10.0.0.1:50051",
               "global_segment_size": 4 << 30, "local_buffer_size": 1 << 30}


def test_lmcache_mooncake_store_without_the_codec() -> None:
    files = render(_fleet("lmcache-mooncake", transfer_protocol="tcp", kv_codec=False))
    assert yaml.safe_load(files["lmcache-decode-0.yaml"]) == {
        "chunk_size": 256, "local_cpu": False, "remote_url": "mooncakestore://10.0.0.1:50051/",
        "remote_serde": "naive", "extra_config": STORE_SETUP}
    assert "codec" not in files["README.txt"]


def test_the_codec_plugin_named_by_render_exists() -> None:
    """The gateway side names the engine-side connector as text (it never imports torch or
    LMCache): the module and class it names must be there."""
    module = CODEC_PLUGIN_KEYS["remote_storage_plugin.kvcodec.module_path"]
    source = Path(__file__).resolve().parents[3] / (
        module.removeprefix("kvgate.").replace(".", "/") + ".py")
    tree = ast.parse(source.read_text())
    classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    assert CODEC_PLUGIN_KEYS["remote_storage_plugin.kvcodec.class_name"] in classes
    assert f'PLUGIN_NAME = "{CODEC_PLUGIN}"' in source.read_text()


@pytest.mark.parametrize(("protocol", "media"), [
    ("lmcache-mooncake", ["cpu"]), ("nixl", None), ("mooncake", None), ("sglang", None)])
def test_a_fleet_with_a_shared_tier_routes_tier_aware(protocol: str, media: Any) -> None:
    """LMCache publishes its stored chunks with medium "cpu": the gateway files them under the
    shared tier (kv-events shared_media); fleets without a tier keep the default."""
    config = parse_config(yaml.safe_load(render(_fleet(protocol))["kvgate.yaml"]), "kvgate.yaml")
    [events] = [p for p in config.plugins if p.type == "kv-events"]
    assert events.params.get("shared_media") == media


@pytest.mark.parametrize(("master", "expected"), [
    ({"host": "10.0.0.1"}, "-rpc_address 10.0.0.1 -metrics_host 10.0.0.1 -metrics_port 9003"),
    ({"host": "10.0.0.1", "metrics_host": "0.0.0.0", "metrics_port": 9100},
     "-rpc_address 10.0.0.1 -metrics_host 0.0.0.0 -metrics_port 9100"),
])
def test_master_admin_server_binds_the_master_host_unless_told(
        master: dict[str, Any], expected: str) -> None:
    script = render(_fleet("lmcache-mooncake", mooncake_master=master))["mooncake-master.sh"]
    assert script.endswith(f"{expected}\n")


@pytest.mark.parametrize(("protocol", "connector", "labels"), [
    ("nixl", "vllm-nixl", None), ("mooncake", "vllm-mooncake", "8998"),
    ("lmcache-mooncake", "shared-store", None), ("sglang", "sglang", "8998"),
])
def test_gateway_config_builds(protocol: str, connector: str, labels: str | None) -> None:
    text = render(_fleet(protocol))["kvgate.yaml"]
    assert "&id" not in text
    config = parse_config(yaml.safe_load(text), "kvgate.yaml")
    assert config.disaggregation is not None and config.disaggregation.connector == connector
    assert [e.role.value for e in config.engines] == ["prefill", "prefill", "decode"]
    prefill0 = config.engines[0]
    assert prefill0.labels.get("bootstrap_port") == labels
    # SGLang ignores cache_salt: its engines are labelled so that cache-salt can say so
    assert {e.labels.get("engine") for e in config.engines} == (
        {"sglang"} if protocol == "sglang" else {None})
    build_pipeline(config, Registry.from_entry_points())


@pytest.mark.parametrize("protocol", ["nixl", "mooncake", "lmcache-mooncake", "sglang"])
def test_engines_publish_kv_events_and_the_gateway_consumes_them(protocol: str) -> None:
    """Every engine binds its own KV-event port (counting up per host); the gateway connects
    to each and routes with the cache-aware P/D preset (placement decides both hops)."""
    files = render(_fleet(protocol))
    vllm = protocol != "sglang"  # vLLM engines also bind a replay socket (5757 + n per host)
    for name, port in (("prefill-0", 5557), ("prefill-1", 5558), ("decode-0", 5557)):
        assert f'"endpoint":"tcp://*:{port}"' in files[f"{name}.sh"]
        assert (f'"replay_endpoint":"tcp://*:{port + 200}"' in files[f"{name}.sh"]) is vllm
    config = parse_config(yaml.safe_load(files["kvgate.yaml"]), "kvgate.yaml")
    assert [e.kv_events for e in config.engines] == [
        "tcp://10.0.0.2:5557", "tcp://10.0.0.2:5558", "tcp://10.0.0.3:5557"]
    assert [e.kv_events_replay for e in config.engines] == (
        ["tcp://10.0.0.2:5757", "tcp://10.0.0.2:5758", "tcp://10.0.0.3:5757"] if vllm
        else [None] * 3)
    types = [p.type for p in config.plugins]
    assert {"kv-events", "prefix-cache-producer", "kv-placement-scorer",
            "pd-profile-handler"} <= set(types)
    assert config.profile_handler == "pd-profile-handler"
    for profile in config.profiles:
        weighted = [r.ref for r in profile.plugins if r.weight]
        assert weighted == ["kv-placement-scorer"], profile


def test_no_replay_sockets_when_the_fleet_file_says_none() -> None:
    files = render(_fleet("nixl", kv_events_replay_port=None))
    assert "replay_endpoint" not in files["prefill-0.sh"]
    config = parse_config(yaml.safe_load(files["kvgate.yaml"]), "kvgate.yaml")
    assert [e.kv_events_replay for e in config.engines] == [None] * 3


def test_gateway_tokenizer_from_the_fleet_file() -> None:
    text = render(_fleet("nixl", tokenizer="/models/model-8b"))["kvgate.yaml"]
    tok = next(p for p in yaml.safe_load(text)["plugins"] if p["type"] == "tokenizer")
    assert tok["params"]["tokenizer"] == {"kind": "hf", "model_dir": "/models/model-8b"}


def test_command_writes_files(tmp_path: Path) -> None:
    spec = tmp_path / "fleet.yaml"
    spec.write_text(yaml.safe_dump(_fleet("nixl").model_dump(mode="json")))
    out = tmp_path / "out"
    assert cli.main(["deploy", "render", str(spec), "--out", str(out)]) == 0
    assert (out / "prefill-0.sh").read_text() == _one_line(NIXL_PREFILL_0)
    assert (out / "prefill-0.sh").stat().st_mode & 0o111


def test_command_rejects_bad_fleet(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "fleet.yaml"
    spec.write_text("model: m\nprotocol: carrier-pigeon\npools: {prefill: [], decode: []}\n")
    assert cli.main(["deploy", "render", str(spec), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "protocol" in err and "pools.prefill" in err


def _exec_args(script: str) -> list[str]:
    return shlex.split(next(line for line in script.splitlines() if line.startswith("exec ")))


AGENT_CASES = [
    # protocol, fleet extras, flags expected on every engine, store env expected
    ("nixl", {"tool_call_parser": "hermes"},
     ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"], False),
    ("mooncake", {"tool_call_parser": "qwen3_coder", "responses_store": True},
     ["--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder"], True),
    ("sglang", {"tool_call_parser": "qwen25", "responses_store": True},
     ["--tool-call-parser", "qwen25"], False),  # no auto flag, no vLLM store in SGLang
    ("nixl", {}, [], False),
]


@pytest.mark.parametrize(("protocol", "extra", "flags", "store"), AGENT_CASES)
def test_agent_ready_engines(protocol: str, extra: dict[str, Any], flags: list[str],
                             store: bool) -> None:
    """Coding agents send tools with automatic choice (vLLM: 400 without a parser) and
    Responses state needs vLLM's store: both rendered on every engine when asked for."""
    files = render(_fleet(protocol, **extra))
    for name in ("prefill-0.sh", "prefill-1.sh", "decode-0.sh"):
        args = _exec_args(files[name])
        if flags:
            at = args.index(flags[-1])
            assert args[at - len(flags) + 1 : at + 1] == flags
        assert ("--tool-call-parser" in args) == bool(flags)
        assert ("--enable-auto-tool-choice" in args) == ("--enable-auto-tool-choice" in flags)
        assert (_exports(files[name]).get("VLLM_ENABLE_RESPONSES_API_STORE") == "1") == store
    assert ("no tool_call_parser" in files["README.txt"]) == (not flags)
