"""Mooncake-format traces for the replay benchmark: parsing, token blocks, sessions, bodies.

A trace line is ``{"timestamp": ms, "input_length": tokens, "output_length": tokens,
"hash_ids": [...]}``; hash id *k* at position *i* names the content of the prompt's *i*-th block of
:data:`TRACE_BLOCK` (512) tokens, and equal ids mean equal content *and* equal prefix up to it.
:func:`block_tokens` turns an id into a fixed block of token ids (seeded by the id), so equal ids
give equal tokens and different ids give different ones; :func:`prompt_tokens` concatenates a
request's blocks and cuts the last one to ``input_length``.

Everything here is pure and deterministic (no I/O but :func:`load_trace`).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvgate.engines.sim.core.tokenizer import piece_id

#: Tokens per trace block (the Mooncake release hashes 512-token blocks).
TRACE_BLOCK = 512
#: Each block is :data:`TRACE_BLOCK` pseudo-words of 2..6 lowercase letters with a leading space:
#: the simulated engine's tokenizer (``engines.sim.tokenizer``) makes each word exactly one token,
#: so the text prompt and the token-id prompt of a request are the same token sequence.
WORD_LETTERS = (2, 6)
#: Shortest earlier prompt (in blocks) that a later request may extend to join its session: a
#: one-block prompt is usually just the shared system prompt, which every conversation extends.
MIN_SESSION_BLOCKS = 2


class TraceError(ValueError):
    """A trace line that does not follow the Mooncake format."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One trace line; ``index`` is its position in the file (0-based)."""

    index: int
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def parse_line(line: str, index: int) -> TraceRequest:
    """One JSON line; raises :class:`TraceError` when a field is missing or inconsistent."""
    try:
        raw = json.loads(line)
        req = TraceRequest(
            index=index, timestamp_ms=int(raw["timestamp"]),
            input_length=int(raw["input_length"]), output_length=int(raw["output_length"]),
            hash_ids=tuple(int(h) for h in raw["hash_ids"]),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise TraceError(f"line {index + 1}: {exc}") from exc
    blocks = -(-req.input_length // TRACE_BLOCK)
    if req.input_length < 1 or len(req.hash_ids) != blocks:
        raise TraceError(
            f"line {index + 1}: {len(req.hash_ids)} hash ids for {req.input_length} tokens"
        )
    return req


def parse_trace(lines: Iterable[str], limit: int | None = None) -> list[TraceRequest]:
    """The first ``limit`` requests (all when None) of the non-blank ``lines``."""
    out: list[TraceRequest] = []
    for line in lines:
        if limit is not None and len(out) >= limit:
            break
        if line.strip():
            out.append(parse_line(line, len(out)))
    return out


def load_trace(path: Path, limit: int | None = None) -> list[TraceRequest]:
    """:func:`parse_trace` of a file."""
    with path.open() as fh:
        return parse_trace(fh, limit)


def block_words(hash_id: int, salt: int = 0) -> list[str]:
    """The :data:`TRACE_BLOCK` words (one token each) of block ``hash_id``, seeded by
    (salt, id): equal ids give equal words."""
    rng = np.random.default_rng([salt, hash_id])
    lengths = rng.integers(WORD_LETTERS[0], WORD_LETTERS[1] + 1, TRACE_BLOCK)
    ends = np.cumsum(lengths).tolist()
    letters = rng.integers(ord("a"), ord("z") + 1, ends[-1], dtype=np.uint8).tobytes().decode()
    return [" " + letters[end - n:end] for n, end in zip(lengths.tolist(), ends, strict=True)]


def block_tokens(hash_id: int, salt: int = 0) -> list[int]:
    """The token ids of :func:`block_words` (what the simulated engine's tokenizer gives)."""
    return [piece_id(w) for w in block_words(hash_id, salt)]


class BlockCache:
    """Bounded memo of each block's words and token ids.

    Holds at most ``max_blocks`` blocks (~8 KB each) and evicts the least recently used.
    """

    def __init__(self, salt: int = 0, max_blocks: int = 20_000) -> None:
        self.salt = salt
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[int, tuple[list[str], list[str]]] = OrderedDict()

    def block(self, hash_id: int) -> tuple[list[str], list[str]]:
        """(words, token ids as decimal strings) of block ``hash_id``."""
        entry = self._blocks.get(hash_id)
        if entry is None:
            words = block_words(hash_id, self.salt)
            entry = (words, [str(piece_id(w)) for w in words])
            self._blocks[hash_id] = entry
            if len(self._blocks) > self.max_blocks:
                self._blocks.popitem(last=False)
        else:
            self._blocks.move_to_end(hash_id)
        return entry


def prompt_tokens(req: TraceRequest, salt: int = 0) -> list[int]:
    """The request's prompt: its blocks' tokens, the last block cut to ``input_length``."""
    tokens: list[int] = []
    for hash_id in req.hash_ids:
        tokens.extend(block_tokens(hash_id, salt))
    return tokens[: req.input_length]


def prompt_json(req: TraceRequest, cache: BlockCache, text: bool = False) -> str:
    """The prompt as JSON: ``prompt_tokens(req)`` as an array of ids, or (``text``) the words
    as one string, which the simulated engine tokenizes to the same ids."""
    part = 1 if not text else 0
    pieces: list[str] = []
    for hash_id in req.hash_ids:
        pieces.extend(cache.block(hash_id)[part])
    del pieces[req.input_length:]
    if text:
        return json.dumps("".join(pieces))
    return "[" + ",".join(pieces) + "]"


def infer_sessions(
    reqs: Sequence[TraceRequest], min_blocks: int = MIN_SESSION_BLOCKS
) -> list[int]:
    """Session number per request, in order: a request whose hash ids extend (or repeat) an
    earlier request's *full* blocks (at least ``min_blocks`` of them) continues that request's
    session (the longest such earlier prompt wins); otherwise it starts a new one. Only full
    blocks count because a conversation's next turn appends the answer and a new message to the
    prompt, which changes the content (and so the hash id) of its last, partial block. Sessions
    are numbered from 0 in order of first appearance."""
    seen: dict[tuple[int, ...], int] = {}
    sessions: list[int] = []
    next_id = 0
    for req in reqs:
        ids = req.hash_ids
        session = None
        for length in range(len(ids), min_blocks - 1, -1):
            session = seen.get(ids[:length])
            if session is not None:
                break
        if session is None:
            session, next_id = next_id, next_id + 1
        sessions.append(session)
        full = ids[: req.input_length // TRACE_BLOCK]
        if len(full) >= min_blocks:
            seen.setdefault(full, session)
    return sessions


def completion_body(
    req: TraceRequest, model: str, max_output: int, cache: BlockCache, text: bool = False
) -> bytes:
    """The streaming ``/v1/completions`` body of ``req`` (token-id or ``text`` prompt, usage
    requested, exactly ``min(output_length, max_output)`` tokens, at least 1)."""
    out = max(1, min(req.output_length, max_output))
    head = json.dumps({"model": model, "max_tokens": out, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}, "temperature": 0})
    return (head[:-1] + ', "prompt": ' + prompt_json(req, cache, text) + "}").encode()


def send_offsets(reqs: Sequence[TraceRequest], speedup: float) -> list[float]:
    """Seconds after the start at which each request is sent: trace time compressed
    ``speedup`` times, measured from the first request's timestamp."""
    if not reqs:
        return []
    t0 = reqs[0].timestamp_ms
    return [(r.timestamp_ms - t0) / 1000.0 / speedup for r in reqs]
