"""The ``kvgate`` command line. Subcommands from other packages come in through the
``kvgate.commands`` entry-point group (``register(subparsers)``)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from kvgate.middleware.fleet.tokenizer_discovery import discover_tokenizer
from kvgate.middleware.framework.composition.config import (
    PD_CONNECTORS,
    GatewayConfig,
    ServerConfig,
    TracingConfig,
    load_config,
    with_billing,
    with_quotas,
    with_shared_state,
)
from kvgate.middleware.framework.composition.quickstart import QuickStart, quick_start_config
from kvgate.middleware.framework.composition.registry import command_registrars
from kvgate.middleware.framework.errors import ConfigError
from kvgate.middleware.process import CONFIG_ENV, WORKERS_ENV, configure_logging, tune_gc

log = logging.getLogger("kvgate.cli")


#: ``kvgate serve --http``: the HTTP/1.1 protocol uvicorn's server runs per connection.
#: ``kvgate``: middleware/transport/h1server.py (the default: less work per request, no
#: proxy-headers middleware); ``uvicorn``: uvicorn's own httptools protocol with its proxy-headers
#: middleware (what kvgate served with before; kept to compare, bench/overhead.py
#: ``kvgate-uvicorn``).
HTTP_FRONTS = {"kvgate": "kvgate.middleware.transport.h1server:H1Protocol", "uvicorn": "httptools"}


def serve_config(config: GatewayConfig, workers: int = 1, http: str = "kvgate") -> int:
    """Run the gateway under uvicorn's server (uvloop; the ``http`` front of
    :data:`HTTP_FRONTS`; no access log) until interrupted; ``workers`` > 1: that many gateway
    processes on one listening socket (middleware/workers.py).
    """
    import os

    import uvicorn

    from kvgate.middleware.app import create_app
    from kvgate.middleware.workers import check_workers, serialize

    configure_logging(config.server.log_level, config.server.access_log)
    check_workers(config, workers)
    if http == "uvicorn":
        log.warning("--http uvicorn: uvicorn's protocol lacks the URL, head and header-count "
                    "limits and the head and body deadlines of kvgate's front end "
                    "(docs/security.md, HTTP front-end limits): for comparisons, not for "
                    "clients you do not trust")
    app: Any = create_app(config)  # with workers too: config errors surface here, once
    if workers > 1:
        app = "kvgate.middleware.workers:worker_app"
        os.environ[CONFIG_ENV] = serialize(config)  # inherited by the spawned workers only
        os.environ[WORKERS_ENV] = str(workers)
    else:
        tune_gc()
    server = config.server
    uvicorn.run(
        app, factory=workers > 1, workers=workers, host=server.host,
        port=server.port, loop="uvloop", http=HTTP_FRONTS[http], lifespan="on",
        access_log=False, log_level=server.log_level, server_header=False,
        date_header=False, timeout_keep_alive=server.keep_alive_timeout_s,
        proxy_headers=http == "uvicorn", limit_concurrency=uvicorn_limit(server, http),
    )
    return 0


def uvicorn_limit(server: ServerConfig, http: str) -> int | None:
    """uvicorn's ``limit_concurrency`` for ``server.max_connections``: kvgate's front applies
    the limit itself (middleware/transport/h1limits.py); uvicorn's protocol answers 503 to every
    request while it has that many connections or requests (itself included), hence the one more."""
    return server.max_connections + 1 if http == "uvicorn" else None


def quick_start(args: argparse.Namespace) -> QuickStart:
    """The fleet the quick-start flags describe (the tokenizer found from the model when KV
    events are given without ``--tokenizer``: precise routing needs the engines' token ids)."""
    qs = QuickStart(
        engines=tuple(args.engine or ()), prefill=tuple(args.prefill or ()),
        decode=tuple(args.decode or ()), pd_protocol=args.pd_protocol,
        kv_events=tuple(args.kv_events or ()), kv_events_bind=args.kv_events_bind,
        kv_events_replay=tuple(args.kv_events_replay or ()),
        tokenizer=args.tokenizer, server=server_flags(args),
    )
    if qs.has_events and qs.tokenizer is None:
        urls = qs.engines or qs.decode or qs.prefill
        found = discover_tokenizer(urls[0])
        if found is None:
            log.warning("KV events are configured but no tokenizer was given or found from "
                        "the model (--tokenizer DIR): text prompts are routed on the gateway's "
                        "own record (approximate); only prompts sent as token ids match the "
                        "engines' KV events (precise)")
        else:
            log.info("tokenizer found from the model: %s", found)
        qs = dataclasses.replace(qs, tokenizer=found)
    return qs


def server_flags(args: argparse.Namespace) -> dict[str, object]:
    """The ``server`` settings given as flags (``--host``, ``--port``, ``--admin-port``,
    ``--engine-client``)."""
    given = (("host", args.host), ("port", args.port), ("admin_port", args.admin_port),
             ("engine_client", getattr(args, "engine_client", None)))
    return {k: v for k, v in given if v is not None}


def _cmd_serve(args: argparse.Namespace) -> int:
    quick = bool(args.engine or args.prefill or args.decode)
    if bool(args.config) == quick:
        raise ConfigError("kvgate serve: give either --config FILE, at least one --engine URL, "
                          "or --prefill URL ... --decode URL ...")
    if args.config and (args.kv_events or args.kv_events_bind or args.kv_events_replay
                        or args.tokenizer):
        raise ConfigError("--kv-events, --kv-events-bind, --kv-events-replay and --tokenizer "
                          "are quick-start flags: with --config, set them in the file "
                          "(docs/config.md)")
    if args.workers > 1 and args.kv_events_bind:
        raise ConfigError("--kv-events-bind binds one address, which one process only can do: "
                          "with --workers > 1 let the engines bind and give --kv-events ADDR "
                          "per engine (every worker connects to each)")
    if quick:
        config = quick_start_config(quick_start(args))
    else:
        config = load_config(args.config)
        try:
            server = ServerConfig.model_validate({**config.server.model_dump(),
                                                  **server_flags(args)})
        except ValidationError as exc:
            raise ConfigError(f"--host/--port/--admin-port/--engine-client: "
                              f"{exc.errors()[0]['msg']}") from None
        config = config.model_copy(update={"server": server})
    config = with_billing(config, prices=args.prices, ledger=args.ledger, keys=args.keys)
    config = with_quotas(with_shared_state(config, args.redis))
    return serve_config(with_tracing(config, args.otlp_endpoint), args.workers, args.http)


def with_tracing(config: GatewayConfig, endpoint: str | None) -> GatewayConfig:
    """``--otlp-endpoint URL``: tracing on, spans to ``URL/v1/traces`` (the config's other
    tracing settings kept); None: the config unchanged."""
    if endpoint is None:
        return config
    base = config.tracing.model_dump() if config.tracing is not None else {}
    try:
        tracing = TracingConfig.model_validate({**base, "otlp_endpoint": endpoint})
    except ValidationError:
        raise ConfigError(f"--otlp-endpoint {endpoint!r}: not an http(s) URL") from None
    return config.model_copy(update={"tracing": tracing})


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="run the gateway")
    p.add_argument("--config", help="YAML config file (see docs/config.md)")
    p.add_argument("--engine", action="append", metavar="URL",
                   help="engine base URL (repeatable); the cache-aware default preset")
    p.add_argument("--prefill", action="append", metavar="URL",
                   help="prefill engine base URL (repeatable; with --decode: P/D quick start)")
    p.add_argument("--decode", action="append", metavar="URL",
                   help="decode engine base URL (repeatable)")
    p.add_argument("--pd-protocol", choices=sorted(PD_CONNECTORS), default="nixl",
                   help="KV transfer protocol of the P/D engines (default nixl: vLLM "
                   "NixlConnector)")
    p.add_argument("--kv-events", action="append", metavar="ADDR",
                   help="ZMQ address of the engines' KV events, one per engine in order, or one "
                   "tcp://*:PORT for all (each engine binds PORT on its own host): precise "
                   "prefix routing with --tokenizer")
    p.add_argument("--kv-events-bind", metavar="ADDR",
                   help="the gateway binds this ZMQ address and the engines connect to it "
                   "(their topics must be kv@<engine name>: engine-0, prefill-0, ...)")
    p.add_argument("--kv-events-replay", action="append", metavar="ADDR",
                   help="the engines' KV-event replay sockets (vLLM's replay_endpoint), given "
                   "like --kv-events: lost batches and the history before the gateway "
                   "listened are asked for there")
    p.add_argument("--tokenizer", metavar="DIR",
                   help="the model's folder (tokenizer.json + chat template) for exact token "
                   "ids; with KV events and no --tokenizer, it is looked for from the model")
    p.add_argument("--host", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="listen port (default 8080)")
    p.add_argument("--admin-port", type=int, metavar="PORT",
                   help="a second port on the same host serving /metrics and the full /health "
                   "without a key, for Prometheus and probes (default: none; with --keys those "
                   "need an admin key on the API port)")
    p.add_argument("--prices", metavar="FILE",
                   help="price book (kvgate YAML or LiteLLM JSON): turns billing on")
    p.add_argument("--ledger", metavar="URL",
                   help="usage ledger: sqlite:///abs/path (default .kvgate/ledger.sqlite) "
                   "or postgresql://...")
    p.add_argument("--keys", metavar="FILE",
                   help="API keys file (kvgate keys create); without it auth is off")
    p.add_argument("--redis", metavar="URL",
                   help="redis://HOST:PORT/DB: state shared between gateway replicas (budgets, "
                   "quotas, keys, session pins; docs/operations.md); default: per process")
    p.add_argument("--otlp-endpoint", metavar="URL",
                   help="OpenTelemetry tracing on, spans sent over OTLP/HTTP to URL/v1/traces "
                   "(needs the 'tracing' extra; docs/observability.md)")
    p.add_argument("--workers", type=_positive, default=1, metavar="N",
                   help="gateway processes sharing the port (default 1); with N > 1 give --redis "
                   "so that they route as one (docs/operations.md)")
    p.add_argument("--http", choices=sorted(HTTP_FRONTS), default="kvgate",
                   help="HTTP/1.1 protocol (default kvgate: middleware/transport/h1server.py; "
                   "uvicorn: "
                   "uvicorn's httptools protocol, as before)")
    p.add_argument("--engine-client", choices=["aiohttp", "lean"],
                   help="the engine call's transport for http:// engines (server.engine_client; "
                   "default lean: middleware/transport/h1client.py)")
    p.set_defaults(func=_cmd_serve)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgate", description="cache-aware LLM gateway")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    for _name, register in sorted(command_registrars().items()):
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        code: int = args.func(args)
    except ConfigError as exc:
        print(f"kvgate: configuration error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
