"""Feed request bodies to vLLM's own MooncakeConnector code; run with the ENGINE venv's python.

Used by tests/e2e/test_mooncake_protocol.py (this file imports vLLM, never kvgate). Line
protocol on stdin/stdout, one JSON object per line (on stdout after the prefix ``PROBE ``: vLLM's
servers print access logs there too):

1. It starts vLLM's ``MooncakeBootstrapServer`` on a free loopback port, registers one worker
   through the server's own ``POST /register`` (engine id ``ENGINE_ID``), and prints
   ``{"bootstrap_port": N}``.
2. It reads ``{"cases": {name: {"role": "kv_producer" | "kv_consumer", "body": {...}}}}``: chat
   request bodies. Each goes through vLLM's ``ChatCompletionRequest`` (the API server's parse,
   which moves ``kv_transfer_params`` into the sampling params), becomes an engine ``Request``
   and is scheduled once by a real ``Scheduler`` whose connector is ``MooncakeConnector`` in
   the case's role (the scheduler side needs no Mooncake transfer engine, so it runs on CPU).
   For each consumer request that got a pull scheduled, the decode worker's bootstrap lookup
   (``MooncakeConnectorWorker._connect_to_prefiller_bootstrap``: ``remote_bootstrap_addr`` +
   ``/query``, then the engine ids listed there) runs against the server of step 1.
   A producer request then gets one model step whose sampled token is the model's EOS (as if
   the prefill's one token had been end-of-sequence), and the next scheduler step shows what
   the connector made of its finish: KV blocks held for the decode engine (``reqs_to_send``
   with blocks) or the transfer dropped (``reqs_not_processed``).
3. It prints ``{"results": {name: {...}}}``: the request status after the step, the pulls and
   sends the connector scheduled (``reqs_to_recv`` / ``reqs_to_send``), whether the lookup found
   ``remote_engine_id``, the connector's warnings, and for producers ``after_eos``.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import sys
import types
import urllib.request
from typing import Any

import torch


def _from(module: str, *names: str) -> list[Any]:
    """``from module import names``, untyped (kvgate's type checker has no vLLM)."""
    mod = importlib.import_module(module)
    return [getattr(mod, n) for n in names]


CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig = _from(
    "vllm.config", "CacheConfig", "DeviceConfig", "KVTransferConfig", "ModelConfig",
    "SchedulerConfig", "VllmConfig")
mc = importlib.import_module(
    "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector")
MooncakeBootstrapServer, RegisterWorkerPayload = _from(
    "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_utils",
    "MooncakeBootstrapServer", "RegisterWorkerPayload")
(ChatCompletionRequest,) = _from("vllm.entrypoints.openai.chat_completion.protocol",
                                 "ChatCompletionRequest")
(sha256,) = _from("vllm.utils.hashing", "sha256")
get_request_block_hasher, init_none_hash = _from(
    "vllm.v1.core.kv_cache_utils", "get_request_block_hasher", "init_none_hash")
(Scheduler,) = _from("vllm.v1.core.sched.scheduler", "Scheduler")
FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec = _from(
    "vllm.v1.kv_cache_interface", "FullAttentionSpec", "KVCacheConfig", "KVCacheGroupSpec")
(Request,) = _from("vllm.v1.request", "Request")
(ModelRunnerOutput,) = _from("vllm.v1.outputs", "ModelRunnerOutput")
(StructuredOutputManager,) = _from("vllm.v1.structured_output", "StructuredOutputManager")

ENGINE_ID = "probe-prefill-engine"
EOS = 4  # the tiny test model's eos_token_id (engines/local/model.py)
BLOCK = 16
PROMPT = list(range(5, 105))  # 100 tokens: 6 full blocks + a partial one


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def scheduler(model: str, role: str) -> Any:
    vc = VllmConfig(
        model_config=ModelConfig(model=model, dtype="float32", seed=0),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256,
                                         max_model_len=1024, is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(kv_connector="MooncakeConnector", kv_role=role),
        device_config=DeviceConfig("cpu"),
    )
    vc.cache_config.num_gpu_blocks = 100
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=100, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    return Scheduler(vllm_config=vc, kv_cache_config=kv, log_stats=True,
                     structured_output_manager=StructuredOutputManager(vc), block_size=BLOCK)


def engine_request(name: str, body: dict[str, Any]) -> Any:
    api = ChatCompletionRequest.model_validate(body)
    params = api.to_sampling_params(max_tokens=api.max_tokens or 16, default_sampling_params={})
    params.update_from_generation_config({}, EOS)  # what the engine's input processor does
    return Request(request_id=name, prompt_token_ids=list(PROMPT), sampling_params=params,
                   pooling_params=None, block_hasher=get_request_block_hasher(BLOCK, sha256))


async def lookup(addr: str, engine_id: str) -> bool:
    """The decode worker's bootstrap lookup, run on a stand-in for the worker's state."""
    worker = types.SimpleNamespace(_remote_agents={}, _tp_size={},
                                   _pending_bootstrap_queries={addr: asyncio.Event()})
    await mc.MooncakeConnectorWorker._connect_to_prefiller_bootstrap(worker, addr)
    return engine_id in worker._remote_agents


def after_eos(sched: Any, out: Any, req: Any) -> dict[str, Any]:
    """One model step sampling EOS for ``req``, then what the connector holds or drops."""
    sched.update_from_output(out, ModelRunnerOutput(
        req_ids=[req.request_id], req_id_to_index={req.request_id: 0},
        sampled_token_ids=[[EOS]]))
    meta = sched.schedule().kv_connector_metadata
    return {"status": req.status.name,
            "send_blocks": {rid: [len(g) for g in blocks]
                            for rid, (_tid, blocks) in meta.reqs_to_send.items()},
            "not_processed": sorted(meta.reqs_not_processed)}


def run_case(sched: Any, name: str, body: dict[str, Any], caught: Warnings) -> dict[str, Any]:
    caught.lines.clear()
    req = engine_request(name, body)
    sched.add_request(req)
    out = sched.schedule()
    meta = out.kv_connector_metadata
    assert isinstance(meta, mc.MooncakeConnectorMetadata)
    recv = {engine: {rid: {"transfer_id": m.transfer_id, "remote_engine_id": m.remote_engine_id,
                           "remote_bootstrap_addr": m.remote_bootstrap_addr}
                     for rid, m in pulls.items()}
            for engine, pulls in meta.reqs_to_recv.items()}
    found = {engine: asyncio.run(lookup(m["remote_bootstrap_addr"], engine))
             for engine, pulls in recv.items() for m in pulls.values()}
    result = {"status": req.status.name, "recv": recv, "lookup_found": found,
              "send": {rid: tid for rid, (tid, _blocks) in meta.reqs_to_send.items()},
              "warnings": list(caught.lines)}
    if body.get("kv_transfer_params", {}).get("do_remote_decode"):
        result["after_eos"] = after_eos(sched, out, req)
    return result


def main() -> int:
    model = sys.argv[1]
    caught = Warnings()
    logging.getLogger("vllm").addHandler(caught)
    init_none_hash(sha256)
    server = MooncakeBootstrapServer("127.0.0.1", 0)
    server.start()
    payload = RegisterWorkerPayload(engine_id=ENGINE_ID, dp_rank=0, tp_rank=0, pp_rank=0,
                                    addr="tcp://127.0.0.1:5999")
    urllib.request.urlopen(urllib.request.Request(
        f"http://127.0.0.1:{server.port}/register", data=payload.model_dump_json().encode(),
        headers={"content-type": "application/json"}), timeout=10).read()
    print("PROBE", json.dumps({"bootstrap_port": server.port}), flush=True)
    cases = json.loads(sys.stdin.readline())["cases"]
    schedulers = {role: scheduler(model, role) for role in {c["role"] for c in cases.values()}}
    results = {name: run_case(schedulers[c["role"]], name, c["body"], caught)
               for name, c in cases.items()}
    print("PROBE", json.dumps({"results": results}), flush=True)
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
