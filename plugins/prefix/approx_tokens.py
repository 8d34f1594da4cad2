"""Pseudo-tokens for approximate prefix routing without the model's tokenizer (``kvgate.tokenizers``
entry point ``approx``; used by the cache-aware default when no ``--tokenizer`` is given).

What routing needs from a prompt when it cannot see the engines' caches is not the engine's
token ids but (1) a sequence whose prefixes are shared exactly when the prompts' prefixes are,
and (2) a length close to the real token count, so that cached/uncached sizes and loads are in
about the right units. This module gives both, in microseconds and with no model files:

* :func:`render_chat` renders a chat canonically, message by message (role, name, text parts
  in order, tool calls as canonical JSON, other parts as canonical JSON), each message closed by
  a separator. A conversation that grows by appending messages renders to a string that starts
  with the previous turn's rendering, as a real chat template does.
* :func:`tokenize` packs the UTF-8 bytes four at a time into one pseudo-token (an unsigned
  32-bit integer). English text and code average about four bytes per token with BPE
  tokenizers, so counts land near the engine's (CJK text: ~1.5x higher).

Not the engine's ids: these must never be compared with KV events (the prefix producer's
states make that mistake loud). Tools in ``tools`` are not rendered (the module interface has no
room for them): two sessions whose messages agree but whose tool lists differ share a record.
"""

from __future__ import annotations

import json
import sys
from array import array
from collections.abc import Mapping, Sequence
from typing import Any

#: Read by the tokenizer plugin: these ids are not the engine's (it flags TOKEN_IDS_INEXACT, so
#: the prefix producer never matches them against KV events and says so on /health).
PSEUDO_TOKENS = "pseudo-tokens (no model tokenizer: give --tokenizer DIR)"

#: Read by the tokenizer plugin: run inline, never on its thread pool. Rendering and packing cost
#: ~1 ns per byte (a 200 KiB chat: ~0.1 ms), about one thread hop, and the hop also made the
#: worker and the event loop contend for the GIL.
INLINE = True

#: Closes a message; ASCII record separator (never produced by JSON or text normalisation).
_END = "\x1e"
#: Separates a message's header (role, name) from its content; ASCII unit separator.
_SEP = "\x1f"


def _canonical(value: object) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def _content(content: object) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        out = []
        for part in content:
            text = part.get("text") if isinstance(part, Mapping) else None
            out.append(text if isinstance(text, str) else _canonical(part))
        return "".join(out)
    return _canonical(content)


def render_message(message: Mapping[str, Any]) -> str:
    """One message: ``role[/name] SEP content [SEP tool_calls] END``."""
    head = str(message.get("role", ""))
    name = message.get("name")
    if isinstance(name, str) and name:
        head += "/" + name
    text = head + _SEP + _content(message.get("content"))
    calls = message.get("tool_calls")
    if calls:
        text += _SEP + _canonical(calls)
    return text + _END


def render_chat(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
    """The canonical rendering of a chat (the generation prompt adds nothing: a growing
    conversation's next turn starts with this turn's rendering)."""
    if type(messages) is not list and (  # a parsed body's list: no ABC check per request
            not isinstance(messages, Sequence) or isinstance(messages, str | bytes)):
        raise TypeError("messages must be a list")
    return "".join(
        render_message(m) if type(m) is dict or isinstance(m, Mapping) else _canonical(m) + _END
        for m in messages
    )


def tokenize(text: str) -> array[int]:
    """UTF-8 bytes packed four per pseudo-token (little-endian; the last one zero-padded).

    An ``array('I')``, not a list: an agent prompt is ~50k pseudo-tokens, and the prefix
    producer hashes them straight from this buffer (a list would cost ~1 ms to build and
    another to convert back)."""
    data = text.encode("utf-8", "surrogatepass")
    whole = len(data) - len(data) % 4
    packed = array("I")
    packed.frombytes(memoryview(data)[:whole])  # one copy, no padded duplicate of the text
    if whole < len(data):
        packed.frombytes(data[whole:].ljust(4, b"\x00"))
    if sys.byteorder == "big":
        packed.byteswap()
    return packed
