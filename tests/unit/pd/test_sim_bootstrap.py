"""The simulator's Mooncake bootstrap server: vLLM 0.32's ``/query`` shape, and the command
line that starts it on prefill engines."""

from __future__ import annotations

import argparse

import aiohttp
import pytest

from kvgate.engines.sim.bootstrap import BootstrapServer
from kvgate.engines.sim.cli import child_argv, config_from_args, register
from kvgate.engines.sim.core.pd import KvBoard, Transfer


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["sim", *argv])


async def test_query_answers_vllm_032s_shape_and_serves_the_pull() -> None:
    """``{"<dp rank>": {"engine_id", "worker_addr": {"<tp>": {"<pp>": "tcp://host:port"}}}}``;
    the listed worker (this server) hands out finished prefills."""
    board = KvBoard(4)
    server = BootstrapServer("p-7", board, "127.0.0.1", 0)
    await server.start()
    try:
        base = f"http://127.0.0.1:{server.port}"
        async with aiohttp.ClientSession() as session:
            async with session.get(base + "/query") as resp:
                assert await resp.json() == {"0": {
                    "engine_id": "p-7",
                    "worker_addr": {"0": {"0": f"tcp://127.0.0.1:{server.port}"}}}}
            board.publish("tid-t", Transfer(96, 32))
            async with session.get(base + "/sim/kv_transfer/tid-t") as resp:
                assert await resp.json() == {"tokens": 96, "prefill_hit": 32}
            async with session.get(base + "/sim/kv_transfer/tid-gone",
                                   params={"timeout": "0"}) as resp:
                assert resp.status == 404
        assert server.queries == 1
    finally:
        await server.stop()


@pytest.mark.parametrize(("argv", "port"), [
    (("--role", "prefill"), 8998),  # vLLM's VLLM_MOONCAKE_BOOTSTRAP_PORT default
    (("--role", "prefill", "--bootstrap-port", "9100"), 9100),
    (("--role", "prefill", "--bootstrap-port", "0"), 0),
    (("--role", "decode", "--bootstrap-port", "9100"), None),  # decode engines serve none
    ((), None),
])
def test_bootstrap_port_flag(argv: tuple[str, ...], port: int | None) -> None:
    cfg = config_from_args(_parse("--host", "10.0.0.9", *argv))
    assert cfg.pd.bootstrap_port == port
    assert cfg.pd.bootstrap_host == "10.0.0.9"


@pytest.mark.parametrize(("argv", "ports"), [
    ((), ["8998", "8999", "9000"]),
    (("--bootstrap-port", "9100"), ["9100", "9101", "9102"]),
    (("--bootstrap-port", "0"), ["0", "0", "0"]),
])
def test_count_gives_each_prefill_engine_its_own_bootstrap_port(
        argv: tuple[str, ...], ports: list[str]) -> None:
    args = _parse("--role", "prefill", "--count", "3", *argv)
    got = [child_argv(args, i) for i in range(3)]
    assert [a[a.index("--bootstrap-port") + 1] for a in got] == ports
