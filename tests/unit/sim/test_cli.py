"""Command line: flags to config, --count child command lines, kvgate registration."""

from __future__ import annotations

import argparse
import sys

import pytest

from kvgate.engines.sim.cli import add_sim_arguments, child_argv, config_from_args, register


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    return parser.parse_args(["sim", *argv])


def test_flags_to_config() -> None:
    args = _parse("--port", "9001", "--model", "a", "--model", "b", "--block-size", "32",
                  "--capacity-blocks", "128", "--time-scale", "0", "--kv-events",
                  "tcp://127.0.0.1:5557", "--kv-events-encoding", "positional",
                  "--no-prompt-tokens-details")
    cfg = config_from_args(args)
    assert cfg.engine_id == "sim-9001" and cfg.served_model_names == ["a", "b"]
    assert (cfg.block_size, cfg.capacity_blocks, cfg.time_scale) == (32, 128, 0.0)
    assert cfg.kv_events is not None and cfg.kv_events.encoding == "positional"
    assert cfg.enable_prompt_tokens_details is False
    assert args.count == 1 and callable(args.func)


@pytest.mark.parametrize(("kv", "index", "expected"), [
    ("tcp://*:5557", 2, "tcp://*:5559"),
    ("tcp://127.0.0.1:5557", 2, "tcp://127.0.0.1:5557"),
    ("tcp://*:5557", 0, "tcp://*:5557"),
])
def test_children_get_consecutive_ports(kv: str, index: int, expected: str) -> None:
    args = _parse("--port", "8100", "--count", "3", "--kv-events", kv, "--time-scale", "0.5")
    argv = child_argv(args, index)
    assert argv[:3] == [sys.executable, "-m", "kvgate.engines.sim"]
    assert argv[argv.index("--port") + 1] == str(8100 + index)
    assert argv[argv.index("--engine-id") + 1] == f"sim-{8100 + index}"
    assert argv[argv.index("--kv-events") + 1] == expected
    assert argv[argv.index("--time-scale") + 1] == "0.5"
    # The child's own parser accepts what we give it, and builds the same config otherwise.
    child = argparse.ArgumentParser()
    add_sim_arguments(child)
    child_cfg = config_from_args(child.parse_args(argv[3:]))
    assert child_cfg.time_scale == 0.5 and child_cfg.engine_id == f"sim-{8100 + index}"


@pytest.mark.parametrize(("flags", "expected"), [
    ((), ("generate", True, True, True)),
    (("--runner", "pooling", "--no-responses-store", "--no-auto-tool-choice", "--no-scale-out"),
     ("pooling", False, False, False)),
])
def test_agent_api_flags_reach_config_and_children(flags: tuple[str, ...],
                                                   expected: tuple[str, bool, bool, bool]) -> None:
    args = _parse("--count", "2", *flags)
    child = argparse.ArgumentParser()
    add_sim_arguments(child)
    for cfg in (config_from_args(args), config_from_args(child.parse_args(child_argv(args, 1)[3:]))):
        assert (cfg.runner, cfg.responses_store, cfg.enable_auto_tool_choice,
                cfg.enable_scale_out) == expected
