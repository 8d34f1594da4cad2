"""``kvgate serve --workers N`` building blocks: worker slots, per-worker params, refusals."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvgate.middleware.framework.composition.config import parse_config
from kvgate.middleware.framework.composition.registry import Registry
from kvgate.middleware.framework.errors import ConfigError
from kvgate.middleware.process import CONFIG_ENV
from kvgate.middleware.workers import (
    check_workers,
    claim_slot,
    per_worker,
    serialize,
    worker_config,
)

ENGINES = [{"name": "e0", "url": "http://127.0.0.1:9"}]
PROFILE = [{"name": "default", "plugins": [{"ref": "max-score-picker"}]}]


def config(*plugins: dict[str, Any], shared: bool = False) -> Any:
    data: dict[str, Any] = {"engines": ENGINES, "plugins": [*plugins, {"type": "max-score-picker"}],
                            "profiles": PROFILE}
    if shared:
        data["shared_state"] = {"redis_url": "redis://127.0.0.1:6379/0"}
    return parse_config(data, "test")


@pytest.mark.parametrize(("slot", "given", "expected"), [
    (0, None, ".kvgate/ledger.spool"),
    (1, None, ".kvgate/ledger.spool.worker-1"),
    (3, "/var/spool/kv", "/var/spool/kv.worker-3"),
])
def test_per_worker_spool(slot: int, given: str | None, expected: str) -> None:
    params = {"prices": "docs/examples/prices.yaml", **({"spool": given} if given else {})}
    out = per_worker(config({"type": "billing", "params": params}), slot,
                     Registry.from_entry_points())
    spool = out.plugins[0].params.get("spool", ".kvgate/ledger.spool")
    assert spool == expected
    assert out.plugins[1] == config().plugins[0]  # plugins without a spool: unchanged


def test_slots_are_exclusive_between_processes(tmp_path: Path) -> None:
    """Each process gets the first free slot; a slot is freed when its holder exits."""
    code = ("import sys, time; from pathlib import Path; from kvgate.middleware.workers import "
            "claim_slot; print(claim_slot(3, Path(sys.argv[1])), flush=True); time.sleep(30)")
    holders = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)],
                                stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        got = sorted(int(h.stdout.readline()) for h in holders if h.stdout is not None)
        assert got == [0, 1]
        assert claim_slot(3, tmp_path) == 2
        with pytest.raises(ConfigError, match="worker slots"):
            claim_slot(3, tmp_path)
    finally:
        for h in holders:
            h.kill()
            h.wait()


def test_bound_kv_events_refused_with_workers() -> None:
    cfg = config({"type": "kv-events", "params": {"bind": "tcp://127.0.0.1:5557"}})
    check_workers(cfg, 1)  # one process may bind
    with pytest.raises(ConfigError, match="binds"):
        check_workers(cfg, 2)


def test_workers_without_shared_state_warn(caplog: pytest.LogCaptureFixture) -> None:
    check_workers(config(), 2)
    assert "route" in caplog.text and "--redis" in caplog.text
    caplog.clear()
    check_workers(config(shared=True), 2)
    assert caplog.text == ""


def test_config_handed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = config(shared=True)
    monkeypatch.setitem(os.environ, CONFIG_ENV, serialize(cfg))
    assert worker_config() == cfg
