"""The session service told between flow-control replicas (plugins/flow/shared.py): item
validation and what a receiver does with an item (pure: the broadcast's bus is its queue)."""

from __future__ import annotations

from typing import Any

import pytest

from kvgate.plugins.common.broadcast import Broadcast, Channel
from kvgate.plugins.flow.fairness import Fairness
from kvgate.plugins.flow.params import FlowParams
from kvgate.plugins.flow.shared import (
    FlowShare,
    parse_session,
    session_item,
    session_receiver,
)

DIGEST = "0123456789abcdef0123456789abcdef"


@pytest.mark.parametrize(("item", "parsed"), [
    (["acme", DIGEST, 120], ("acme", DIGEST, 120.0)),
    (["acme", DIGEST, 0.5], ("acme", DIGEST, 0.5)),
    (["acme", DIGEST, -1], None),                    # negative tokens
    (["acme", DIGEST, float("inf")], None),
    (["acme", DIGEST, 2e9], None),                   # over one usage's bound
    (["acme", DIGEST, True], None),                  # bool is not a number here
    (["acme", "my-session-id", 10], None),           # a session id in clear, not a digest
    (["", DIGEST, 10], None),
    (["x" * 257, DIGEST, 10], None),
    ([1, DIGEST, 10], None),
    (["acme", DIGEST], None),
    ({"tenant": "acme"}, None),
    ("acme", None),
])
def test_items_are_validated(item: Any, parsed: tuple[str, str, float] | None) -> None:
    assert parse_session(item) == parsed


def _replica(fair: Fairness) -> FlowShare:
    """A share whose broadcast is a queue (no Redis): drained by the test as the bus."""
    params = FlowParams.model_validate({})
    share = FlowShare(params, fair, "flow-control")
    share.sessions = Broadcast(None, None, session_receiver(fair), Channel("t", "t", "t", "t"),
                               me="r", flush_s=1.0, timeout_s=1.0, retry_s=1.0, max_pending=8)
    return share


def test_a_session_served_elsewhere_ranks_by_its_whole_service() -> None:
    """A long session's turns went through replica one; on replica two it ranks behind a
    short session once told, not as a newcomer."""
    p = FlowParams.model_validate({})
    one, two = Fairness(p), Fairness(p)
    share = _replica(one)
    for _ in range(3):
        one.session_served("acme", DIGEST, 4000)
        share.served("acme", DIGEST, 4000)
    share.served("acme", None, 99)  # no session: nothing to tell
    assert two.attained("acme", DIGEST) == 0.0
    assert share.sessions is not None
    items = share.sessions.drain()
    assert items == [session_item("acme", DIGEST, 4000)] * 3
    receive = session_receiver(two)
    assert all(receive(item) for item in items)
    assert not receive(["acme", "not-a-digest", 1])
    assert two.attained("acme", DIGEST) == one.attained("acme", DIGEST) == 12_000


def test_no_share_without_redis_and_sessions_can_be_kept_local() -> None:
    fair = Fairness(FlowParams.model_validate({}))
    assert FlowShare.started(FlowParams.model_validate({}), fair, "f") is None
    local = FlowShare(FlowParams.model_validate(
        {"redis_url": "redis://127.0.0.1:1/0", "share_sessions": False}), fair, "f")
    assert local.sessions is None and local.tenants is not None
    assert local.replicas() == 1
