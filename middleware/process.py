"""Process setup shared by ``kvgate serve`` (middleware/cli.py) and its ``--workers`` processes
(middleware/workers.py): logging, the garbage collector's tuning, the environment a parent
hands its workers. Nothing runs at import time."""

from __future__ import annotations

import logging

from kvgate.middleware.framework.composition.config import AccessLogConfig

#: The parent's validated config, as JSON, for its spawned workers.
CONFIG_ENV = "KVGATE_WORKER_CONFIG"
#: How many worker processes serve the listening socket (absent: 1).
WORKERS_ENV = "KVGATE_WORKERS"


def configure_logging(level: str, access_log: AccessLogConfig | None = None) -> None:
    """The gateway's log on stderr; with ``access_log``, the access log's own handler
    (middleware/observe/access_log.py: JSON lines on stderr or in its file)."""
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if access_log is not None:
        from kvgate.middleware.observe.access_log import install_handler

        install_handler(access_log)


#: Allocations between young-generation collections in a serving process (CPython's default
#: is 700). A request allocates a few thousand short-lived objects; at 700 most collections
#: find them still alive and promote them, and older generations fill and get scanned in turn.
GC_YOUNG_THRESHOLD = 20_000


def tune_gc() -> None:
    """For a serving process, once its app is built: what exists now (modules, classes, the
    config, the plugins) is moved out of the collector's sight (``gc.freeze``: it lives as
    long as the process anyway), so a full collection scans only what requests created; and
    young collections run less often (:data:`GC_YOUNG_THRESHOLD`). Reference counting still
    frees almost everything at once; this only changes how often cycles are looked for."""
    import gc

    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)
