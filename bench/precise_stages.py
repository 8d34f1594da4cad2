"""Where the precise path's time goes per request, in process: the ``tokenizer`` plugin's
``prepare`` (inline: render, cached-prefix lookup, encode of the new text), the prefix
producer's ``prepare`` (block hashes of both chains, index matches), its ``before_dispatch``
(speculative record, prompt remembered for orphans, the record) and its ``on_usage``.

The same seeded conversations as ``bench.precise_scale`` (one session: no concurrency, no HTTP,
no thread hop), the engine configured for KV events as ``kvgate serve --kv-events`` does
(nothing publishes). Reports CPU ms per stage (``time.process_time``), the mean over the turns
whose prompt is past ``--from-tokens`` (default: the last fifth of the conversation).

``--events``: the engine also acts like a vLLM engine with KV events: after each turn it
stores the prompt's new full blocks (one ``BlockStored`` into the index, engine hashes of its
own) and reports the blocks it held as ``cached_tokens`` (so the producer learns from usage,
as with a real engine). Without it the index holds only the gateway's speculative entries, as
in ``bench.precise_scale`` (whose fake engine publishes nothing).

Run: ``.venv/bin/python -m bench.precise_stages [--max-tokens 100000] [--events]``.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench import harness, precise_scale
from bench.systems import DEFAULT_TOKENIZER
from kvgate.middleware.framework.types import Api, CycleState, Endpoint, RoutingDecision, Usage
from kvgate.middleware.serving.requests import parse_request
from kvgate.plugins.common.state import TOKEN_IDS
from kvgate.plugins.prefix.events.subscriber import KvEventsSubscriber
from kvgate.plugins.prefix.producer import PrefixCacheProducer
from kvgate.plugins.prefix.tokenizer import Tokenizer

STAGES = ("tokenizer.prepare", "prefix.prepare", "prefix.before_dispatch", "prefix.on_usage")
EPS = [Endpoint(id="e0", url="http://127.0.0.1:9", kind="vllm",
                kv_events="tcp://127.0.0.1:9")]


class _Lookup:
    def __init__(self, plugins: dict[str, object]) -> None:
        self._plugins = plugins

    def lookup(self, name: str) -> object:
        return self._plugins[name]


class _Engine:
    """The engine's side with ``--events``: what it stored, in its block size (16)."""

    def __init__(self, sub: KvEventsSubscriber, engine: str = "e0", block_size: int = 16) -> None:
        self.sub, self.engine, self.block_size = sub, engine, block_size
        self.ehashes: list[int] = []  # the engine's hash of each stored block, in order
        self.stored: list[int] = []  # their token ids
        self.next_hash = 1

    def served(self, tokens: Sequence[int]) -> Usage:
        """The usage the engine reports (cached: the full blocks it held of the prompt, less
        the last token, as vLLM), then its BlockStored for the prompt's blocks past them."""
        bs, ids = self.block_size, list(tokens)
        held = len(self.ehashes)
        while held and ids[:held * bs] != self.stored[:held * bs]:
            held -= 1  # the previous prompt's last block(s) re-tokenized differently
        cached = min(held, max(0, len(ids) - 1) // bs) * bs
        n = len(ids) // bs
        del self.ehashes[held:]
        if n > held:
            new = [self.next_hash + i for i in range(n - held)]
            self.next_hash += n - held
            parent = self.ehashes[-1] if self.ehashes else None
            self.sub.index.store(self.engine, new, parent, ids[held * bs:n * bs], bs)
            self.ehashes.extend(new)
        self.stored = ids[:n * bs]
        return Usage(len(ids), 1, cached)


@dataclass
class _Pipe:
    """One gateway's precise path: tokenizer, kv-events index, producer (and the engine)."""

    tok: Tokenizer
    sub: KvEventsSubscriber
    producer: PrefixCacheProducer
    engine: _Engine | None
    sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))


