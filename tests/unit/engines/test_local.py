"""Local engine launcher: the command line, environment and state file (no engines started)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvgate.engines.local import venv
from kvgate.engines.local.launcher import (
    AGENT_ENV,
    LocalEngine,
    engine_args,
    engine_env,
    load_state,
    save_state,
)


@pytest.mark.parametrize(("events", "role", "present", "absent"), [
    (None, None, ["--enable-prefix-caching", "--enable-prompt-tokens-details", "-O0"],
     ["--kv-events-config", "--kv-transfer-config"]),
    ("tcp://127.0.0.1:5557", None, ["--kv-events-config"], ["--kv-transfer-config"]),
    (None, "prefill", ["--kv-transfer-config"], ["--kv-events-config"]),
])
def test_engine_args(events: str | None, role: str | None, present: list[str],
                     absent: list[str]) -> None:
    args = engine_args(Path("/m"), "vllm-0", 8000, events, role)  # type: ignore[arg-type]
    assert args[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert args[args.index("--kv-cache-memory-bytes") + 1] == "64M"
    assert all(p in args for p in present)
    assert not any(a in args for a in absent)
    if events:
        cfg = json.loads(args[args.index("--kv-events-config") + 1])
        assert cfg["endpoint"] == events
        assert cfg["topic"] == "kv@vllm-0"
    if role:
        cfg = json.loads(args[args.index("--kv-transfer-config") + 1])
        assert cfg == {"kv_connector": "NixlConnector", "kv_role": "kv_producer",
                       "kv_buffer_device": "cpu"}


def test_engine_env_pins_core_and_offline() -> None:
    env = engine_env(1, None)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert env["HF_HUB_OFFLINE"] == "1"
    pd = engine_env(0, "decode")
    assert pd["UCX_TLS"] == "tcp,self"
    assert pd["VLLM_NIXL_SIDE_CHANNEL_PORT"].isdigit()


def test_state_round_trip(tmp_path: Path) -> None:
    engines = [LocalEngine("vllm-0", 8000, 123, "/tmp/l", 1.0, None, 35.0)]
    save_state(engines, tmp_path / "fleet.json")
    assert load_state(tmp_path / "fleet.json") == engines
    assert load_state(tmp_path / "absent.json") == []


def test_venv_marker_decides_reuse(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGATE_HOME", str(tmp_path))
    assert not venv.venv_ready()
    (tmp_path / "engine-venv").mkdir()
    (tmp_path / "engine-venv" / venv.MARKER).write_text("stale")
    assert not venv.venv_ready()
    (tmp_path / "engine-venv" / venv.MARKER).write_text(venv._fingerprint())
    assert venv.venv_ready()


@pytest.mark.parametrize(("size", "arg"), [(64 << 20, "64M"), (40 << 20, "40M"),
                                           (1_000_000, "1000000")])
def test_kv_cache_bytes(size: int, arg: str) -> None:
    args = engine_args(Path("/m"), "vllm-0", 8000, None, None, kv_cache_bytes=size)
    assert args[args.index("--kv-cache-memory-bytes") + 1] == arg


def test_kv_events_bind_mode_binds_with_the_default_topic() -> None:
    args = engine_args(Path("/m"), "vllm-0", 8000, None, None, kv_events_bind_port=5599)
    cfg = json.loads(args[args.index("--kv-events-config") + 1])
    assert cfg == {"enable_kv_cache_events": True, "publisher": "zmq",
                   "endpoint": "tcp://*:5599"}  # no "topic": vLLM's default, empty
    with pytest.raises(ValueError, match="exclusive"):
        engine_args(Path("/m"), "vllm-0", 8000, "tcp://127.0.0.1:1", None,
                    kv_events_bind_port=5599)


def test_bound_engine_records_where_to_subscribe() -> None:
    bound = LocalEngine("vllm-0", 8000, 1, "/l", 0.0, extra={"kv_events": "tcp://127.0.0.1:7"})
    assert bound.kv_events == "tcp://127.0.0.1:7"
    assert LocalEngine("vllm-1", 8001, 2, "/l", 0.0).kv_events is None


def test_agent_engines_take_tools_and_keep_responses() -> None:
    """``kvgate engines up --agent-apis``: what Claude Code / Codex style clients need."""
    plain = engine_args(Path("/m"), "vllm-0", 8000, None, None)
    agent = engine_args(Path("/m"), "vllm-0", 8000, None, None, agent=True)
    assert agent[: len(plain)] == plain
    assert agent[len(plain):] == ["--enable-auto-tool-choice", "--tool-call-parser", "pythonic"]
    assert AGENT_ENV == {"VLLM_ENABLE_RESPONSES_API_STORE": "1"}
