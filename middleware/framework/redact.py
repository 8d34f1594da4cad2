"""What unauthenticated callers may see: engine and plugin state without internal addresses.

``GET /health`` is a probe endpoint anyone who reaches the gateway can call. Engine names,
states, models and counts are fine to show; engine URLs, KV-event and replay socket addresses,
host names and anything an error message quotes about them are not (they map the private
network behind the gateway). :func:`public_view` returns a JSON-like value with

* keys in :data:`HIDDEN_KEYS` dropped, wherever they appear (``url``, ``address``, host-derived
  replica and consumer names);
* every string scrubbed of addresses: URLs (``scheme://...``), IPv4 addresses (with an optional
  port), bracketed IPv6 addresses and ``host:port`` pairs become ``<address>``.

An admin principal gets the full view (middleware/app.py). :func:`client_message` does the same
for an engine's error message before a client sees it (middleware/framework/errors.py). Pure
functions; regexes compiled once at import (constants, no work beyond that).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

#: Keys never shown without an admin key: engine URLs, socket addresses, host-derived names.
HIDDEN_KEYS = frozenset({"url", "address", "addresses", "bind", "replay", "consumer",
                         "replica", "host"})
PLACEHOLDER = "<address>"

_ADDRESS = re.compile(
    r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\",)\]]+"  # URLs: http://, tcp://, redis://user:pw@...
    r"|\[[0-9A-Fa-f:.]+\](?::\d+)?"  # [IPv6]:port
    r"|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b"  # IPv4[:port]
    r"|\b(?=[\w.-]*[A-Za-z])[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9-]+)*"
    r":\d{2,5}\b"  # host:port (the host has a letter)
)


def scrub(text: str) -> str:
    """``text`` with every address replaced by ``<address>``."""
    return _ADDRESS.sub(PLACEHOLDER, text)


#: The longest engine error message a client sees [characters]. vLLM's own messages (a context
#: length error ~250, a validation error listing a few fields ~600) stay whole; an echoed
#: prompt or a dump does not.
MAX_MESSAGE_CHARS = 1024
_TRACEBACK = "Traceback (most recent call last)"
#: Absolute file paths of two segments or more (``/opt/vllm/engine.py``, ``/models/llama``).
_PATH = re.compile(r"(?<![\w.:/-])/(?:[\w.@+-]+/)+[\w.@+-]*")
_PATH_PLACEHOLDER = "<path>"


def client_message(text: str) -> str:
    """An engine's error message as a client may see it: without a traceback (the exception
    line that ends one is kept when nothing came before it), addresses (:func:`scrub`) or file
    paths, at most :data:`MAX_MESSAGE_CHARS` characters."""
    head, marker, tail = text.partition(_TRACEBACK)
    if marker:
        lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
        text = head.strip() or (lines[-1] if lines else "")
    text = _PATH.sub(_PATH_PLACEHOLDER, scrub(text)).strip()
    if len(text) > MAX_MESSAGE_CHARS:
        text = text[:MAX_MESSAGE_CHARS - 1] + "…"
    return text


def public_view(value: object) -> object:
    """``value`` (JSON-like: mappings, lists, scalars) without hidden keys or addresses."""
    if isinstance(value, str):
        return scrub(value)
    if isinstance(value, Mapping):
        return {k: public_view(v) for k, v in value.items() if str(k) not in HIDDEN_KEYS}
    if isinstance(value, list | tuple):
        return [public_view(v) for v in value]
    return value


__all__ = ["HIDDEN_KEYS", "MAX_MESSAGE_CHARS", "client_message", "public_view", "scrub"]
