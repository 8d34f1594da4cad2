"""A deterministic text → token-id tokenizer and a Llama-3-style chat template.

Pure functions with no state, so that the gateway can compute the very token ids the simulator
computes (for prefix hashing) by importing this module.

Algorithm: the text is first split on the special-token strings (each maps to a fixed id below
:data:`NUM_SPECIAL`); every other stretch is cut by :data:`_PIECE` into pieces — up to six
letters with an optional leading space, up to three digits, one punctuation character, or a run
of whitespace — and each piece is hashed (CRC-32 of its UTF-8 bytes, stable across processes
and platforms) into :data:`VOCAB_SIZE` regular ids. English comes out at roughly 4 characters
per token, like real BPE vocabularies. Collisions between pieces are harmless: ids only need to
be deterministic.

Generated text uses pseudo-words (:func:`output_piece`) that are single pieces, so re-tokenizing
a completion gives back exactly the generated ids — multi-turn conversations then hit the prefix
cache the way they do on a real engine.
"""

from __future__ import annotations

import random
import re
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

#: Special tokens of the chat template, with their ids.
SPECIAL_TOKENS: Mapping[str, int] = {
    "<|begin_of_text|>": 0,
    "<|end_of_text|>": 1,
    "<|start_header_id|>": 2,
    "<|end_header_id|>": 3,
    "<|eot_id|>": 4,
}
#: Ids below this are special tokens; regular pieces hash into [NUM_SPECIAL, VOCAB_TOTAL).
NUM_SPECIAL = 16
#: Regular pieces (a Llama-2-sized vocabulary).
VOCAB_SIZE = 32_000
#: Every valid token id is below this.
VOCAB_TOTAL = NUM_SPECIAL + VOCAB_SIZE

_SPECIAL_SPLIT = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL_TOKENS) + ")")
_PIECE = re.compile(r" ?[^\W\d_]{1,6}| ?\d{1,3}| ?[^\w\s]|_|\s+")
_CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


class TemplateError(ValueError):
    """A chat message the template cannot render (the HTTP layer answers 400)."""


def piece_id(piece: str) -> int:
    """The token id of one regular piece."""
    return NUM_SPECIAL + zlib.crc32(piece.encode("utf-8")) % VOCAB_SIZE


def split_pieces(text: str) -> list[str]:
    """The regular pieces of a text without special tokens (they concatenate back to it)."""
    return list(_PIECE.findall(text))


def tokenize(text: str) -> list[int]:
    """Token ids of ``text``; special-token strings become their special ids."""
    ids: list[int] = []
    for i, part in enumerate(_SPECIAL_SPLIT.split(text)):
        if i % 2:
            ids.append(SPECIAL_TOKENS[part])
        elif part:
            ids.extend(piece_id(p) for p in _PIECE.findall(part))
    return ids


def _content_text(content: Any, index: int) -> str:
    """A message's ``content``: a string, ``None``, or a list of ``{"type": "text"}`` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise TemplateError(f"messages[{index}].content: only text parts are supported")
            text = part.get("text")
            if not isinstance(text, str):
                raise TemplateError(f"messages[{index}].content: a text part needs a string")
            texts.append(text)
        return "".join(texts)
    raise TemplateError(f"messages[{index}].content must be a string or a list of parts")


def render_chat(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
    """Llama-3-style chat text::

        <|begin_of_text|>(<|start_header_id|>{role}<|end_header_id|>\\n\\n{content}<|eot_id|>)*
        [<|start_header_id|>assistant<|end_header_id|>\\n\\n]

    Raises :class:`TemplateError` for an empty list, an unknown role or non-text content.
    """
    if not messages:
        raise TemplateError("messages must not be empty")
    out = ["<|begin_of_text|>"]
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise TemplateError(f"messages[{i}] must be an object")
        role = msg.get("role")
        if role not in _CHAT_ROLES:
            raise TemplateError(f"messages[{i}].role must be one of {sorted(_CHAT_ROLES)}")
        text = _content_text(msg.get("content"), i)
        out.append(f"<|start_header_id|>{role}<|end_header_id|>\n\n{text}<|eot_id|>")
    if add_generation_prompt:
        out.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return "".join(out)


def chat_token_ids(
    messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
) -> list[int]:
    """Token ids of a chat request's prompt: :func:`render_chat` then :func:`tokenize`."""
    return tokenize(render_chat(messages, add_generation_prompt))


def output_piece(rng: random.Random) -> str:
    """One generated token's text: a space and a pseudo-word of one to three syllables.

    At most six letters, so :func:`tokenize` reads it back as exactly one piece.
    """
    syllables = rng.choice((1, 2, 2, 3))
    letters = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(syllables))
    return " " + letters
