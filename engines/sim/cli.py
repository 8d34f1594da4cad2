"""Command line of the simulated engine.

``python -m kvgate.engines.sim --port 8000 [...]`` serves one engine; ``kvgate sim [...] --count N``
(this module's :func:`register`) serves N engines on consecutive ports, one process each (so a
benchmark can spread them over cores). With ``--count``, engine *i* gets port ``P + i``, engine
id ``sim-<port>``, and a *binding* KV-events endpoint's port ``+ i`` (vLLM's data-parallel
rule); a *connecting* endpoint is shared (every engine connects to the gateway's SUB socket).
Prefill-role engines serve a Mooncake bootstrap server on ``--bootstrap-port`` (default 8998,
vLLM's ``VLLM_MOONCAKE_BOOTSTRAP_PORT`` default; ``+ i`` with ``--count``).
"""

from __future__ import annotations

import argparse
import logging
import signal
import subprocess
import sys
from collections.abc import Sequence

from kvgate.engines.sim.core.config import KvEventsConfig, PdSimConfig, SimConfig

#: vLLM's default ``VLLM_MOONCAKE_BOOTSTRAP_PORT`` (vllm/envs.py, 0.32).
DEFAULT_BOOTSTRAP_PORT = 8998


def add_sim_arguments(p: argparse.ArgumentParser) -> None:
    """The flags shared by ``python -m engines.sim`` and ``kvgate sim``."""
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="listen port (default 8000)")
    p.add_argument("--model", action="append", metavar="NAME",
                   help="served model name (repeatable; default sim-model)")
    p.add_argument("--engine-id", help="engine id (default sim-<port>)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (16)")
    p.add_argument("--capacity-blocks", type=int, default=4096, help="KV blocks (4096)")
    p.add_argument("--max-model-len", type=int, help="max prompt + completion tokens")
    p.add_argument("--max-num-seqs", type=int, default=256, help="max running sequences (256)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="token budget per step (8192)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="multiplies modelled H100 step times; 0 = no sleeping (1.0)")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated text (0)")
    p.add_argument("--no-prompt-tokens-details", action="store_true",
                   help="leave usage.prompt_tokens_details out (cached tokens unknown)")
    p.add_argument("--kv-events", metavar="ENDPOINT",
                   help="publish KV events: tcp://*:5557 binds, tcp://host:5557 connects")
    p.add_argument("--kv-events-encoding", choices=["tagged", "positional"], default="tagged",
                   help="event layout: tagged maps (newer vLLM) or positional arrays (older)")
    p.add_argument("--kv-events-topic", help="topic frame (default kv@<engine-id>@<model>)")
    p.add_argument("--log-level", default="warning", help="uvicorn log level (warning)")
    p.add_argument("--otlp-traces-endpoint", metavar="URL",
                   help="OTLP/HTTP collector base URL: one llm_request span per request, child "
                        "of its traceparent (needs kvgate[tracing])")
    p.add_argument("--role", choices=["both", "prefill", "decode"], default="both",
                   help="prefill/decode role (both; see docs/disaggregation.md)")
    p.add_argument("--bootstrap-port", type=int,
                   help="prefill role: Mooncake bootstrap server port (default "
                        f"{DEFAULT_BOOTSTRAP_PORT}; 0: any free port)")
    p.add_argument("--runner", choices=["generate", "pooling"], default="generate",
                   help="generate (chat, Messages, Responses...) or pooling (/v1/embeddings)")
    for flag, what in _AGENT_SWITCHES.items():
        p.add_argument(flag, action="store_true", help=what)


#: Off switches of the agent-API features (docs/simulator.md, "Agent APIs").
_AGENT_SWITCHES = {
    "--no-responses-store": "do not keep Responses (vLLM's default without "
                            "VLLM_ENABLE_RESPONSES_API_STORE=1)",
    "--no-auto-tool-choice": "refuse Messages tools with auto choice, as vLLM without "
                             "--enable-auto-tool-choice",
    "--no-scale-out": "render API off (403), as vLLM without --enable-scale-out",
}


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """A :class:`SimConfig` from parsed flags (raises pydantic's ValidationError if invalid)."""
    kv_events = None
    if args.kv_events:
        kv_events = KvEventsConfig(
            endpoint=args.kv_events, encoding=args.kv_events_encoding, topic=args.kv_events_topic
        )
    return SimConfig(
        engine_id=args.engine_id or f"sim-{args.port}",
        served_model_names=args.model or ["sim-model"],
        block_size=args.block_size,
        capacity_blocks=args.capacity_blocks,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        time_scale=args.time_scale,
        seed=args.seed,
        enable_prompt_tokens_details=not args.no_prompt_tokens_details,
        kv_events=kv_events,
        role=args.role,
        pd=PdSimConfig(bootstrap_port=_bootstrap_port(args, 0), bootstrap_host=args.host),
        runner=args.runner,
        responses_store=not args.no_responses_store,
        enable_auto_tool_choice=not args.no_auto_tool_choice,
        enable_scale_out=not args.no_scale_out,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
    )


