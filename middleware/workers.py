"""``kvgate serve --workers N``: N gateway processes on one port, so one host uses its cores.

uvicorn's supervisor binds the listening socket once and starts N worker processes (``spawn``)
that accept on it; each worker is a whole gateway (its own pipeline, engine pool, plugins),
built by :func:`worker_app` from the parent's validated config, handed over as JSON in the
``KVGATE_WORKER_CONFIG`` environment variable (the child environment only: never logged).

What several processes change (docs/operations.md, "Topology"):

* Routing state (in-flight load, session pins) is per process unless ``shared_state`` /
  ``--redis`` is set: without it the workers route apart, which :func:`check_workers` warns about.
* A gateway-bound KV-event socket (a plugin param ``bind``: engines connect to the gateway)
  can be bound by one process only: with workers, the engines must bind and every worker
  connects (``--kv-events``); :func:`check_workers` refuses the config otherwise.
* ``/metrics`` and ``/health`` answer for the worker that accepted the connection.
* Per-process files: each worker claims a slot ``i`` (the first free ``flock`` of
  ``.kvgate/worker-<i>.lock``; a dead worker's slot is freed by the kernel) and every plugin
  param named ``spool`` (a directory one process locks, e.g. the ledger's) gets the suffix
  ``.worker-<i>`` for slots above 0, so worker 0 keeps the single-process path and a
  restarted worker replays its predecessor's spool. Shared files (SQLite in WAL mode) stay
  shared.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
from pathlib import Path

from kvgate.middleware.framework.composition.config import GatewayConfig, parse_config
from kvgate.middleware.framework.composition.registry import Registry
from kvgate.middleware.framework.errors import ConfigError
from kvgate.middleware.process import CONFIG_ENV, WORKERS_ENV, configure_logging, tune_gc

log = logging.getLogger("kvgate.workers")



def check_workers(config: GatewayConfig, workers: int) -> None:
    """Refuse what N processes cannot do; warn when they will route apart."""
    if workers <= 1:
        return
    for plugin in config.plugins:
        bind = plugin.params.get("bind")
        if bind:
            raise ConfigError(
                f"plugin {plugin.instance_name!r} binds {bind!r}, which one process only can do: "
                "with --workers > 1 let the engines bind their KV-event sockets and connect to "
                "each (--kv-events ADDR per engine instead of --kv-events-bind)")
    if config.shared_state is None:
        log.warning(
            "%d workers without shared state (--redis URL or shared_state.redis_url): each "
            "worker routes on its own in-flight load and session pins, so routing drifts "
            "apart under load", workers)


def serialize(config: GatewayConfig) -> str:
    """The config as the workers rebuild it (JSON; ``source`` kept for error messages)."""
    return json.dumps({"source": config.source,
                       "data": config.model_dump(mode="json", exclude={"source"})})


def worker_config() -> GatewayConfig:
    """The config the parent handed over (:func:`serialize`)."""
    raw = os.environ.get(CONFIG_ENV)
    if raw is None:
        raise ConfigError(f"{CONFIG_ENV} is not set: workers are started by kvgate serve")
    doc = json.loads(raw)
    return parse_config(doc["data"], doc["source"])


#: Plugin params naming a directory that one process locks: made per worker (module docstring).
PER_PROCESS_PARAMS = ("spool",)


def claim_slot(workers: int, directory: Path) -> int:
    """The first free worker slot: an exclusive ``flock`` on a descriptor left open until the
    process exits (the kernel then frees the slot)."""
    directory.mkdir(parents=True, exist_ok=True)
    for slot in range(workers):
        fd = os.open(directory / f"worker-{slot}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return slot
    raise ConfigError(f"all {workers} worker slots in {directory} are taken")


def per_worker(config: GatewayConfig, slot: int, registry: Registry) -> GatewayConfig:
    """``config`` with every per-process param (:data:`PER_PROCESS_PARAMS`) suffixed by the
    slot (slot 0: unchanged)."""
    if slot == 0:
        return config
    data = config.model_dump(exclude={"source"})
    state_dir = data["server"]["routing_state_dir"]
    if state_dir is not None:
        data["server"]["routing_state_dir"] = f"{state_dir}/worker-{slot}"
    for plugin in data["plugins"]:
        cls = registry.plugin_class(plugin["type"])
        fields = cls.Params.model_fields if cls is not None else {}
        for name in PER_PROCESS_PARAMS:
            if name in fields:
                base = plugin["params"].get(name, fields[name].default)
                if isinstance(base, str):
                    plugin["params"][name] = f"{base}.worker-{slot}"
    return parse_config(data, config.source)


def worker_app() -> object:
    """uvicorn factory of one worker: the gateway app of the handed-over config."""
    from kvgate.middleware.app import create_app

    config = worker_config()
    configure_logging(config.server.log_level, config.server.access_log)
    workers = int(os.environ.get(WORKERS_ENV, "1"))
    registry = Registry.from_entry_points()
    slot = claim_slot(workers, Path(".kvgate"))
    log.info("worker slot %d of %d (pid %d)", slot, workers, os.getpid())
    app = create_app(per_worker(config, slot, registry), registry)
    tune_gc()
    return app
