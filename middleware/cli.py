"""The ``kvgate`` command line. Subcommands from other packages come in through the
``kvgate.commands`` entry-point group (``register(subparsers)``)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from middleware.config import (
    PD_CONNECTORS,
    GatewayConfig,
    config_from_engines,
    config_from_pd,
    load_config,
    with_billing,
)
from middleware.errors import ConfigError
from middleware.registry import command_registrars


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def serve_config(config: GatewayConfig) -> int:
    """Run the gateway with uvicorn (uvloop + httptools, no access log) until interrupted."""
    import uvicorn

    from middleware.app import create_app

    configure_logging(config.server.log_level)
    app = create_app(config)
    uvicorn.run(
        app, host=config.server.host, port=config.server.port, loop="uvloop", http="httptools",
        lifespan="on", access_log=False, log_level=config.server.log_level,
        server_header=False, date_header=False, timeout_keep_alive=30,
    )
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    pd = bool(args.prefill or args.decode)
    if sum((bool(args.config), bool(args.engine), pd)) != 1:
        raise ConfigError("kvgate serve: give either --config FILE, at least one --engine URL, "
                          "or --prefill URL ... --decode URL ...")
    if pd:
        config = config_from_pd(args.prefill or [], args.decode or [], args.pd_protocol,
                                host=args.host, port=args.port)
    elif args.config:
        config = load_config(args.config)
        server = config.server.model_copy(
            update={k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
        )
        config = config.model_copy(update={"server": server})
    else:
        config = config_from_engines(args.engine, host=args.host, port=args.port)
    config = with_billing(config, prices=args.prices, ledger=args.ledger, keys=args.keys)
    return serve_config(config)


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="run the gateway")
    p.add_argument("--config", help="YAML config file (see docs/config.md)")
    p.add_argument("--engine", action="append", metavar="URL",
                   help="engine base URL (repeatable); uses the default plugin profile")
    p.add_argument("--prefill", action="append", metavar="URL",
                   help="prefill engine base URL (repeatable; with --decode: P/D quick start)")
    p.add_argument("--decode", action="append", metavar="URL",
                   help="decode engine base URL (repeatable)")
    p.add_argument("--pd-protocol", choices=sorted(PD_CONNECTORS), default="nixl",
                   help="KV transfer protocol of the P/D engines (default nixl: vLLM "
                   "NixlConnector)")
    p.add_argument("--host", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="listen port (default 8080)")
    p.add_argument("--prices", metavar="FILE",
                   help="price book (kvgate YAML or LiteLLM JSON): turns billing on")
    p.add_argument("--ledger", metavar="URL",
                   help="usage ledger: sqlite:///abs/path (default .kvgate/ledger.sqlite) "
                   "or postgresql://...")
    p.add_argument("--keys", metavar="FILE",
                   help="API keys file (kvgate keys create); without it auth is off")
    p.set_defaults(func=_cmd_serve)


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
