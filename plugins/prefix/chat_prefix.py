"""Incremental chat tokenization for the ``tokenizer`` plugin: a session's next turn encodes only
what it appended.

An agent's turn N+1 resends turn N's conversation plus a reply and a new message, so its
rendered chat text starts, byte for byte, with turn N's text up to turn N's last message. This
module keeps, per tokenizer, the token ids of recently rendered texts (up to a **cut**: the end
of the last *boundary token* before the generation prompt) and serves a new text from the
longest cached text that is its prefix, encoding only the rest.

Why cut after a boundary token: boundary tokens are special added tokens the tokenizer matches
literally (``special``, not ``normalized``, no ``lstrip``/``rstrip``/``single_word``: Llama 3's
``<|eot_id|>``, ``<|start_header_id|>``); ``tokenizers`` splits text at them before any
pre-tokenization or BPE merge, so no merge crosses one, and the ids of ``text[:cut]`` followed
by those of ``text[cut:]`` equal the ids of ``text``. A tokenizer for which that fails on probe
conversations (a Metaspace pre-tokenizer that prefixes each piece) gets no cache
(:meth:`ChatTokenizer.self_check`, at start).

Finding the prefix without hashing the whole conversation: every cached text is reachable by
**marks**, one per cut it contains: ``(cut position, hash of the 64 characters before it)`` ->
(entry, tokens before the cut). A new text's boundary-token ends are probed from its end
backwards (a regex over growing windows: a few short probes for an agent's turn, whose previous
cut lies a couple of messages back), and a mark found is verified by comparing the cached text
with the new text's prefix (``memcmp``), so an edited history, a template that rewrites earlier
turns or a hash collision only falls back to an earlier mark or a full encode, never to wrong ids.
When the new entry extends the one it was served from, it **supersedes** it: the old entry is
dropped and its marks point at the new one, so one session holds one entry (its latest turn)
reachable at every earlier turn's cut (a sub-agent or a regenerated answer forking there is
served too).

Bounded: at most ``max_bytes`` per tokenizer, counting each entry's text (``sys.getsizeof``),
ids (4 bytes each, ``array('I')``) and marks (:data:`MARK_BYTES` each); least recently used out
(``evictions``); an entry over a quarter of the bound is not kept. Thread-safe (tokenization
runs on the plugin's pool). docs/plugins/tokenization.md.
"""

from __future__ import annotations

import re
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvgate.plugins.prefix.tokenizer_backends import Messages, TokenizerBackend, generation_suffix

#: Characters before a cut hashed into its mark's key (tells sessions apart that have a cut at
#: the same position; the text comparison decides).
TAIL_CHARS = 64
#: Bytes a mark costs (a dict item: tuple key of two ints, tuple value, and the entry's list slot).
MARK_BYTES = 240
#: Default bound per tokenizer: ~170 agent sessions at 100k tokens (~0.77 MiB each: 370 KB of
#: text, 400 KB of ids).
DEFAULT_MAX_BYTES = 128 * 1024 * 1024
_PROBES: tuple[tuple[str, ...], ...] = (
    ("You are terse.", "Hello there, how are you?", " Fine, thanks!", "Tell me 3 jokes."),
    ("Sys", "a", "b c", "12345 six"),
)


@dataclass(slots=True)
class ChatCacheStats:
    """Counters (monotonic) and sizes of the chat-prefix caches of one plugin (all tokenizers)."""

    hits: int = 0
    misses: int = 0
    #: Token ids served from the cache, and encoded (new suffixes and misses).
    reused_tokens: int = 0
    encoded_tokens: int = 0
    #: Entries dropped by the bound, and replaced by the next turn of their session.
    evictions: int = 0
    superseded: int = 0
    #: Current entries, marks and bytes held.
    entries: int = 0
    marks: int = 0
    bytes: int = 0


@dataclass(slots=True)
class _Entry:
    text: str
    ids: array[int]
    marks: list[tuple[int, int]] = field(default_factory=list)

    @property
    def size(self) -> int:
        return sys.getsizeof(self.text) + 4 * len(self.ids) + MARK_BYTES * len(self.marks)


@dataclass(frozen=True, slots=True)
class Hit:
    """A cached prefix of a text: ``ids`` are the tokens of ``text[:end]``."""

    end: int
    ids: array[int]
    entry: int
    supersedes: bool


