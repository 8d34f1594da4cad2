"""Tokenizer: determinism, coverage of the text, chat template, round trip of generated text."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvgate.engines.sim.core.tokenizer import (
    NUM_SPECIAL,
    SPECIAL_TOKENS,
    VOCAB_TOTAL,
    TemplateError,
    chat_token_ids,
    output_piece,
    piece_id,
    render_chat,
    split_pieces,
    tokenize,
)

ENGLISH = (
    "Large language models are served by engines that batch many requests together. Each "
    "request first runs a prefill over its prompt, then decodes one token per step until it stops."
)


@pytest.mark.parametrize(
    ("text", "ids"),
    [
        # Pinned: these ids must never change, or gateway-side hashes stop matching old engines.
        ("Hello, world!", [8594, 894, 21723, 21987]),
        ("<|begin_of_text|>hi", [0, 19388]),
        ("", []),
    ],
)
def test_ids_are_pinned(text: str, ids: list[int]) -> None:
    assert tokenize(text) == ids


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_pieces_cover_every_character(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = "abcXYZ éß中文😀123_-.,;:!? \n\t\u0301½"
    text = "".join(rng.choice(alphabet) for _ in range(500))
    assert "".join(split_pieces(text)) == text
    ids = tokenize(text)
    assert all(NUM_SPECIAL <= i < VOCAB_TOTAL for i in ids)
    assert tokenize(text) == ids


def test_english_is_about_four_chars_per_token() -> None:
    assert 3.5 <= len(ENGLISH) / len(tokenize(ENGLISH)) <= 5.0


@pytest.mark.parametrize(("special", "token_id"), sorted(SPECIAL_TOKENS.items()))
def test_special_tokens_map_to_their_ids(special: str, token_id: int) -> None:
    assert tokenize(f"a{special}b") == [piece_id("a"), token_id, piece_id("b")]


def test_chat_template_layout() -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert render_chat(msgs) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert render_chat(msgs, add_generation_prompt=False).endswith("Hi<|eot_id|>")


def test_chat_prefix_property() -> None:
    """A longer conversation's ids start with the shorter one's (what prefix caching needs)."""
    turn1 = [{"role": "user", "content": ENGLISH}]
    turn2 = [*turn1, {"role": "assistant", "content": " mo ka"}, {"role": "user", "content": "ok"}]
    short = chat_token_ids(turn1, add_generation_prompt=False)
    assert chat_token_ids(turn2)[: len(short)] == short


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "ab"),
        (None, ""),
    ],
)
def test_content_forms(content: Any, expected: str) -> None:
    text = render_chat([{"role": "assistant", "content": content}], add_generation_prompt=False)
    assert f"\n\n{expected}<|eot_id|>" in text


@pytest.mark.parametrize(
    "messages",
    [
        [],
        [{"role": "wizard", "content": "x"}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "user", "content": 5}],
        ["not a message"],
    ],
)
def test_bad_messages_raise(messages: list[Any]) -> None:
    with pytest.raises(TemplateError):
        render_chat(messages)


@pytest.mark.parametrize("seed", [0, 7, 42])
def test_generated_text_round_trips(seed: int) -> None:
    rng = random.Random(seed)
    pieces = [output_piece(rng) for _ in range(200)]
    assert tokenize("".join(pieces)) == [piece_id(p) for p in pieces]
