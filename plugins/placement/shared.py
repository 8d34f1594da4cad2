"""The placement's memory of sessions shared between replicas (``kv-placement-scorer`` with
``redis_url``; plugins/placement/scorer.py).

Behind a round-robin balancer a replica routes one turn in N of a session. What the placement
remembers of a session (its own recent insertions with a session header,
:class:`~kvgate.plugins.placement.insertion_ledger.SessionInsertions`; the conversation its
prompt continues without one, plugins/placement/conversations.py) was each replica's own: a
replica saw the session's growth through the shared ledger as its home engine's *turnover*, the
conversation it never saw as a new session, and moved it (``bench.steady_sim --replicas 3``,
8 engines: hit ratio 0.787 / 0.913 with / without headers against 0.906 / 0.964 for one
router; docs/routing.md "Three replicas"). So every dispatch's memory is also told to the other
replicas, through a :class:`~kvgate.plugins.common.broadcast.Broadcast` on the channel
``<prefix>placement:<plugin name>`` (batched every 50 ms; a session's next turn comes seconds
later):

* ``["s", session digest, engine, tokens]``: a session (header) inserted ``tokens`` into
  ``engine``. The digest (blake2b-128 of the scoped session key, as the session table's Redis
  key) is what every replica keys its session memory by: no tenant or session id leaves the
  process in clear.
* ``["c", engine, tokens, key, length, tail, full, full_tail, previous key | null]``: a
  conversation's turn (no header), as :class:`~kvgate.plugins.placement.conversations.Turn`
  holds it (hashes of the prompt's blocks and tail, no token).

A receiver applies each as if it had dispatched it, with its own fleet counter (the ledger's
decay clock): the tokens themselves reach its ledger through the token-load scorer's counter
exchange. What arrives for an engine the receiver does not route to is skipped.
"""

from __future__ import annotations

import math
from collections.abc import Container
from dataclasses import dataclass, replace
from typing import Any

from kvgate.middleware.framework.types import EndpointId
from kvgate.plugins.common.broadcast import (
    FLUSH_S,
    MAX_PENDING,
    RETRY_S,
    TIMEOUT_S,
    Broadcast,
    Channel,
    Receive,
    connect_pair,
)
from kvgate.plugins.load.shared_load import replica_id
from kvgate.plugins.placement.conversations import Conversations, Turn
from kvgate.plugins.placement.insertion_ledger import SessionInsertions

SESSION, CONVERSATION = "s", "c"


@dataclass(frozen=True, slots=True)
class SessionTold:
    """Another replica's session insertion."""

    session: str
    engine: EndpointId
    tokens: float


@dataclass(frozen=True, slots=True)
class ConversationTold:
    """Another replica's conversation turn: ``turn.inserted`` is this turn's own insertions
    (the receiver carries over its own copy of the previous turn's), ``turn.total`` is 0 until
    the receiver stamps its own fleet counter."""

    turn: Turn
    previous: int | None


def session_item(session: str, engine: EndpointId, tokens: float) -> list[Any]:
    return [SESSION, session, engine, tokens]


def conversation_item(turn: Turn, tokens: float, previous: Turn | None) -> list[Any]:
    return [CONVERSATION, turn.engine, tokens, turn.key, turn.length, turn.tail, turn.full,
            turn.full_tail, None if previous is None else previous.key]


def _number(v: Any) -> bool:
    return type(v) in (int, float) and 0 <= v < math.inf


def parse(item: Any) -> SessionTold | ConversationTold | None:
    """One item of another replica, or None when malformed."""
    if not isinstance(item, list) or not item:
        return None
    if item[0] == SESSION and len(item) == 4:
        _, session, engine, tokens = item
        if isinstance(session, str) and isinstance(engine, str) and _number(tokens):
            return SessionTold(session, engine, float(tokens))
        return None
    if item[0] == CONVERSATION and len(item) == 9:
        _, engine, tokens, key, length, tail, full, full_tail, previous = item
        ints = (key, length, tail, full, full_tail)
        if (isinstance(engine, str) and _number(tokens) and all(type(v) is int for v in ints)
                and (previous is None or type(previous) is int)):
            return ConversationTold(
                Turn(engine, float(tokens), 0.0, length, tail, key, full, full_tail), previous)
    return None


def apply_told(told: SessionTold | ConversationTold | None, own: SessionInsertions,
               conversations: Conversations, known: Container[EndpointId], total: float,
               half_life: float) -> bool:
    """Apply another replica's item at this replica's fleet counter ``total``; False when
    malformed (None) or for an engine not in ``known``."""
    if isinstance(told, SessionTold) and told.engine in known:
        own.add(told.session, told.engine, told.tokens, total, half_life)
        return True
    if isinstance(told, ConversationTold) and told.turn.engine in known:
        previous = None if told.previous is None else conversations.get(told.previous)
        conversations.put(replace(told.turn, total=total), half_life, previous)
        return True
    return False


def start_placement_share(url: str, receive: Receive, plugin: str,
                          prefix: str = "kvgate:") -> Broadcast:
    """A started broadcast of the session memory of the placement scorer named ``plugin`` on
    ``url`` (one channel per scorer: two scorers of one config never mix their memories)."""
    pub, sub = connect_pair(url, TIMEOUT_S)
    share = Broadcast(pub, sub, receive, Channel(
        f"{prefix}placement:{plugin}", "shared_placement", "shared placement memory",
        "this replica's own session memory"), me=replica_id(), flush_s=FLUSH_S,
        timeout_s=TIMEOUT_S, retry_s=RETRY_S, max_pending=MAX_PENDING)
    share.start()
    return share


__all__ = ["ConversationTold", "SessionTold", "apply_told", "conversation_item", "parse",
           "session_item", "start_placement_share"]