@dataclass(frozen=True, slots=True)
class Plan:
    """A rendered chat and its cached prefix: ``text[:start]`` is ``hit``'s; the cut after
    which nothing is kept is ``split``; ``cached``: False when the cache is off."""

    text: str
    hit: Hit | None
    start: int
    split: int
    cached: bool

    @property
    def new_chars(self) -> int:
        """Characters left to encode."""
        return len(self.text) - self.start


def mark_key(text: str, end: int) -> tuple[int, int]:
    return (end, hash(text[max(0, end - TAIL_CHARS):end]))


class ChatPrefixCache:
    """Token ids of rendered chat prefixes, found by marks (see the module docstring)."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES,
                 stats: ChatCacheStats | None = None) -> None:
        self.max_bytes = max_bytes
        self.stats = stats if stats is not None else ChatCacheStats()
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._marks: dict[tuple[int, int], tuple[int, int]] = {}
        self._bytes = 0
        self._next = 0
        self._lock = threading.Lock()
        #: Sizes last added to the (shared) stats: they take deltas.
        self._published = (0, 0, 0)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._bytes

    @property
    def hits(self) -> int:
        return self.stats.hits

    @property
    def misses(self) -> int:
        return self.stats.misses

    def lookup(self, text: str, ends: Iterator[int]) -> Hit | None:
        """The longest cached prefix of ``text`` ending at one of ``ends`` (descending)."""
        with self._lock:
            for end in ends:
                mark = self._marks.get(mark_key(text, end))
                entry = None if mark is None else self._entries.get(mark[0])
                if mark is None or entry is None:
                    continue
                whole = end == len(entry.text)
                if text.startswith(entry.text) if whole else entry.text[:end] == text[:end]:
                    self._entries.move_to_end(mark[0])
                    self.stats.hits += 1
                    self.stats.reused_tokens += mark[1]
                    ids = entry.ids if mark[1] == len(entry.ids) else entry.ids[:mark[1]]
                    return Hit(end, ids, mark[0], whole)
            self.stats.misses += 1
            return None

    def store(self, text: str, ids: array[int], hit: Hit | None) -> None:
        """Keep ``ids`` as the tokens of ``text`` (a cut), reachable at its end and, when it
        extends ``hit``'s entry, at that entry's marks (the entry is superseded)."""
        if hit is not None and hit.end == len(text):
            return  # nothing new: the entry served is this very prefix
        entry = _Entry(text, ids)
        if entry.size > self.max_bytes // 4:
            return
        with self._lock:
            key = self._next
            self._next += 1
            old = self._entries.get(hit.entry) if hit is not None and hit.supersedes else None
            if old is not None and hit is not None:
                self._drop(hit.entry, old, keep_marks=True)
                for mark in old.marks:
                    self._marks[mark] = (key, self._marks[mark][1])
                entry.marks = old.marks
                self.stats.superseded += 1
            mark = mark_key(text, len(text))
            previous = self._marks.get(mark)
            if previous is not None and previous[0] != key:
                self._unmark(previous[0], mark)
            self._marks[mark] = (key, len(ids))
            entry.marks.append(mark)
            self._entries[key] = entry
            self._bytes += entry.size
            self._enforce()
            self._publish()

    def _unmark(self, key: int, mark: tuple[int, int]) -> None:
        """``mark`` now names another entry: off ``key``'s list (its size shrinks)."""
        entry = self._entries.get(key)
        if entry is not None and mark in entry.marks:
            self._bytes -= entry.size
            entry.marks.remove(mark)
            self._bytes += entry.size

    def _drop(self, key: int, entry: _Entry, keep_marks: bool = False) -> None:
        del self._entries[key]
        self._bytes -= entry.size
        if not keep_marks:
            for mark in entry.marks:
                if self._marks.get(mark, (None,))[0] == key:
                    del self._marks[mark]

    def _enforce(self) -> None:
        while self._bytes > self.max_bytes and self._entries:
            key, entry = next(iter(self._entries.items()))
            self._drop(key, entry)
            self.stats.evictions += 1

    def _publish(self) -> None:
        """Sizes into the stats, as deltas (a plugin's tokenizers share one stats object)."""
        now = (len(self._entries), len(self._marks), self._bytes)
        entries, marks, size = (a - b for a, b in zip(now, self._published, strict=True))
        self.stats.entries += entries
        self.stats.marks += marks
        self.stats.bytes += size
        self._published = now


