"""Recorded vLLM 0.32 answers (tests/unit/apis/data, made by record_vllm_samples.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvgate.middleware.framework.api import SseEvent

DATA = Path(__file__).parent / "data"


def raw(name: str) -> bytes:
    return (DATA / name).read_bytes()


def load_json(name: str) -> dict[str, Any]:
    value = json.loads(raw(name))
    assert isinstance(value, dict)
    return value


def parse_sse(text: bytes) -> list[SseEvent]:
    """Events of an SSE body: ``event:`` name and the ``data:`` JSON."""
    events = []
    for block in text.decode().split("\n\n"):
        name, data = None, None
        for line in block.splitlines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data = json.loads(line[5:].strip())
        if data is not None:
            events.append(SseEvent(name=name, data=data))
    return events


def load_sse(name: str) -> list[SseEvent]:
    return parse_sse(raw(name))


def golden() -> dict[str, Any]:
    return load_json("prompt_golden.json")


def cases() -> dict[str, Any]:
    return load_json("prompt_cases.json")
