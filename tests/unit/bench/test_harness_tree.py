"""bench.harness names the tree a result came from (every bench's JSON ``machine.tree``)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from bench import harness

REPO = Path(harness.__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(),
                    reason="not a git checkout")
def test_machine_info_names_the_commit() -> None:
    tree = harness.machine_info()["tree"]
    assert re.fullmatch(r"[0-9a-f]{7,40}(\+dirty)?", tree), tree
