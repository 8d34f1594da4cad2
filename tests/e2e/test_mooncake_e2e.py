"""``kvgate deploy render``'s lmcache-mooncake output against a real Mooncake master over TCP.

The fleet (2 prefill + 1 decode engines, loopback, free ports, ``transfer_protocol: tcp``) goes
through the real ``kvgate deploy render`` CLI; the rendered ``mooncake-master.sh`` itself starts
the master (the Mooncake venv's ``bin`` first on ``PATH``); store clients in separate processes
of the Mooncake venv are configured from the rendered ``lmcache-<role>-<i>.yaml`` files the way
LMCache's connector reads them (tests/e2e/mooncake_store_client.py). Only the segment and
buffer sizes are shrunk (4 GiB/1 GiB rendered; 64 MiB/32 MiB here, a 2-core 24 GiB machine).
The Mooncake venv is built on first use (~10 s) and reused afterwards.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import re
import selectors
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvgate.engines.kvcodec.venv import engine_env, engine_side_path, ensure_codec_env
from kvgate.engines.local.lmcache import ensure_lmcache_venv
from kvgate.engines.local.mooncake import (
    MasterAddress,
    ensure_mooncake_venv,
    mooncake_venv,
    running_master,
    stop_process,
)
from kvgate.engines.ports import free_port

pytestmark = pytest.mark.e2e

KVGATE = str(Path(sys.executable).with_name("kvgate"))
CLIENT = str(Path(__file__).with_name("mooncake_store_client.py"))
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
#: One 256-token LMCache chunk of the tiny test model in bfloat16: 4 layers x (K, V) x 256
#: tokens x 256 (4 KV heads x 64) x 2 bytes = 1 MiB.
BLOB = 1 << 20
SEED = 20261123
#: An LMCache key: model@world_size@worker_id@chunk hash (hex)@dtype.
KEY = f"{MODEL}@1@0@{random.Random(SEED).getrandbits(64):016x}@bfloat16"
SEGMENT, BUFFER = 64 << 20, 32 << 20
CLIENT_TIMEOUT_S = 60.0
CODEC_CLIENT = str(Path(__file__).with_name("kvcodec_store_client.py"))
LMCACHE_CLIENT = str(Path(__file__).with_name("lmcache_codec_client.py"))
#: One vLLM-style KV block of the real model the codec client reads K/V from
#: (all-MiniLM-L6-v2): 16 tokens x 12 heads x 32 head_dim.
CODEC_BLOCK_VALUES = 16 * 384


@pytest.fixture(scope="session")
def mooncake_python() -> Path:
    started = time.monotonic()
    python = ensure_mooncake_venv()
    print(f"mooncake venv ready after {time.monotonic() - started:.1f} s")
    return python


def _fleet() -> dict[str, Any]:
    def engine() -> dict[str, Any]:
        return {"host": "127.0.0.1", "port": free_port(), "side_port": free_port()}
    return {"model": MODEL, "protocol": "lmcache-mooncake", "transfer_protocol": "tcp",
            "mooncake_master": {"host": "127.0.0.1", "rpc_port": free_port(),
                                "metrics_port": free_port()},
            "pools": {"prefill": [engine(), engine()], "decode": [engine()]}}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    tmp = tmp_path_factory.mktemp("mooncake-deploy")
    fleet = _fleet()
    (tmp / "fleet.yaml").write_text(yaml.safe_dump(fleet))
    out = tmp / "out"
    subprocess.run([KVGATE, "deploy", "render", str(tmp / "fleet.yaml"), "--out", str(out)],
                   check=True, capture_output=True, timeout=60)
    return fleet, out


@pytest.fixture(scope="module")
def master(rendered: tuple[dict[str, Any], Path], mooncake_python: Path) -> Iterator[MasterAddress]:
    fleet, out = rendered
    spec = fleet["mooncake_master"]
    addr = MasterAddress(spec["host"], spec["rpc_port"], spec["metrics_port"])
    with running_master(addr, out.parent / "master.log",
                        command=["sh", str(out / "mooncake-master.sh")]) as ready:
        yield ready


def _extra_config(out: Path, engine: str) -> dict[str, Any]:
    data = yaml.safe_load((out / f"lmcache-{engine}.yaml").read_text())
    extra: dict[str, Any] = data["extra_config"]
    return {**extra, "global_segment_size": SEGMENT, "local_buffer_size": BUFFER}


def _client(python: Path, mode: str, extra: dict[str, Any]) -> list[str]:
    return [str(python), CLIENT, mode, json.dumps(extra), KEY, str(BLOB), str(SEED)]


def _read_line(proc: subprocess.Popen[str], log: Path) -> dict[str, Any]:
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(CLIENT_TIMEOUT_S):
            raise AssertionError(f"store client silent; log tail:\n{log.read_text()[-3000:]}")
    line = proc.stdout.readline()
    assert line, f"store client exited {proc.poll()}; log tail:\n{log.read_text()[-3000:]}"
    result: dict[str, Any] = json.loads(line)
    return result


@contextlib.contextmanager
def holder(python: Path, extra: dict[str, Any], log: Path) -> Iterator[dict[str, Any]]:
    """A client that put the blob and keeps it (its segment) alive until the block ends."""
    with held(_client(python, "hold", extra), log) as put:
        yield put


@contextlib.contextmanager
def held(cmd: list[str], log: Path, env: dict[str, str] | None = None
         ) -> Iterator[dict[str, Any]]:
    """A client ``cmd`` that puts, prints a line and holds its objects until the block ends."""
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                text=True, env=env)
    try:
        yield _read_line(proc, log)
        assert proc.stdin is not None
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert _read_line(proc, log) == {"close": 0}
        proc.wait(CLIENT_TIMEOUT_S)
    finally:
        stop_process(proc)
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()


def _read(python: Path, extra: dict[str, Any], log: Path) -> dict[str, Any]:
    with log.open("w") as err:
        done = subprocess.run(_client(python, "read", extra), stdout=subprocess.PIPE,
                              stderr=err, text=True, timeout=CLIENT_TIMEOUT_S, check=False)
    assert done.returncode == 0, f"reader failed; log tail:\n{log.read_text()[-3000:]}"
    lines = done.stdout.splitlines()
    assert json.loads(lines[-1]) == {"close": 0}
    result: dict[str, Any] = json.loads(lines[0])
    return result


def _admin(addr: MasterAddress, path: str) -> str:
    with urllib.request.urlopen(addr.admin_url + path, timeout=5) as resp:
        return str(resp.read().decode())


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def test_rendered_store_configs_point_every_engine_at_the_master(
        rendered: tuple[dict[str, Any], Path]) -> None:
    fleet, out = rendered
    m = fleet["mooncake_master"]
    engines = ["prefill-0", "prefill-1", "decode-0"]
    assert {p.name for p in out.glob("lmcache-*.yaml")} == {f"lmcache-{e}.yaml" for e in engines}
    for engine in engines:
        data = yaml.safe_load((out / f"lmcache-{engine}.yaml").read_text())
        assert data["remote_storage_plugins"] == ["kvcodec"]  # the codec's data path
        assert data["extra_config"]["master_server_address"] == f"127.0.0.1:{m['rpc_port']}"
        assert data["extra_config"]["protocol"] == "tcp"
        assert data["extra_config"]["local_hostname"] == "127.0.0.1"
        assert f"LMCACHE_CONFIG_FILE=lmcache-{engine}.yaml" in (out / f"{engine}.sh").read_text()


def test_rendered_master_script_serves_rpc_and_admin(
        rendered: tuple[dict[str, Any], Path], master: MasterAddress) -> None:
    started = (rendered[1].parent / "master.log").read_text()
    assert f"rpc_port={master.rpc_port}," in started
    assert "metrics_host=127.0.0.1," in started  # the admin side is not on every interface
    health = json.loads(_admin(master, "/health"))
    assert health["status"] == "ok" and health["service_ready"] is True
    assert _metric(_admin(master, "/metrics"), "master_key_count") == 0


def test_kv_put_by_one_engine_is_read_byte_exact_by_the_others(
        rendered: tuple[dict[str, Any], Path], master: MasterAddress, mooncake_python: Path,
        tmp_path: Path) -> None:
    _, out = rendered
    expected = hashlib.sha256(random.Random(SEED).randbytes(BLOB)).hexdigest()
    with holder(mooncake_python, _extra_config(out, "prefill-0"), tmp_path / "hold.log") as put:
        assert put == {"put": 0, "is_exist": 1}
        metrics = _admin(master, "/metrics")
        assert _metric(metrics, "master_total_capacity_bytes") == SEGMENT  # the holder's segment
        assert _metric(metrics, "master_key_count") == 1
        assert _metric(metrics, "master_put_end_requests_total") >= 1
        assert _metric(metrics, "master_put_end_failures_total") == 0
        assert KEY in _admin(master, "/get_all_keys").splitlines()
        # The admin server does not percent-decode: the key's "/" and "@" go as they are.
        replicas = json.loads(_admin(master, "/query_key?key=" + urllib.parse.quote(KEY, "/@")))
        [replica] = replicas["data"]
        assert replica["size_"] == BLOB and replica["protocol_"] == "tcp"
        assert replica["transport_endpoint_"].startswith("127.0.0.1:")
        for engine in ("decode-0", "prefill-1"):
            got = _read(mooncake_python, _extra_config(out, engine), tmp_path / f"{engine}.log")
            assert got == {"len": BLOB, "sha256": expected, "is_exist": 1,
                           "batch_is_exist": [1, 0], "absent_len": 0}, engine
    deadline = time.monotonic() + 30
    while KEY in _admin(master, "/get_all_keys").splitlines():  # it lived in the holder's memory
        assert time.monotonic() < deadline, "key still listed after its holder closed"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def codec_python() -> Path:
    return ensure_codec_env(progress=print)


def test_codec_store_round_trips_real_kv_through_the_store(
        rendered: tuple[dict[str, Any], Path], master: MasterAddress, mooncake_python: Path,
        codec_python: Path, tmp_path: Path) -> None:
    """kvgate.engines.kvcodec.store.CodecStore over the rendered configs: prefill-0 puts real K/V
    (encoded), decode-0 gets and decodes it in another process: same bits, fewer bytes."""
    _, out = rendered
    site = str(next((mooncake_venv() / "lib").glob("python*/site-packages")))

    def cmd(mode: str, engine: str) -> list[str]:
        return [str(codec_python), CODEC_CLIENT, mode, site,
                json.dumps(_extra_config(out, engine)), str(CODEC_BLOCK_VALUES)]

    with engine_side_path() as path:
        env = engine_env(path)
        with held(cmd("hold", "prefill-0"), tmp_path / "hold.log", env) as put:
            assert sorted(put) == sorted(f"kv/{k}/{i}" for k in "KV" for i in range(6))
            for key, row in put.items():
                assert row["put"] == 0, key
                assert row["stored"] <= 0.72 * row["raw"], key  # >= 28 % saved per tensor
            done = subprocess.run(cmd("read", "decode-0"), input=json.dumps(list(put)) + "\n",
                                  capture_output=True, text=True, env=env,
                                  timeout=CLIENT_TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    got, closed = (json.loads(line) for line in done.stdout.splitlines()[-2:])
    assert closed == {"close": 0}
    assert got["absent"] is True
    assert got["got"] == {key: {"len": row["stored"], "sha256": row["sha256"],
                                "shape": row["shape"]} for key, row in put.items()}


@pytest.fixture(scope="module")
def lmcache_python(codec_python: Path, mooncake_python: Path) -> Path:
    return ensure_lmcache_venv(progress=print)


def _lmcache_config(out: Path, engine: str, tmp: Path) -> str:
    """The rendered lmcache-<engine>.yaml with the store's segment and buffer shrunk."""
    data = yaml.safe_load((out / f"lmcache-{engine}.yaml").read_text())
    data["extra_config"].update(global_segment_size=SEGMENT, local_buffer_size=BUFFER)
    path = tmp / f"lmcache-{engine}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_lmcache_stores_real_kv_encoded_and_another_process_reads_it_bit_exact(
        rendered: tuple[dict[str, Any], Path], master: MasterAddress, lmcache_python: Path,
        tmp_path: Path) -> None:
    """The codec in LMCache's data path (issue 32): prefill-0's LMCache (its own RemoteBackend,
    the rendered config's remote storage plugin) puts one chunk of real K/V; decode-0's LMCache,
    a separate process, gets it back: same bits, shape and format; the store holds >= 30 %
    fewer bytes than the chunk."""
    _, out = rendered

    def cmd(mode: str, engine: str) -> list[str]:
        return [str(lmcache_python), LMCACHE_CLIENT, mode,
                _lmcache_config(out, engine, tmp_path)]

    with engine_side_path() as path:
        env = engine_env(path)
        with held(cmd("hold", "prefill-0"), tmp_path / "hold.log", env) as put:
            assert put["contains"] is True
            assert put["raw"] == 2 * 6 * 256 * 384 * 2
            saving = 1 - put["stored"] / put["raw"]
            print(f"LMCache chunk: {put['raw']} B raw, {put['stored']} B stored, "
                  f"saving {saving:.4f}")
            assert saving >= 0.30, saving
            assert put["key"] in _admin(master, "/get_all_keys").splitlines()
            with (tmp_path / "read.log").open("w") as err:
                done = subprocess.run(cmd("read", "decode-0"), input=json.dumps(put["key"]) + "\n",
                                      stdout=subprocess.PIPE, stderr=err, text=True, env=env,
                                      timeout=CLIENT_TIMEOUT_S * 2, check=False)
    log = (tmp_path / "read.log").read_text()[-3000:]
    assert done.returncode == 0, log
    got, closed = (json.loads(line) for line in done.stdout.splitlines()[-2:])
    assert closed == {"close": 0}
    assert got == {"found": True, "sha256": put["sha256"], "shape": [2, 6, 256, 384],
                   "dtype": "torch.bfloat16", "fmt": "KV_2LTD", "stored": put["stored"],
                   "absent": True}
