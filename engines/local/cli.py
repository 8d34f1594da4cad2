"""``kvgate engines setup|mooncake-setup|build-model|up|down``: the local vLLM CPU fleet."""

from __future__ import annotations

import argparse
import sys
import time

from kvgate.engines.local.fleet import start_fleet, start_pd_pair
from kvgate.engines.local.launcher import load_state, rss_mib, save_state, stop
from kvgate.engines.local.model import ensure_model
from kvgate.engines.local.mooncake import MooncakeError, ensure_mooncake_venv
from kvgate.engines.local.paths import fleet_state_file
from kvgate.engines.local.venv import ensure_engine_venv


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("engines", help="local vLLM CPU engines (tiny offline model)")
    esub = p.add_subparsers(dest="engines_command", required=True)
    esub.add_parser("setup", help="create the engine venv (idempotent)").set_defaults(
        func=lambda a: _setup())
    esub.add_parser("mooncake-setup", help="create the Mooncake Store venv (idempotent)"
                    ).set_defaults(func=lambda a: _mooncake_setup())
    b = esub.add_parser("build-model", help="build the tiny model offline")
    b.add_argument("--seed", type=int, default=0)
    b.set_defaults(func=lambda a: _build(a.seed))
    up = esub.add_parser("up", help="start engines and leave them running")
    up.add_argument("--count", type=int, default=2)
    up.add_argument("--kv-events", help="ZMQ address the engines publish KV events to")
    up.add_argument("--pd", action="store_true", help="a NixlConnector prefill/decode pair")
    up.add_argument("--agent-apis", action="store_true",
                    help="tools with automatic choice (pythonic parser) and vLLM's Responses "
                         "store, for Claude Code / Codex style clients")
    up.set_defaults(func=_up)
    esub.add_parser("down", help="stop the engines 'up' started").set_defaults(func=_down)


def _setup() -> int:
    started = time.monotonic()
    ensure_engine_venv()
    print(f"engine venv ready after {time.monotonic() - started:.0f} s")
    return 0


def _mooncake_setup() -> int:
    try:
        python = ensure_mooncake_venv()
    except MooncakeError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"mooncake_master: {python.with_name('mooncake_master')}")
    return 0


def _build(seed: int) -> int:
    print(ensure_model(seed))
    return 0


def _up(args: argparse.Namespace) -> int:
    if load_state(fleet_state_file()):
        print("engines are already up (kvgate engines down first)")
        return 1
    engines = start_pd_pair() if args.pd else start_fleet(args.count, args.kv_events,
                                                          agent=args.agent_apis)
    save_state(engines, fleet_state_file())
    for e in engines:
        print(f"{e.name}\t{e.url}\trole={e.role or 'both'}\trss={rss_mib(e):.0f} MiB\tlog={e.log}")
    print("gateway: kvgate serve " + " ".join(f"--engine {e.url}" for e in engines))
    return 0


def _down(args: argparse.Namespace) -> int:
    engines = load_state(fleet_state_file())
    for engine in engines:
        stop(engine)
        print(f"stopped {engine.name} (pid {engine.pid})")
    fleet_state_file().unlink(missing_ok=True)
    return 0
