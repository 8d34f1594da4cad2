"""``kvgate demo``: the embedded default — the gateway with the cache-aware profile in front of a
small simulated fleet publishing KV events, in one process, with no external services. Prints
the URL and an example ``curl``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys

import uvicorn
import uvloop

from kvgate.engines.ports import free_port
from kvgate.engines.sim.core.config import KvEventsConfig, SimConfig
from kvgate.engines.sim.testing import serve_sim
from kvgate.middleware.app import create_app
from kvgate.middleware.framework.composition.config import GatewayConfig
from kvgate.middleware.framework.composition.quickstart import QuickStart, quick_start_config
from kvgate.middleware.process import configure_logging

log = logging.getLogger("kvgate.demo")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("demo", help="run the gateway with a simulated engine fleet (no services)")
    p.add_argument("--engines", type=int, default=3, help="simulated engines (default 3)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="1.0 = H100-calibrated timing, 0 = instant (default 1.0)")
    p.add_argument("--duration", type=float, default=0.0,
                   help="stop after this many seconds (0: run until interrupted)")
    p.set_defaults(func=_cmd_demo)


def _cmd_demo(args: argparse.Namespace) -> int:
    if args.engines < 1:
        print("kvgate demo: --engines must be at least 1", file=sys.stderr)
        return 2
    configure_logging("warning")
    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(_run(args))
    return 0


def _banner(url: str, engines: list[str]) -> str:
    body = '{"model": "sim-model", "messages": [{"role": "user", "content": "Hello!"}]}'
    return (
        f"kvgate demo: gateway at {url} in front of {len(engines)} simulated engines\n"
        + "".join(f"  engine {u}\n" for u in engines)
        + f"try:\n  curl -s {url}/v1/chat/completions -H 'content-type: application/json' "
        f"-d '{body}'\n  curl -s {url}/metrics | grep kvgate_\n"
        "Ctrl-C stops it."
    )


def cache_aware_config(
    urls: list[str], events_address: str, host: str = "127.0.0.1", port: int = 8080
) -> GatewayConfig:
    """The quick start's default preset over simulated engines, precise: the sim tokenizer and
    the engines' KV events (the gateway binds ``events_address``; engine ``engine-i`` publishes
    topic ``kv@engine-i``)."""
    qs = QuickStart(engines=tuple(urls), kv_events_bind=events_address, tokenizer="sim",
                    server={"host": host, "port": port})
    config = quick_start_config(qs)
    pool = config.pool.model_copy(update={"health_interval_s": 1.0, "metrics_interval_s": 1.0})
    return config.model_copy(update={"pool": pool})


def sim_config(i: int, events_address: str, time_scale: float) -> SimConfig:
    events = KvEventsConfig(endpoint=events_address, topic=f"kv@engine-{i}")
    return SimConfig(engine_id=f"engine-{i}", time_scale=time_scale, seed=i, kv_events=events)


async def _run(args: argparse.Namespace) -> None:
    async with contextlib.AsyncExitStack() as stack:
        events = f"tcp://127.0.0.1:{free_port()}"
        urls = []
        for i in range(args.engines):
            sim = await stack.enter_async_context(
                serve_sim(sim_config(i, events, args.time_scale))
            )
            urls.append(sim.url)
        app = create_app(cache_aware_config(urls, events, args.host, args.port))
        server = uvicorn.Server(uvicorn.Config(
            app, host=args.host, port=args.port, lifespan="on", log_level="warning",
            access_log=False, http="httptools",
        ))
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():  # noqa: ASYNC110 - uvicorn has no event
            await asyncio.sleep(0.05)
        if task.done():
            await task
            return
        print(_banner(f"http://{args.host}:{args.port}", urls), flush=True)
        if args.duration > 0:
            await asyncio.sleep(args.duration)
            server.should_exit = True
        await task