def boundary_ends(text: str, pattern: re.Pattern[str], end: int, start: int = 0,
                  longest: int = 64) -> Iterator[int]:
    """Ends of the boundary-token occurrences within ``text[start:end]``, last first: a regex
    over windows growing 8x backwards from ``end`` (a few hundred characters for the usual hit).
    ``longest``: the longest boundary token's length (a window is scanned that far past its
    left edge so an occurrence straddling it is found, once)."""
    edge, window = end, 512  # occurrences starting at or after ``edge`` were yielded
    while edge > start:
        lo = max(start, edge - window)
        hi = min(end, edge + longest - 1)
        found = [m.end() for m in pattern.finditer(text, lo, hi) if m.start() < edge]
        yield from reversed(found)
        edge, window = lo, window * 8


def last_boundary_end(text: str, pattern: re.Pattern[str] | None, start: int,
                      end: int | None = None) -> int:
    """End of the last boundary-token occurrence in ``text[start:end]`` (``start`` if none)."""
    if pattern is None:
        return start
    end = len(text) if end is None else end
    return next(boundary_ends(text, pattern, end, start, len(pattern.pattern)), start)


@dataclass
class ChatTokenizer:
    """Chat tokenization with the prefix cache for one backend (see the module docstring)."""

    backend: TokenizerBackend
    cache: ChatPrefixCache | None

    def __post_init__(self) -> None:
        marks = sorted(set(self.backend.boundaries), key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, marks))) if marks else None
        self._longest = max(map(len, marks), default=1)
        self._gen_suffix = generation_suffix(self.backend) if self.cache is not None else ""
        #: Whether large prompts go to the thread pool (the backend does not say it is cheaper
        #: inline), and why its ids are not the engine's (None: they are): read per request.
        self.offloads = getattr(self.backend, "offload", True) is not False
        inexact = getattr(self.backend, "inexact", None)
        self.inexact: str | None = str(inexact) if inexact else None

    def tokenize(self, messages: Messages, gen: bool, extra: Mapping[str, Any]) -> Sequence[int]:
        """The chat's ids (an ``array('I')`` when the cache is on)."""
        return self.finish(self.plan(messages, gen, extra))

    def plan(self, messages: Messages, gen: bool, extra: Mapping[str, Any]) -> Plan:
        """Render the chat and find its cached prefix (cheap: run on the event loop); what is
        left to encode is :meth:`finish`'s (``Plan.new_chars`` sizes it)."""
        text = self.backend.render_chat(messages, gen, extra)
        if self.cache is None or self._pattern is None:
            return Plan(text, None, 0, 0, cached=False)
        # Cut before the generation prompt: the next turn has the assistant's reply there.
        end = len(text)
        if gen and self._gen_suffix and text.endswith(self._gen_suffix):
            end -= len(self._gen_suffix)
        hit = self.cache.lookup(text, boundary_ends(text, self._pattern, end, 0, self._longest))
        start = 0 if hit is None else hit.end
        split = next(boundary_ends(text, self._pattern, end, start, self._longest), start)
        return Plan(text, hit, start, split, cached=True)

    def finish(self, plan: Plan) -> Sequence[int]:
        """Encode what :meth:`plan` left (the text after the cached prefix), keep the new cut."""
        text, hit, start, split = plan.text, plan.hit, plan.start, plan.split
        if self.cache is None or not plan.cached:
            return self.backend.encode(text, False)
        head = array("I") if hit is None else array("I", hit.ids)
        if split > start:
            head.extend(self.backend.encode(text[start:split], False))
            self.cache.store(text[:split], head, hit)
        tail = self.backend.encode(text[split:], False)
        self.cache.stats.encoded_tokens += len(head) - (0 if hit is None else len(hit.ids))
        self.cache.stats.encoded_tokens += len(tail)
        out = array("I", head)
        out.extend(tail)
        return out

    def self_check(self) -> bool:
        """Whether split tokenization equals whole tokenization on probe conversations."""
        if self.cache is None:
            return True
        for contents in _PROBES:
            roles = ["system"] + ["user", "assistant"] * len(contents)
            msgs = [{"role": r, "content": c} for r, c in zip(roles, contents, strict=False)]
            for n in range(1, len(msgs) + 1):
                whole = self.backend.encode(self.backend.render_chat(msgs[:n], True, {}), False)
                if list(self.tokenize(msgs[:n], True, {})) != list(whole):
                    return False
        return True
