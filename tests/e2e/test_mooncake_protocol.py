"""kvgate's ``vllm-mooncake`` hops checked against the installed vLLM (0.32) itself.

Method: import, not source reading. ``mooncake_vllm_probe.py`` runs under the engine venv's
python (the ``tiny_model`` fixture builds the venv and the model on first use) and feeds
request bodies to vLLM's own code: the API server's ``ChatCompletionRequest`` parse, a real
``Scheduler`` with ``MooncakeConnector`` as producer or consumer (its scheduler side, which
parses ``kv_transfer_params``, runs on CPU), vLLM's ``MooncakeBootstrapServer`` with a worker
registered through its own ``/register``, and the decode worker's bootstrap lookup function.

This test drives kvgate's real connector against that: ``prepare`` learns the engine id from
vLLM's bootstrap server (so the ``/query`` shape is vLLM's, not kvgate's idea of it), then
``prefill_body`` / ``decode_body`` make the bodies the probe schedules. Expected, from vLLM's
code: the prefill is registered to send under kvgate's ``transfer_id``, and keeps its KV for
the decode engine even when its one sampled token is EOS (kvgate sends ``ignore_eos``; without
it the producer finishes "stopped" and drops the transfer); the decode gets a pull from that
engine id, transfer id and bootstrap URL, and the lookup at that URL finds the engine; the
pre-0.32 shape (``bootstrap_server_host/port``) gets "Got invalid KVTransferParams", no pull,
and stays waiting for remote KV.

Not covered: the KV transfer itself. Real MooncakeConnector engines need the Mooncake transfer
engine and, by default, RDMA (``mooncake_protocol: rdma``) on GPUs; none of that runs on this
CPU machine, so no engine is started (docs/disaggregation.md).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from pathlib import Path
from typing import IO, Any

import aiohttp
import pytest

from kvgate.engines.connectors import MooncakeParams, VllmMooncakeConnector, transfer_id
from kvgate.engines.local.paths import engine_python
from kvgate.middleware.framework.connector import HopContext
from kvgate.middleware.framework.types import Api, Endpoint, InferenceRequest, Role

pytestmark = pytest.mark.e2e

PROBE = Path(__file__).with_name("mooncake_vllm_probe.py")
ENGINE_ID = "probe-prefill-engine"  # what the probe registers with vLLM's bootstrap server
BODY: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}],
                        "max_tokens": 8, "stream": True,
                        "stream_options": {"include_usage": True}}


def _line(proc: subprocess.Popen[str], log: Path) -> dict[str, Any]:
    """The probe's next ``PROBE {...}`` line (other lines: vLLM's access log)."""
    assert proc.stdout is not None
    while True:
        line = proc.stdout.readline()
        assert line, f"the probe exited ({proc.poll()}):\n{log.read_text()[-4000:]}"
        if line.startswith("PROBE "):
            data: dict[str, Any] = json.loads(line[len("PROBE "):])
            return data


async def _bodies(port: int) -> tuple[str, dict[str, dict[str, Any]]]:
    """kvgate's hop bodies for a prefill engine whose bootstrap server is on ``port``."""
    conn = VllmMooncakeConnector(MooncakeParams())
    prefill = Endpoint("prefill-0", "http://127.0.0.1:1", "vllm", role=Role.PREFILL,
                       labels={"bootstrap_port": str(port)})
    decode = Endpoint("decode-0", "http://127.0.0.1:2", "vllm", role=Role.DECODE)
    req = InferenceRequest("req-1", Api.CHAT, "tiny", dict(BODY), {}, True, True, 100,
                           time.monotonic())
    async with aiohttp.ClientSession() as session:
        ctx = await conn.prepare(session, HopContext("req-1", prefill, decode, room=7))
    assert ctx.prefill_engine_id is not None
    prefill_hop = conn.prefill_body(req, dict(BODY), ctx)
    eos_allowed = {k: v for k, v in prefill_hop.items() if k != "ignore_eos"}
    old = dict(conn.decode_body(req, dict(BODY), ctx, None))
    old["kv_transfer_params"] = {
        "do_remote_prefill": True, "do_remote_decode": False, "transfer_id": transfer_id(ctx),
        "bootstrap_server_host": "127.0.0.1", "bootstrap_server_port": port}
    return ctx.prefill_engine_id, {
        "prefill": {"role": "kv_producer", "body": prefill_hop},
        "prefill-eos-allowed": {"role": "kv_producer", "body": eos_allowed},
        "decode": {"role": "kv_consumer", "body": conn.decode_body(req, dict(BODY), ctx, None)},
        "decode-old": {"role": "kv_consumer", "body": old},
    }


def _run_probe(model: Path, tmp_path: Path) -> tuple[int, str, dict[str, Any], dict[str, Any]]:
    log = tmp_path / "probe.log"
    with log.open("w") as err:
        proc = subprocess.Popen([str(engine_python()), str(PROBE), str(model)], text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
        try:
            port = int(_line(proc, log)["bootstrap_port"])
            engine_id, cases = asyncio.run(_bodies(port))
            stdin: IO[str] | None = proc.stdin
            assert stdin is not None
            stdin.write(json.dumps({"cases": cases}) + "\n")
            stdin.flush()
            results = _line(proc, log)["results"]
        finally:
            proc.kill()
            proc.wait(30)
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()
    return port, engine_id, cases, results


def test_vllm_032_mooncake_connector_accepts_kvgate_hops(
    tiny_model: Path, tmp_path: Path,
) -> None:
    port, engine_id, cases, results = _run_probe(tiny_model, tmp_path)
    assert engine_id == ENGINE_ID  # learned from vLLM's own /query
    tid = cases["prefill"]["body"]["kv_transfer_params"]["transfer_id"]
    assert tid == cases["decode"]["body"]["kv_transfer_params"]["transfer_id"]

    prefill = results["prefill"]
    assert prefill["send"] == {"prefill": tid}  # registered to send under kvgate's id
    assert prefill["status"] == "RUNNING" and prefill["warnings"] == []
    # its one token was EOS: still length-capped, its 7 blocks held for the decode engine
    assert prefill["after_eos"] == {"status": "FINISHED_LENGTH_CAPPED",
                                    "send_blocks": {"prefill": [7]}, "not_processed": []}
    # the same without ignore_eos: stopped, the transfer dropped (why kvgate sends it)
    assert results["prefill-eos-allowed"]["after_eos"] == {
        "status": "FINISHED_STOPPED", "send_blocks": {}, "not_processed": [tid]}

    decode = results["decode"]
    assert decode["recv"] == {ENGINE_ID: {"decode": {
        "transfer_id": tid, "remote_engine_id": ENGINE_ID,
        "remote_bootstrap_addr": f"http://127.0.0.1:{port}"}}}
    assert decode["lookup_found"] == {ENGINE_ID: True}  # <addr>/query lists that engine
    assert decode["status"] == "WAITING_FOR_REMOTE_KVS" and decode["warnings"] == []

    old = results["decode-old"]
    assert old["recv"] == {} and old["status"] == "WAITING_FOR_REMOTE_KVS"
    assert any(w.startswith("Got invalid KVTransferParams") for w in old["warnings"])

