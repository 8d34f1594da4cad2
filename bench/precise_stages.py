"""Where the precise path's time goes per request, in process: the ``tokenizer`` plugin's
``prepare`` (inline: render, cached-prefix lookup, encode of the new text), the prefix
producer's ``prepare`` (block hashes of both chains, index matches), its ``before_dispatch``
(speculative record, prompt remembered for orphans, the record) and its ``on_usage``.

The same seeded conversations as ``bench.precise_scale`` (one session: no concurrency, no HTTP,
no thread hop), the engine configured for KV events as ``kvgate serve --kv-events`` does
(nothing publishes). Reports CPU ms per stage (``time.process_time``), the mean over the turns
whose prompt is past ``--from-tokens`` (default: the last fifth of the conversation).

Run: ``.venv/bin/python -m bench.precise_stages [--max-tokens 100000]``.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Sequence
from pathlib import Path

from bench import precise_scale
from bench.systems import DEFAULT_TOKENIZER
from kvgate.middleware.framework.types import Api, CycleState, Endpoint, RoutingDecision, Usage
from kvgate.middleware.serving.requests import parse_request
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


async def run(opts: precise_scale.Options, from_tokens: int) -> dict[str, float]:
    """Mean CPU ms per stage over the turns past ``from_tokens`` (estimated from chars)."""
    spec = {"kind": "hf", "model_dir": str(opts.model_dir)}
    tok = Tokenizer("tokenizer", Tokenizer.Params(tokenizer=spec), _Lookup({}))
    await tok.start()
    sub = KvEventsSubscriber("kv-events", KvEventsSubscriber.Params(connect=True),
                             _Lookup({}))
    sub.on_endpoints_changed(EPS, [])
    producer = PrefixCacheProducer("prefix", PrefixCacheProducer.Params(mode="auto"),
                                   _Lookup({"kv-events": sub}))
    producer.on_endpoints_changed(EPS, [])
    conv = precise_scale.conversations(opts)[0]
    sums = dict.fromkeys(STAGES, 0.0)
    counted = 0
    for _ in range(precise_scale.turns_per_session(opts)):
        body = conv.next_body(opts)
        req = parse_request(Api.CHAT, body, {}, "r")
        state = CycleState()
        marks = [time.process_time()]
        await tok.prepare(req, state, EPS)
        marks.append(time.process_time())
        await producer.prepare(req, state, EPS)
        marks.append(time.process_time())
        await producer.before_dispatch(req, state, RoutingDecision(target=EPS[0]))
        marks.append(time.process_time())
        await producer.on_usage(req, state, EPS[0], Usage(256, 1, 128))
        marks.append(time.process_time())
        if len(body) / precise_scale.CHARS_PER_TOKEN >= from_tokens:
            counted += 1
            for stage, a, b in zip(STAGES, marks, marks[1:], strict=False):
                sums[stage] += b - a
    await tok.stop()
    return {stage: total * 1e3 / max(1, counted) for stage, total in sums.items()}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.precise_stages",
                                description=__doc__.splitlines()[0])
    p.add_argument("--max-tokens", type=int, default=100_000)
    p.add_argument("--from-tokens", type=int, default=None)
    p.add_argument("--model-dir", type=Path, default=DEFAULT_TOKENIZER)
    a = p.parse_args(argv)
    opts = precise_scale.parse_options(["--sessions", "1", "--max-tokens", str(a.max_tokens),
                                        "--model-dir", str(a.model_dir)])
    from_tokens = a.from_tokens if a.from_tokens is not None else a.max_tokens * 4 // 5
    stages = asyncio.run(run(opts, from_tokens))
    print(f"CPU ms per request, turns past ~{from_tokens} tokens (commit "
          f"{precise_scale.git_commit()}):")
    for stage, ms in stages.items():
        print(f"- {stage}: {ms:.3f}")
    print(f"- total: {sum(stages.values()):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
