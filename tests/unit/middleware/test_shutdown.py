"""Shutdown steps are bounded: a stuck plugin stop is cancelled, named, and left behind."""

from __future__ import annotations

import asyncio
import logging

import pytest

from kvgate.middleware import app as app_module


async def _stuck() -> None:
    """A stop that ignores its first cancellation and would wait forever."""
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        await asyncio.Event().wait()


async def test_a_stuck_step_is_left_behind_with_a_warning(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(app_module, "STOP_TIMEOUT_S", 0.05)
    with caplog.at_level(logging.WARNING, logger="kvgate.app"):
        await app_module._bounded(_stuck(), "plugin 'stuck'")
    assert "plugin 'stuck' did not stop within" in caplog.text


async def test_a_normal_step_completes_and_a_failing_one_raises(
        monkeypatch: pytest.MonkeyPatch) -> None:
    done: list[str] = []

    async def ok() -> None:
        await asyncio.sleep(0)
        done.append("ok")

    async def broken() -> None:
        raise RuntimeError("stop failed")

    await app_module._bounded(ok(), "ok")
    assert done == ["ok"]
    with pytest.raises(RuntimeError, match="stop failed"):
        await app_module._bounded(broken(), "broken")
