"""Cost of the routing hot path per 10k prompt tokens: tokenization (cold, and a growing chat
served from the prefix cache), own block hashing, and an index lookup.

Run: ``.venv/bin/python -m tests.unit.routing.bench_tokenization`` (prints one line per
measurement: median of ``REPEATS`` runs, microseconds per 10k tokens). Backends: the simulator's
tokenizer (pure Python) and a byte-level BPE ``tokenizer.json`` (vocab 4,096, trained here on
the standard library's sources, as for the local vLLM test model) with a Llama-3-style template.
Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from plugins.kv_index import KvIndex, chain_hashes
from plugins.tokenization import ChatPrefixCache, ChatTokenizer, HfBackend, load_backend
from plugins.tokenization import TokenizerSpec as Spec

REPEATS = 15
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
    "\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def _corpus() -> list[str]:
    root = Path(sys.modules["json"].__file__ or "").parent.parent
    return [p.read_text(encoding="utf-8", errors="replace") for p in sorted(root.glob("*.py"))]


def _hf_folder(folder: Path, corpus: list[str]) -> Path:
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=4096, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": TEMPLATE, "bos_token": "<|begin_of_text|>"}))
    return folder


def _median_us(fn: Callable[[], Any]) -> float:
    runs = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs) * 1e6


def _text_of_tokens(chat: ChatTokenizer, text: str, tokens: int) -> str:
    """A prefix of ``text`` holding about ``tokens`` tokens."""
    ratio = len(text) / max(1, len(chat.backend.encode(text, False)))
    return text[: int(tokens * ratio)]


def _bench_backend(name: str, chat: ChatTokenizer, corpus_text: str) -> None:
    text = _text_of_tokens(chat, corpus_text, 10_000)
    n = len(chat.backend.encode(text, False))
    per10k = 10_000 / n
    print(f"{name}: text of {len(text)} chars = {n} tokens")
    print(f"  encode text          {_median_us(lambda: chat.backend.encode(text, True)) * per10k:9.0f} us / 10k tokens")
    turns = [text[i : i + len(text) // 21] for i in range(0, len(text), len(text) // 21)][:21]
    msgs = [{"role": "system", "content": "You are helpful."}]
    for i, part in enumerate(turns):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": part})
    cold = ChatTokenizer(chat.backend, None)
    print(f"  chat, cold           {_median_us(lambda: cold.tokenize(msgs, True, {})) * per10k:9.0f} us / 10k tokens")

    def next_turn() -> None:
        warm = ChatTokenizer(chat.backend, ChatPrefixCache(1_000_000))
        warm.tokenize(msgs[:-2], True, {})
        t0 = time.perf_counter()
        warm.tokenize(msgs, True, {})
        samples.append(time.perf_counter() - t0)

    samples: list[float] = []
    for _ in range(REPEATS):
        next_turn()
    warm_us = statistics.median(samples) * 1e6
    print(f"  chat, next turn (prefix cached, +{len(turns[-1]) * 2} chars) {warm_us * per10k:9.0f} us / 10k tokens")


def _bench_hashing() -> None:
    tokens = list(range(10_000))
    for size in (16, 64, 128):
        us = _median_us(lambda size=size: chain_hashes(tokens, size))  # type: ignore[misc]
        print(f"own block hashes, block {size:3d}: {us:7.0f} us / 10k tokens")
    index = KvIndex(262_144)
    hashes = chain_hashes(tokens, 16)
    for e in range(8):
        index.record(f"e{e}", hashes[: 80 * (e + 1)], float("inf"), block_size=16)
    us = _median_us(lambda: index.match({16: hashes}, 0.0))
    print(f"index match, 8 engines holding 80..640 of 625 blocks: {us:7.0f} us")


def main() -> None:
    corpus = _corpus()
    corpus_text = "\n".join(corpus)
    sim = ChatTokenizer(load_backend(Spec(kind="module", module="engines.sim.tokenizer")), None)
    _bench_backend("sim tokenizer (pure Python)", sim, corpus_text)
    with tempfile.TemporaryDirectory() as tmp:
        hf = ChatTokenizer(HfBackend(_hf_folder(Path(tmp), corpus[:200])), None)
        _bench_backend("HF tokenizer.json (byte-level BPE, vocab 4096)", hf, corpus_text)
    _bench_hashing()


if __name__ == "__main__":
    main()
