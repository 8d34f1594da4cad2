"""bench/precise_stages.py --events: the engine's side reports what it held and stores the rest,
as vLLM does, so the index's event entries follow the session."""

from __future__ import annotations

import random

import pytest

from bench.precise_stages import _Engine, _Lookup
from kvgate.plugins.prefix.events.subscriber import KvEventsSubscriber
from kvgate.plugins.prefix.index.hashing import chain_hashes

BS = 16


@pytest.mark.parametrize(("seed", "edit_at"), [(1, None), (2, 40), (3, 3)])
def test_engine_reports_its_held_blocks_and_stores_the_rest(seed: int,
                                                           edit_at: int | None) -> None:
    rng = random.Random(seed)
    sub = KvEventsSubscriber("kv-events", KvEventsSubscriber.Params(), _Lookup({}))
    engine = _Engine(sub, "e0", BS)
    tokens = [rng.randrange(4096) for _ in range(100)]
    assert engine.served(tokens).cached_tokens == 0  # a cold engine
    for turn in range(5):
        held_before = len(tokens) // BS
        if edit_at is not None and turn == 2:  # an edit: the engine holds only what precedes it
            tokens[edit_at] = 4096 + turn
            held_before = edit_at // BS
        tokens += [rng.randrange(4096) for _ in range(rng.randint(1, 60))]
        usage = engine.served(tokens)
        assert usage.prompt_tokens == len(tokens)
        assert usage.cached_tokens == min(held_before, (len(tokens) - 1) // BS) * BS
        hashes = chain_hashes(tokens, BS)
        found = sub.index.match({BS: hashes}, 0.0, 0, ["e0"])
        assert found == {"e0": (len(hashes) * BS, 0)}  # every full block now event-held