def _bootstrap_port(args: argparse.Namespace, index: int) -> int | None:
    """Engine ``index``'s bootstrap port: prefill role only, the base port + ``index``."""
    if args.role != "prefill":
        return None
    base = DEFAULT_BOOTSTRAP_PORT if args.bootstrap_port is None else args.bootstrap_port
    return base + index if base else 0


def serve(config: SimConfig, host: str, port: int, log_level: str = "warning") -> int:
    """Serve one engine with uvicorn (uvloop, httptools, no access log) until interrupted."""
    import uvicorn

    from kvgate.engines.sim.http.server import create_sim_app

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s")
    uvicorn.run(
        create_sim_app(config), host=host, port=port, loop="uvloop", http="httptools",
        lifespan="on", access_log=False, log_level=log_level, server_header=False,
        date_header=False, timeout_keep_alive=30,
    )
    return 0


def _offset_port(endpoint: str, offset: int) -> str:
    """``tcp://*:5557`` + 2 → ``tcp://*:5559`` (binding endpoints only; others unchanged)."""
    from kvgate.engines.sim.core.kv_events import binds

    base, sep, port = endpoint.rpartition(":")
    if offset == 0 or not binds(endpoint) or not sep or not port.isdigit():
        return endpoint
    return f"{base}:{int(port) + offset}"


def child_argv(args: argparse.Namespace, index: int) -> list[str]:
    """The ``python -m engines.sim`` command line of engine ``index`` of ``--count``."""
    port = args.port + index
    argv = [sys.executable, "-m", "kvgate.engines.sim", "--host", args.host, "--port", str(port),
            "--engine-id", f"{args.engine_id}-{index}" if args.engine_id else f"sim-{port}"]
    for name in args.model or []:
        argv += ["--model", name]
    for flag in ("block_size", "capacity_blocks", "max_model_len", "max_num_seqs",
                 "max_num_batched_tokens", "time_scale", "seed", "kv_events_encoding",
                 "kv_events_topic", "log_level", "role", "runner", "otlp_traces_endpoint"):
        value = getattr(args, flag)
        if value is not None:
            argv += ["--" + flag.replace("_", "-"), str(value)]
    for flag in ("--no-prompt-tokens-details", *_AGENT_SWITCHES):
        if getattr(args, flag[2:].replace("-", "_")):
            argv.append(flag)
    bootstrap = _bootstrap_port(args, index)
    if bootstrap is not None:
        argv += ["--bootstrap-port", str(bootstrap)]
    if args.kv_events:
        argv += ["--kv-events", _offset_port(args.kv_events, index)]
    return argv


def _run_many(args: argparse.Namespace) -> int:
    """Start ``--count`` engine processes; stop them all when one exits or on Ctrl-C/SIGTERM."""
    procs = [subprocess.Popen(child_argv(args, i)) for i in range(args.count)]
    for i, proc in enumerate(procs):
        print(f"sim engine {i}: http://{args.host}:{args.port + i} (pid {proc.pid})", flush=True)

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        while all(p.poll() is None for p in procs):
            try:
                procs[0].wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                continue
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            p.wait(timeout=10)
    return max((p.returncode or 0 for p in procs), default=0)


def _cmd_sim(args: argparse.Namespace) -> int:
    config = config_from_args(args)  # validates the flags before anything starts
    if args.count > 1:
        return _run_many(args)
    return serve(config, args.host, args.port, args.log_level)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``kvgate sim`` to the ``kvgate`` command line."""
    p = subparsers.add_parser("sim", help="run simulated vLLM-compatible engines")
    add_sim_arguments(p)
    p.add_argument("--count", type=int, default=1,
                   help="engines to start on consecutive ports, one process each (1)")
    p.set_defaults(func=_cmd_sim)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m engines.sim``."""
    parser = argparse.ArgumentParser(prog="python -m kvgate.engines.sim",
                                     description="a simulated vLLM-compatible engine")
    add_sim_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return serve(config_from_args(args), args.host, args.port, args.log_level)
    except KeyboardInterrupt:
        return 130
