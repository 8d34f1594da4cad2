"""kvgate's ASGI app served by granian instead of uvicorn's server (bench/systems.py
``kvgate-granian``): the config ``kvgate serve --engine URL`` builds, handed to granian's one
worker through the workers' factory (middleware/workers.py ``worker_app``), so the app, its
plugins and its engine call are kvgate's own and only the HTTP server differs.

Run: ``python -m bench.granian_kvgate --engine http://127.0.0.1:8100 --port 8000``
(granian must be installed: ``pip install granian``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Sequence

from kvgate.middleware.framework.composition.quickstart import QuickStart, quick_start_config
from kvgate.middleware.process import CONFIG_ENV, WORKERS_ENV
from kvgate.middleware.workers import serialize


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engine", action="append", required=True, metavar="URL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    args = parser.parse_args(argv)
    config = quick_start_config(QuickStart(engines=tuple(args.engine),
                                           server={"host": args.host, "port": args.port}))
    granian = shutil.which("granian", path=os.path.dirname(sys.executable)) or "granian"
    env = {**os.environ, CONFIG_ENV: serialize(config), WORKERS_ENV: "1"}
    os.execve(granian, [
        granian, "--interface", "asgi", "--host", args.host, "--port", str(args.port),
        "--workers", "1", "--loop", "uvloop", "--runtime-mode", "st", "--no-ws",
        "--log-level", "warning", "--factory", "kvgate.middleware.workers:worker_app",
    ], env)


if __name__ == "__main__":
    raise SystemExit(main())
