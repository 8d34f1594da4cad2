"""The KV-event index's resumed match (plugins/prefix/index/resume.py) gives exactly what the
walk from the root gives: two indexes, one with the match memo and one without (the oracle),
get the same seeded random sequence of session turns (matches, speculative records, learnt
records and their forgetting), engine events (stores on two tiers, removals), evictions under a
small capacity, expiries, cache resets (AllBlocksCleared) and engine restarts; every match's
answer (tokens per holder and the confirmed/unlearned runs), the counters and every holder's
blocks in LRU order must be equal after every step."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

import pytest

from kvgate.middleware.observe.metrics import counter_holders
from kvgate.plugins.prefix.events.subscriber import KvEventsSubscriber
from kvgate.plugins.prefix.index.hashing import chain_hashes
from kvgate.plugins.prefix.index.index import KvIndex
from kvgate.plugins.prefix.index.resume import Run
from tests.unit.routing.helpers import NoLookup

BS = 4
ENGINES = ("e0", "e1", "e2")


@dataclass(frozen=True)
class Case:
    seed: int
    capacity: int
    ttl: float  # speculative lifetime (s)
    step_s: float  # mean time between operations (s)
    events: float  # share of operations that are engine events
    resets: float  # share that are cache resets / engine restarts
    other_tier: float  # share of stores on a slower tier


CASES = [
    Case(1, 100_000, 2.0, 0.05, 0.3, 0.0, 0.0),    # no pressure: turns and events only
    Case(2, 100_000, 2.0, 0.6, 0.3, 0.02, 0.2),    # expiries, resets, two tiers
    Case(3, 160, 2.0, 0.05, 0.4, 0.0, 0.1),        # LRU eviction on every store
    Case(4, 400, 0.5, 0.3, 0.5, 0.03, 0.3),        # everything at once
    Case(5, 100_000, 30.0, 0.01, 0.1, 0.0, 0.0),   # long-lived speculation, few events
    Case(6, 250, 1.0, 0.2, 0.6, 0.05, 0.5),        # event-heavy under pressure
]


class Sessions:
    """Conversations sharing a system prompt, growing by a few blocks a turn; sometimes one
    is edited (diverges) or restarts."""

    def __init__(self, rng: random.Random, count: int) -> None:
        self.rng = rng
        system = [rng.randrange(1000) for _ in range(BS * 3 + 1)]
        self.tokens = [list(system) for _ in range(count)]

    def turn(self) -> list[int]:
        rng = self.rng
        i = rng.randrange(len(self.tokens))
        toks = self.tokens[i]
        roll = rng.random()
        if roll < 0.05 and len(toks) > BS * 4:  # an edit: diverge somewhere
            cut = rng.randrange(BS, len(toks))
            toks[cut:] = [rng.randrange(1000) for _ in range(rng.randint(1, 3 * BS))]
        elif roll < 0.1:  # the same prompt again
            pass
        else:
            toks.extend(rng.randrange(1000) for _ in range(rng.randint(1, 3 * BS)))
        return list(toks)


def _same(a: KvIndex, b: KvIndex) -> None:
    assert asdict(a.stats) == asdict(b.stats)
    assert len(a) == len(b)
    assert a.holders() == b.holders()
    for hid in a.holders():
        ha, hb = a._holders[hid], b._holders[hid]
        assert [(h, x.tiers, x.expires, x.ekey) for h, x in ha.blocks.items()] == [
            (h, x.tiers, x.expires, x.ekey) for h, x in hb.blocks.items()]
        assert ha.by_ehash == hb.by_ehash


class Driver:
    """Applies the same operation to both indexes and compares."""

    def __init__(self, case: Case) -> None:
        self.case = case
        self.rng = random.Random(case.seed)
        self.fast = KvIndex(case.capacity, default_block_size=BS)
        self.full = KvIndex(case.capacity, default_block_size=BS, match_memo_bytes=0)
        self.sessions = Sessions(self.rng, 5)
        self.now = 0.0
        self.generation = dict.fromkeys(ENGINES, 0)  # engine restarts change its hashes
        self.stored: dict[str, list[list[int]]] = {e: [] for e in ENGINES}

    def both(self, op: str, *args: object, **kwargs: object) -> object:
        x = getattr(self.fast, op)(*args, **kwargs)
        y = getattr(self.full, op)(*args, **kwargs)
        assert x == y, op
        return x

    def ehash(self, engine: str, own: int) -> int:
        return hash((engine, self.generation[engine], own)) & ((1 << 63) - 1)

    def request(self) -> None:
        tokens = self.sessions.turn()
        chain = self.chain(tokens)
        runs_a: dict[str, tuple[int, int]] = {}
        runs_b: dict[str, tuple[int, int]] = {}
        found = self.fast.match({BS: chain}, self.now, 0, list(ENGINES), runs_a)
        assert found == self.full.match({BS: chain}, self.now, 0, list(ENGINES), runs_b)
        assert runs_a == runs_b
        target = self.rng.choice(ENGINES)
        self.both("record", target, chain, self.now + self.case.ttl, block_size=BS)
        if self.rng.random() < 0.5:  # the usage: learnt prefix, speculation beyond forgotten
            held = self.rng.randint(0, len(chain))
            self.both("record", target, chain[:held], self.now + 300, block_size=BS,
                      learned=True, chain=chain if self.rng.random() < 0.8 else None)
            self.both("forget_records", target, chain[held:], self.now + self.case.ttl)
        if self.rng.random() < 0.8:
            self.stored[target].append(tokens)

    def chain(self, tokens: list[int]) -> list[int]:
        return chain_hashes(tokens, BS)

    def event(self) -> None:
        engine = self.rng.choice(ENGINES)
        if self.stored[engine] and self.rng.random() < 0.7:  # the engine stores a prompt's blocks
            tokens = self.stored[engine].pop(0)
            own = self.chain(tokens)
            if not own:
                return
            a = self.rng.randrange(len(own))
            b = self.rng.randint(a + 1, len(own))
            parent = None if a == 0 else self.ehash(engine, own[a - 1])
            medium = "CPU" if self.rng.random() < self.case.other_tier else None
            self.both("store", engine, [self.ehash(engine, h) for h in own[a:b]], parent,
                      tokens[a * BS:b * BS], BS, medium=medium)
            return
        known = sorted(self.full._holders[engine].by_ehash) if engine in self.full.holders() \
            else []
        if known:  # the engine evicts a few blocks (one per event, as vLLM does)
            for key in self.rng.sample(known, min(len(known), self.rng.randint(1, 4))):
                medium = "CPU" if self.rng.random() < self.case.other_tier else None
                self.both("remove", engine, [key[1]], medium=medium)

    def reset(self) -> None:
        engine = self.rng.choice(ENGINES)
        if self.rng.random() < 0.5:  # AllBlocksCleared
            self.both("reset", engine)
        else:  # the engine restarted: new hashes, its entries dropped
            self.generation[engine] += 1
            self.both("reset_engine", engine)

    def step(self) -> None:
        self.now += self.rng.expovariate(1 / self.case.step_s)
        roll = self.rng.random()
        if roll < self.case.resets:
            self.reset()
        elif roll < self.case.resets + self.case.events:
            self.event()
        else:
            self.request()
        _same(self.fast, self.full)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"seed{c.seed}")
def test_resumed_match_equals_the_full_walk(case: Case) -> None:
    driver = Driver(case)
    for _ in range(1500):
        driver.step()
    stats = driver.fast.match_memo
    assert driver.full.match_memo.resumed == 0
    assert stats.resumed > 0 and stats.skipped_blocks > 0  # the shortcuts were taken
    assert stats.refreshed_blocks > 0 or case.events < 0.2
    assert driver.full.match_memo.refreshed_blocks == 0


def test_memo_is_bounded_and_counts_its_bytes() -> None:
    index = KvIndex(100_000, default_block_size=BS, match_memo_bytes=20_000)
    index.record("e0", [1], 1e9, block_size=BS)
    rng = random.Random(7)
    for _ in range(200):
        chain = [rng.getrandbits(63) for _ in range(rng.randint(1, 200))]
        index.match({BS: chain}, 0.0, 0, ["e0"])
    memo = index.resume
    assert 0 < memo.stats.bytes <= 20_000
    assert memo.stats.entries == len(memo) and memo.stats.evicted > 0
    assert memo.stats.bytes == sum(e.size for e in memo._entries.values())


def test_session_turns_are_walked_from_where_they_stopped() -> None:
    """An agent session: each turn's match skips the blocks its previous turn matched."""
    index = KvIndex(100_000, default_block_size=BS)
    rng = random.Random(3)
    chain: list[int] = []
    for turn in range(20):
        chain = chain + [rng.getrandbits(63) for _ in range(10)]
        index.match({BS: chain}, float(turn), 0, ["e0"])
        index.record("e0", chain, turn + 2.0, block_size=BS)
    stats = index.match_memo
    assert stats.superseded == 18 and stats.entries == 1
    assert stats.skipped_blocks == sum(10 * t for t in range(19))  # each turn's previous match
    assert isinstance(next(iter(index.resume._entries.values())).runs["e0"], Run)


