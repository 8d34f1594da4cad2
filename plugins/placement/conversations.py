"""Conversations recognised without session headers (for plugins/placement/scorer.py).

An agent's next turn is its previous prompt, the reply, and a new message: the previous prompt is
an exact prefix of the new one. The prefix-cache producer hashes every prompt into a chain of
full-block hashes (``PROMPT_CHAIN``); a prompt of ``L`` tokens is remembered under the hash of
its last full block ``L // B`` together with ``L`` and a hash of its last ``L mod B`` tokens.
A later prompt whose chain holds that hash at the same position and whose tokens there end the
same way continues that conversation. The last ``slack`` = 8 tokens of a prompt are left out of
what is remembered: they hold the chat template's generation prompt, whose last token the next
turn's tokenization merges with the reply (Llama 3's ``<|end_header_id|>\n\n``: the ``\n\n``
becomes two tokens before the reply's text), so a full prompt is never a token prefix of its
next turn. Two sessions sharing a system prompt (or a first
message's first blocks) are told apart by the partial tail: a different message after the
common blocks hashes differently, and a remembered prompt is continued once (it is forgotten when
its next turn is remembered): two sessions that both extend it are never both taken for its
conversation. A first message shorter than the template's few tokens after it (~3 tokens with
Llama 3's template) leaves nothing of its own in what is remembered; such a session is told
apart only by that rule.

What the placement does with it is what it does with a session header: the conversation's own
recent insertions are left out of its engine's pressure (its growth evicts nothing it wants
back) and its last engine gets the pin's edge. Without it, a session without headers on an
engine of its own saw its own previous turns as that engine's turnover and moved to an idle
engine: a full recompute each time (bench.steady_sim, docs/routing.md "Steady state").

Bounded: ``max_entries`` prompts (least recently used first out, ~120 bytes each). A lookup
walks back over at most ``max_lookback`` = 2,048 full blocks past the earlier prompt's last one
(~0.1 ms of dict lookups; 32k tokens of 16-token GPU blocks, 128k of 64-token record blocks): a
turn that added more is placed as a new conversation, and a new session walks its whole chain
up to that bound.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvgate.middleware.framework.types import EndpointId


@dataclass(frozen=True, slots=True)
class Turn:
    """A remembered prompt: where it went, its own decayed insertions there [tokens] with the
    fleet counter they were read at, its length [tokens] and the hash of its partial tail."""

    engine: EndpointId
    inserted: float
    total: float
    length: int
    tail: int
    key: int  # the hash it is remembered under
    #: The whole prompt's length [tokens] and the hash of its last ``slack`` tokens: a prompt
    #: not longer by ``slack`` is a later turn only if it is this one again (a retry).
    full: int = 0
    full_tail: int = 0


def tail_hash(tokens: Sequence[int], start: int, end: int) -> int:
    return hash(tuple(tokens[start:end]))


class Conversations:
    """Recent prompts by the hash of their last full block (see the module docstring)."""

    def __init__(self, max_entries: int, max_lookback: int = 2048, slack: int = 8) -> None:
        self.max_entries = max_entries
        self.max_lookback = max_lookback
        self.slack = slack
        self._turns: OrderedDict[int, Turn] = OrderedDict()
        self.found = 0  # prompts recognised as a later turn
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._turns)

    def previous(self, tokens: Sequence[int], block: int, chain: Sequence[int]) -> Turn | None:
        """The latest remembered prompt that ``tokens`` (chain ``chain`` of ``block``-token
        blocks) extends, or None."""
        turns = self._turns
        stop = max(-1, len(chain) - 2 - self.max_lookback)
        for i in range(len(chain) - 1, stop, -1):
            turn = turns.get(chain[i])
            if turn is None:
                continue
            full = (i + 1) * block
            if (turn.length // block == i + 1 and turn.length <= len(tokens)
                    and tail_hash(tokens, full, turn.length) == turn.tail
                    and self._grown_or_same(tokens, turn)):
                turns.move_to_end(chain[i])
                self.found += 1
                return turn
        return None

    def _grown_or_same(self, tokens: Sequence[int], turn: Turn) -> bool:
        """A next turn adds a reply and a message (more than ``slack`` tokens past the whole
        earlier prompt); anything shorter is that prompt again or another session's prompt that
        differs only in what ``slack`` leaves out (a burst of short questions after one system
        prompt): only the former continues it."""
        if len(tokens) >= turn.full + self.slack:
            return True
        return len(tokens) == turn.full and tail_hash(tokens, turn.length, turn.full) == \
            turn.full_tail

    def add(self, tokens: Sequence[int], block: int, chain: Sequence[int], engine: EndpointId,
            inserted: float, total: float, half_life: float, previous: Turn | None
            ) -> Turn | None:
        """Remember ``tokens`` sent to ``engine``, inserting ``inserted`` tokens there (fleet
        counter ``total`` after them), and return what was remembered (None: too short to be
        told apart; see :meth:`put` for the ``previous`` turn)."""
        length = len(tokens) - self.slack
        n = length // block
        if n <= 0 or n > len(chain):
            return None
        return self.put(Turn(engine, inserted, total, length,
                             tail_hash(tokens, n * block, length), chain[n - 1], len(tokens),
                             tail_hash(tokens, length, len(tokens))), half_life, previous)

    def put(self, turn: Turn, half_life: float, previous: Turn | None) -> Turn:
        """Remember ``turn`` (``inserted``: this turn's own insertions, at ``total``; another
        replica's turn, told by plugins/placement/shared.py, comes in here too). Its
        ``previous`` turn's insertions carry over when it went to the same engine (a
        conversation that moved starts afresh), and the previous turn is forgotten: a
        remembered prompt is continued once, so two sessions that share what it holds are never
        both taken for its conversation."""
        value = turn.inserted
        if previous is not None:
            if self._turns.get(previous.key) is previous:
                del self._turns[previous.key]
            if previous.engine == turn.engine:
                value += previous.inserted * math.exp2(-(turn.total - previous.total) / half_life)
        if value != turn.inserted:
            turn = replace(turn, inserted=value)
        self._turns[turn.key] = turn
        self._turns.move_to_end(turn.key)
        while len(self._turns) > self.max_entries:
            self._turns.popitem(last=False)
            self.evicted += 1
        return turn

    def get(self, key: int) -> Turn | None:
        """The turn remembered under ``key`` (no recency change), or None."""
        return self._turns.get(key)

    def own_pressure(self, turn: Turn, total: float, half_life: float, capacity: int) -> float:
        """``turn``'s conversation's decayed insertions into its engine (of ``capacity``
        tokens) per token of capacity, at the fleet counter ``total``."""
        return turn.inserted * math.exp2(-(total - turn.total) / half_life) / capacity

    def forget_engine(self, engine: EndpointId) -> None:
        for key in [k for k, t in self._turns.items() if t.engine == engine]:
            del self._turns[key]


__all__ = ["Conversations", "Turn", "tail_hash"]