async def _pipe(opts: precise_scale.Options, events: bool, memo: bool) -> _Pipe:
    spec = {"kind": "hf", "model_dir": str(opts.model_dir)}
    tok = Tokenizer("tokenizer", Tokenizer.Params(tokenizer=spec), _Lookup({}))
    await tok.start()
    params = KvEventsSubscriber.Params(connect=True, **({} if memo else {"match_memo_bytes": 0}))
    sub = KvEventsSubscriber("kv-events", params, _Lookup({}))
    sub.on_endpoints_changed(EPS, [])
    producer = PrefixCacheProducer("prefix", PrefixCacheProducer.Params(mode="auto"),
                                   _Lookup({"kv-events": sub}))
    producer.on_endpoints_changed(EPS, [])
    return _Pipe(tok, sub, producer, _Engine(sub) if events else None)


async def _turn(pipe: _Pipe, body: bytes) -> list[float]:
    """CPU seconds of each stage for one request."""
    req = parse_request(Api.CHAT, body, {}, "r")
    state, producer = CycleState(), pipe.producer
    spent = [await _timed(pipe.tok.prepare(req, state, EPS)),
             await _timed(producer.prepare(req, state, EPS)),
             await _timed(producer.before_dispatch(req, state, RoutingDecision(target=EPS[0])))]
    tokens = state.get(TOKEN_IDS) or ()
    usage = Usage(256, 1, 128) if pipe.engine is None else pipe.engine.served(tokens)  # untimed
    spent.append(await _timed(producer.on_usage(req, state, EPS[0], usage)))
    return spent


async def run(opts: precise_scale.Options, from_tokens: int, events: bool = False,
              memo: Sequence[bool] = (True,)) -> list[dict[str, float]]:
    """Mean CPU ms per stage over the turns past ``from_tokens`` (estimated from chars), per
    pipe: one per entry of ``memo`` (the index's match memo on or off), fed the same requests
    in lockstep, in alternating order (so they share the machine's load turn by turn)."""
    pipes = [await _pipe(opts, events, on) for on in memo]
    conv = precise_scale.conversations(opts)[0]
    counted = 0
    for turn in range(precise_scale.turns_per_session(opts)):
        body = conv.next_body(opts)
        order = pipes if turn % 2 == 0 else pipes[::-1]
        spent = {id(pipe): await _turn(pipe, body) for pipe in order}
        if len(body) / precise_scale.CHARS_PER_TOKEN >= from_tokens:
            counted += 1
            for pipe in pipes:
                for stage, cpu in zip(STAGES, spent[id(pipe)], strict=True):
                    pipe.sums[stage] += cpu
    for pipe in pipes:
        await pipe.tok.stop()
    return [{stage: total * 1e3 / max(1, counted) for stage, total in pipe.sums.items()}
            for pipe in pipes]


async def _timed(step: Awaitable[None]) -> float:
    """CPU seconds of one hook (it does not wait on I/O here)."""
    start = time.process_time()
    await step
    return time.process_time() - start


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.precise_stages",
                                description=__doc__.splitlines()[0])
    p.add_argument("--max-tokens", type=int, default=100_000)
    p.add_argument("--from-tokens", type=int, default=None)
    p.add_argument("--model-dir", type=Path, default=DEFAULT_TOKENIZER)
    p.add_argument("--events", action="store_true",
                   help="the engine stores each turn's blocks (KV events) and reports its hits")
    p.add_argument("--memo-off", action="store_true",
                   help="also run the index without its match memo (every walk from the root), "
                        "in lockstep with the default, and print both")
    a = p.parse_args(argv)
    opts = precise_scale.parse_options(["--sessions", "1", "--max-tokens", str(a.max_tokens),
                                        "--model-dir", str(a.model_dir)])
    from_tokens = a.from_tokens if a.from_tokens is not None else a.max_tokens * 4 // 5
    memo = (True, False) if a.memo_off else (True,)
    results = asyncio.run(run(opts, from_tokens, a.events, memo))
    print(f"CPU ms per request, turns past ~{from_tokens} tokens (commit "
          f"{harness.git_commit()}{', engine events' if a.events else ''}):")
    for on, stages in zip(memo, results, strict=True):
        if a.memo_off:
            print(f"match memo {'on' if on else 'off'}:")
        for stage, ms in stages.items():
            print(f"- {stage}: {ms:.3f}")
        print(f"- total: {sum(stages.values()):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
