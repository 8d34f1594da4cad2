"""Cache-aware order of queued work (pure, no I/O).

:func:`prefix_key` is computed once, at submit: a hash of what makes two requests share a KV
prefix on an engine -- the model, the path, and the start of the prompt (the system prompt or
first message for chat and Messages, ``instructions`` plus the first input item for Responses,
the prompt's first 4096 characters for completions). llm-d's batch gateway sorts by the
system-prompt hash the same way. Requests with equal keys start with the same tokens, so
running them back to back makes each after the first a prefix-cache hit on the engine the
cache-aware router sends them to, instead of evicting the prefix between them.

:func:`order_window` orders one claimed window (the runner claims ``window`` jobs at a time):
groups of equal keys, best group first (highest priority, then earliest deadline, then the
earliest position the store gave: its priority/tenant-round-robin/age order); within a group,
priority then position. Jobs without a key keep their own place.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from kvgate.asyncq.api import Job

#: Characters of a text prompt that form its key: 4096 characters (~1k tokens) is past any
#: shared system prompt's distinguishing start yet cheap to hash.
TEXT_PREFIX_CHARS = 4096


def _first(items: Any) -> Any:
    return items[0] if isinstance(items, list) and items else items


def _prefix_parts(path: str, body: Mapping[str, Any]) -> list[Any]:
    if "messages" in body:  # chat completions, Anthropic Messages
        messages = body.get("messages")
        return [body.get("system"), _first(messages)]
    if "input" in body or "instructions" in body:  # Responses, embeddings
        return [body.get("instructions"), _first(body.get("input"))]
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt[:TEXT_PREFIX_CHARS]]
    return [_first(prompt)]


def prefix_key(path: str, body: Mapping[str, Any]) -> str:
    """16 hex digits of SHA-256 over the model, path and prompt start ("" for a body without a
    model: nothing to share)."""
    model = body.get("model")
    if not isinstance(model, str):
        return ""
    parts = [model, path, *_prefix_parts(path, body)]
    raw = orjson.dumps(parts, option=orjson.OPT_SORT_KEYS, default=str)
    return hashlib.sha256(raw).hexdigest()[:16]


def order_window(jobs: Sequence[Job]) -> list[Job]:
    """Jobs with equal ``prefix_key`` back to back (see the module docstring)."""
    groups: dict[str, list[tuple[int, Job]]] = {}
    for pos, job in enumerate(jobs):
        key = job.spec.prefix_key or f"\x00{pos}"
        groups.setdefault(key, []).append((pos, job))

    def group_rank(members: list[tuple[int, Job]]) -> tuple[int, float, int]:
        deadlines = [j.spec.deadline for _, j in members if j.spec.deadline is not None]
        return (-max(j.spec.priority for _, j in members),
                min(deadlines) if deadlines else float("inf"), members[0][0])

    out: list[Job] = []
    for members in sorted(groups.values(), key=group_rank):
        out += [j for _, j in sorted(members, key=lambda m: (-m[1].spec.priority, m[0]))]
    return out


__all__ = ["order_window", "prefix_key"]
