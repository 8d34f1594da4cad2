"""Builds a tiny random-weight Llama-style model and its tokenizer, offline.

Runs with the ENGINE venv's Python (it imports torch, transformers, tokenizers), as a script:
``python build_model_script.py --out DIR --seed N``. Deterministic given the seed: the tokenizer
is a byte-level BPE trained single-threaded on a sorted list of the standard library's ``.py``
files, the weights come from ``torch.manual_seed(seed)``. No hub access.
"""

from __future__ import annotations

import argparse
import os
import sysconfig
from pathlib import Path

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # deterministic BPE training
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
           "<|eot_id|>"]
VOCAB = 4096
#: Llama-3 style: BOS, then per message a role header and the content ended by <|eot_id|>.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
#: Training text: this many stdlib modules (sorted paths) — enough for a 4k vocabulary, ~2 s.
TRAIN_FILES = 300


def _corpus() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py"))[:TRAIN_FILES]
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


def build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=SPECIAL, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    bos = tok.token_to_id(SPECIAL[0])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{SPECIAL[0]} $A", pair=f"{SPECIAL[0]} $A $B", special_tokens=[(SPECIAL[0], bos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=SPECIAL[0], eos_token=SPECIAL[4], pad_token=SPECIAL[1],
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(out)


def build_model(out: Path, seed: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=4096, vocab_size=VOCAB,
        bos_token_id=0, eos_token_id=4, pad_token_id=1, torch_dtype="float32",
    )
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(args.out)
    build_model(args.out, args.seed)


if __name__ == "__main__":
    main()
