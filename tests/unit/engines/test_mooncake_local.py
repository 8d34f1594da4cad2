"""Mooncake venv marker, master command and lifecycle (real child processes, no Mooncake), and the
LMCache-style setup mapping of the e2e store client."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvgate.engines.local import mooncake
from kvgate.engines.local.mooncake import MasterAddress, MooncakeError, running_master, stop_process
from kvgate.engines.ports import free_port
from tests.e2e.mooncake_store_client import setup_config


@pytest.mark.parametrize(("marker", "exe", "ready"), [
    (None, True, False),                      # half-built: no marker yet
    ("mooncake-transfer-engine-non-cuda==0.3.12", True, False),  # another version
    (mooncake.REQUIREMENT, False, False),     # marker but no executable
    (mooncake.REQUIREMENT, True, True),
])
def test_venv_marker_decides_reuse(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   marker: str | None, exe: bool, ready: bool) -> None:
    monkeypatch.setenv("KVGATE_HOME", str(tmp_path))
    mooncake.mooncake_bin().mkdir(parents=True)
    if marker is not None:
        (mooncake.mooncake_venv() / mooncake.MARKER).write_text(marker)
    if exe:
        (mooncake.mooncake_bin() / "mooncake_master").touch()
    assert mooncake.venv_ready() is ready


def test_missing_libibverbs_says_what_to_install(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGATE_HOME", str(tmp_path))
    monkeypatch.setattr(mooncake, "libibverbs_present", lambda: False)
    with pytest.raises(MooncakeError, match=r"apt-get install -y libibverbs1"):
        mooncake.ensure_mooncake_venv()
    assert not mooncake.mooncake_venv().exists()


def test_master_command_binds_rpc_and_admin_to_the_host() -> None:
    cmd = mooncake.master_command(MasterAddress("127.0.0.1", 50051, 9003))
    assert cmd[0].endswith("/bin/mooncake_master")
    assert cmd[1:] == ["-rpc_port", "50051", "-rpc_address", "127.0.0.1",
                       "-metrics_host", "127.0.0.1", "-metrics_port", "9003"]


def _addr() -> MasterAddress:
    return MasterAddress("127.0.0.1", free_port(), free_port())


@pytest.mark.parametrize(("script", "timeout_s", "message", "logged"), [
    ("echo boom-on-start; exit 3", 10.0, r"exited \(code 3\)", "boom-on-start"),
    ("echo still-starting; exec sleep 30", 0.5, r"not ready after", "still-starting"),
])
def test_master_startup_failures_carry_the_log_tail(tmp_path: Path, script: str, timeout_s: float,
                                                    message: str, logged: str) -> None:
    master = running_master(_addr(), tmp_path / "master.log", ["sh", "-c", script], timeout_s)
    with pytest.raises(MooncakeError, match=message) as info, master:
        pass
    assert f"log tail:\n{logged}" in str(info.value)


def test_stop_process_escalates_to_sigkill() -> None:
    code = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('up', flush=True); time.sleep(30)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "up\n"
    stop_process(proc, grace_s=0.3)
    assert proc.returncode == -9
    proc.stdout.close()


@pytest.mark.parametrize(("extra", "expected"), [
    # a rendered lmcache-<role>-<i>.yaml's extra_config
    ({"local_hostname": "10.0.0.3", "metadata_server": "P2PHANDSHAKE", "protocol": "tcp",
      "master_server_address": "10.0.0.1:50051", "mooncake_master_server_addr": "10.0.0.1:50051",
      "global_segment_size": 4 << 30, "local_buffer_size": 1 << 30},
     {"local_hostname": "10.0.0.3", "metadata_server": "P2PHANDSHAKE", "protocol": "tcp",
      "master_server_address": "10.0.0.1:50051", "master_server_addr": "10.0.0.1:50051",
      "global_segment_size": "4294967296", "local_buffer_size": "1073741824",
      "device_name": ""}),
    # prefixed keys win; LMCache-only and unknown keys stay out; defaults fill the rest
    ({"protocol": "rdma", "mooncake_protocol": "tcp", "mooncake_transfer_timeout": 5,
      "chunk_size": 256, "local_hostname": "h"},
     {"local_hostname": "h", "protocol": "tcp", "device_name": "",
      "global_segment_size": "3355443200", "local_buffer_size": "1073741824"}),
])
def test_store_client_maps_extra_config_like_lmcache(extra: dict[str, object],
                                                     expected: dict[str, str]) -> None:
    assert setup_config(extra) == expected