@pytest.mark.parametrize(("recorded", "raised"), [
    (10, True),   # the record covers the whole run: its earliest expiry is the record's now
    (12, True),   # a longer chain extending it, likewise
    (9, False),   # the run's last block is not in the record: it may still expire first
])
def test_a_record_raises_a_run_it_covers_only(recorded: int, raised: bool) -> None:
    memo_index = KvIndex(100_000, default_block_size=BS)
    chain = list(range(1, 13))
    memo_index.record("e0", chain[:10], 5.0, block_size=BS)
    memo_index.match({BS: chain[:10]}, 0.0, 0, ["e0"])
    memo_index.record("e0", chain[:recorded], 50.0, block_size=BS)
    entry, _ = memo_index.resume.find(chain[:10])
    assert entry is not None
    assert entry.runs["e0"].expires == (50.0 if raised else 5.0)


def test_memo_size_is_on_metrics() -> None:
    """The kv-events plugin's memo is a counter holder (``holder="index.match_memo"``)."""
    sub = KvEventsSubscriber("kv-events", KvEventsSubscriber.Params(match_memo_bytes=4096),
                             NoLookup())
    sub.index.record("e0", [1, 2, 3], 1e9, block_size=BS)
    sub.index.match({BS: [1, 2, 3]}, 0.0, 0, ["e0"])
    held = counter_holders(sub)["index.match_memo"]
    assert held["entries"] == 1 and 0 < held["bytes"] <= 4096
    assert sub.index.resume.max_bytes == 4096
