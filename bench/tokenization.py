"""Cost of the routing hot path per 10k prompt tokens: tokenization, block hashing, index lookup.

For each tokenizer backend, on ``--tokens`` (10,000) tokens of Python source text (the standard
library, sorted, so every run sees the same text):

* ``encode`` — ``encode(text, add_special_tokens=True)`` (a text completion);
* ``chat_cold`` — a 22-message chat rendered by the template and encoded, no cache;
* ``chat_next_turn`` — the same chat when its history minus the last two messages was tokenized
  before (the producer's chat-prefix cache: a growing conversation's next turn);
* ``loop_blocked_inline`` / ``loop_blocked_offloaded`` — the longest stretch the event loop is
  blocked while the ``tokenizer`` plugin prepares that chat request, tokenizing inline
  (``offload_min_chars`` above the body size) or on its thread pool (``offload_min_chars: 0``);
  a ticker task measures the gaps between its wake-ups.

Plus the prefix producer's own chained block hashing (block sizes 16, 64, 128) and one index
match against 8 engines. Every figure is the median of ``--repeats`` runs, in microseconds and
scaled to 10k tokens (the index match: per lookup).

Backends: the simulator's tokenizer (pure Python), a byte-level BPE ``tokenizer.json`` with
vocab 4,096 trained here on the standard library's sources with a Llama-3-style template (the
recipe of the local vLLM test model, so no model download), and any ``--model-dir`` given
(e.g. ``~/.cache/kvgate/models/tiny-llama-0``).

Writes ``bench/results/tokenization-<timestamp>.json`` (``--out``) with the command, the machine
and every figure, and prints a markdown table. Progress goes to stderr.

Run: ``.venv/bin/python -m bench.tokenization`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from bench.harness import machine_info
from kvgate.middleware.framework.types import Api, CycleState
from kvgate.middleware.serving.requests import parse_request
from kvgate.plugins.common.state import TOKEN_IDS
from kvgate.plugins.prefix.index.index import KvIndex, chain_hashes
from kvgate.plugins.prefix.tokenizer import (
    ChatPrefixCache,
    ChatTokenizer,
    Tokenizer,
    TokenizerBackend,
    TokenizerSpec,
    load_backend,
)

RESULTS_DIR = Path("bench/results")
SPECIALS = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
    "\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
#: Messages after the system prompt: 21 alternating user/assistant turns.
TURNS = 21
Messages = list[dict[str, str]]


class _NoLookup:
    def lookup(self, name: str) -> object:
        raise KeyError(name)


def progress(message: str) -> None:
    print(f"[tokenization] {message}", file=sys.stderr, flush=True)


def corpus() -> list[str]:
    root = Path(json.__file__).parent.parent
    return [p.read_text(encoding="utf-8", errors="replace") for p in sorted(root.glob("*.py"))]


def build_hf_folder(folder: Path, texts: Sequence[str]) -> Path:
    """A byte-level BPE tokenizer.json (vocab 4,096) + Llama-3-style template in ``folder``."""
    from tokenizers import Tokenizer as HfTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tok = HfTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=4096, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bos = tok.token_to_id(SPECIALS[0])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{SPECIALS[0]} $A", special_tokens=[(SPECIALS[0], bos)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": TEMPLATE, "bos_token": SPECIALS[0], "eos_token": SPECIALS[1]}))
    return folder


def median_us(fn: Callable[[], object], repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs) * 1e6


def text_of_tokens(backend: TokenizerBackend, text: str, tokens: int) -> str:
    """A prefix of ``text`` holding about ``tokens`` tokens."""
    sample = text[: tokens * 8]
    ratio = len(sample) / max(1, len(backend.encode(sample, False)))
    return text[: int(tokens * ratio)]


def conversation(text: str) -> Messages:
    step = max(1, len(text) // TURNS)
    msgs = [{"role": "system", "content": "You are helpful."}]
    for i in range(TURNS):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant",
                     "content": text[i * step : (i + 1) * step]})
    return msgs


def next_turn_us(backend: TokenizerBackend, msgs: Messages, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        warm = ChatTokenizer(backend, ChatPrefixCache())
        warm.tokenize(msgs[:-2], True, {})
        t0 = time.perf_counter()
        warm.tokenize(msgs, True, {})
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


async def loop_blocked_us(spec: TokenizerSpec, msgs: Messages, offload: bool,
                          repeats: int) -> float:
    """Median over ``repeats`` of the longest event-loop stall while the plugin prepares."""
    params = Tokenizer.Params(tokenizer=spec, cache_bytes=0,
                              offload_min_chars=0 if offload else 1 << 40)
    plugin = Tokenizer("tokenizer", params, _NoLookup())
    await plugin.start()
    body = json.dumps({"model": "m", "messages": msgs}).encode()
    stalls = []
    try:
        for _ in range(repeats):
            req = parse_request(Api.CHAT, body, {}, "bench")
            state = CycleState()
            stalls.append((await loop_ticks_while(plugin.prepare(req, state, [])))[1])
            assert state.get(TOKEN_IDS)
    finally:
        await plugin.stop()
    return statistics.median(stalls) * 1e6


async def loop_ticks_while(work: Awaitable[Any]) -> tuple[int, float]:
    """(wake-ups of a ticker task, its longest gap in s) while ``work`` is awaited: how long
    the event loop was kept from running other tasks."""
    ticks, longest, done = 0, 0.0, False

    async def ticker() -> None:
        nonlocal ticks, longest
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0)
            now = time.perf_counter()
            ticks, longest, last = ticks + 1, max(longest, now - last), now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    try:
        await work
    finally:
        done = True
        await task
    return ticks, longest


def bench_backend(name: str, spec: TokenizerSpec, text: str, tokens: int,
                  repeats: int) -> dict[str, Any]:
    backend = load_backend(spec)
    sample = text_of_tokens(backend, text, tokens)
    n = len(backend.encode(sample, False))
    scale = 10_000 / n
    msgs = conversation(sample)
    cold = ChatTokenizer(backend, None)
    figures = {
        "encode": median_us(lambda: backend.encode(sample, True), repeats),
        "chat_cold": median_us(lambda: cold.tokenize(msgs, True, {}), repeats),
        "chat_next_turn": next_turn_us(backend, msgs, repeats),
        "loop_blocked_inline": asyncio.run(loop_blocked_us(spec, msgs, False, repeats)),
        "loop_blocked_offloaded": asyncio.run(loop_blocked_us(spec, msgs, True, repeats)),
    }
    progress(f"{name}: {n} tokens, encode {figures['encode'] * scale:,.0f} us / 10k tokens")
    return {"backend": name, "chars": len(sample), "tokens": n,
            "us_per_10k_tokens": {k: v * scale for k, v in figures.items()},
            "us_per_char_encode": figures["encode"] / len(sample)}


def bench_hashing(repeats: int) -> dict[str, Any]:
    tokens = list(range(10_000))
    per_size = {size: median_us(functools.partial(chain_hashes, tokens, size), repeats)
                for size in (16, 64, 128)}
    index = KvIndex(262_144)
    hashes = chain_hashes(tokens, 16)
    for e in range(8):
        index.record(f"e{e}", hashes[: 80 * (e + 1)], float("inf"), block_size=16)
    match = median_us(lambda: index.match({16: hashes}, 0.0), repeats)
    progress(f"hashing: block 16 {per_size[16]:,.0f} us / 10k tokens; index match {match:,.0f} us")
    return {"block_hash_us_per_10k_tokens": {str(k): v for k, v in per_size.items()},
            "index_match_us": match,
            "index_match_setup": "8 engines holding 80..640 of the prompt's 625 blocks of 16"}


def table(results: Sequence[dict[str, Any]], hashing: dict[str, Any]) -> str:
    keys = ("encode", "chat_cold", "chat_next_turn", "loop_blocked_inline",
            "loop_blocked_offloaded")
    lines = ["| backend | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for r in results:
        cells = " | ".join(f"{r['us_per_10k_tokens'][k] / 1000:.2f} ms" for k in keys)
        lines.append(f"| {r['backend']} | {cells} |")
    sizes = ", ".join(f"block {k}: {v / 1000:.2f} ms"
                      for k, v in hashing["block_hash_us_per_10k_tokens"].items())
    lines.append(f"\nown block hashes per 10k tokens: {sizes}; index match (8 engines): "
                 f"{hashing['index_match_us'] / 1000:.2f} ms")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.tokenization", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=10_000, help="prompt size measured")
    parser.add_argument("--repeats", type=int, default=15, help="runs per figure (median)")
    parser.add_argument("--model-dir", type=Path, action="append", default=[],
                        help="also measure this Hugging Face model folder (repeatable)")
    parser.add_argument("--no-sim", action="store_true", help="skip the simulator's tokenizer")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2k tokens, 3 repeats")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: timestamped)")
    return parser


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    tokens, repeats = (2_000, 3) if args.quick else (args.tokens, args.repeats)
    texts = corpus()
    text = "\n".join(texts)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        progress("training the byte-level BPE tokenizer ...")
        trained = build_hf_folder(Path(tmp), texts[:200])
        specs = [] if args.no_sim else [
            ("sim tokenizer (pure Python)",
             TokenizerSpec(kind="module", module="kvgate.engines.sim.core.tokenizer"))]
        specs.append(("HF byte-level BPE, vocab 4096",
                      TokenizerSpec(kind="hf", model_dir=str(trained))))
        specs += [(f"HF {d.name}", TokenizerSpec(kind="hf", model_dir=str(d.expanduser())))
                  for d in args.model_dir]
        for name, spec in specs:
            results.append(bench_backend(name, spec, text, tokens, repeats))
    return {"benchmark": "tokenization",
            "command": shlex.join([sys.executable, "-m", "bench.tokenization", *argv]),
            "machine": machine_info(), "tokens": tokens, "repeats": repeats,
            "backends": results, "hashing": bench_hashing(repeats)}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    doc = run(args, argv)
    out = args.out or RESULTS_DIR / f"tokenization-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(table(doc["backends"], doc["hashing"]))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
