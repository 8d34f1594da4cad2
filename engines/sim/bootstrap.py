"""The prefill role's Mooncake bootstrap server: what vLLM 0.32's ``MooncakeBootstrapServer``
answers, on its own port, next to the engine's API.

vLLM starts it on every ``kv_producer`` engine with MooncakeConnector, on
``VLLM_MOONCAKE_BOOTSTRAP_PORT`` (default 8998), and its workers register there.
``GET /query`` lists them per data-parallel rank::

    {"0": {"engine_id": "<engine id>", "worker_addr": {"0": {"0": "tcp://host:port"}}}}

(keys: data-parallel rank, then tensor-parallel rank, then pipeline rank, as strings). A router
learns the engine id there; a decode engine finds the worker of ``remote_engine_id`` there.

The simulator lists one worker, itself (engine id: ``SimConfig.engine_id``), whose address is
this server's: the host the caller used and this port. Its "worker" side is the long poll
``GET /sim/kv_transfer/<key>`` on the same board as the engine's API
(:func:`kvgate.engines.sim.core.pd.take_transfer`). vLLM's ``POST /register`` (its workers
registering) has no counterpart: the simulated worker is registered from the start.

It is an ``aiohttp.web`` server started inside the engine's event loop (by the app's lifespan),
so it needs no thread and no second uvicorn with its own signal handling.
"""

from __future__ import annotations

import socket

from aiohttp import web

from kvgate.engines.sim.core.pd import KvBoard, take_transfer


class BootstrapServer:
    """Serves ``/query`` and the KV long poll for one prefill engine (module docstring)."""

    def __init__(self, engine_id: str, board: KvBoard, host: str, port: int) -> None:
        self.engine_id = engine_id
        self.board = board
        self.host = host
        #: The port asked for (0: any free one); the bound port once :meth:`start` returned.
        self.port = port
        #: ``/query`` requests answered (``/sim/state``).
        self.queries = 0
        app = web.Application()
        app.router.add_get("/query", self._query)
        app.router.add_get("/sim/kv_transfer/{key}", self._kv_transfer)
        self._runner = web.AppRunner(app, access_log=None)

    async def start(self) -> None:
        """Bind and serve (raises ``OSError`` if the port is taken)."""
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
            self.port = sock.getsockname()[1]
            await self._runner.setup()
            await web.SockSite(self._runner, sock).start()
        except BaseException:
            sock.close()
            raise

    async def stop(self) -> None:
        if self._runner.server is not None:  # started
            await self._runner.cleanup()

    async def _query(self, request: web.Request) -> web.Response:
        self.queries += 1
        host = request.url.host or self.host
        worker = f"tcp://{host}:{self.port}"
        return web.json_response(
            {"0": {"engine_id": self.engine_id, "worker_addr": {"0": {"0": worker}}}})

    async def _kv_transfer(self, request: web.Request) -> web.Response:
        key = request.match_info["key"]
        transfer = await take_transfer(self.board, key, request.query.get("timeout"))
        if transfer is None:
            return web.json_response({"error": {"message": f"no finished prefill {key!r}"}},
                                     status=404)
        return web.json_response({"tokens": transfer.tokens, "prefill_hit": transfer.prefill_hit})
