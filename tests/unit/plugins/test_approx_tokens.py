"""Pseudo-tokens of the default preset without a tokenizer: prefix-stable, about one per real
token, loaded through the tokenizer plugin by its entry-point name."""

from __future__ import annotations

from typing import Any

import pytest

from kvgate.middleware.framework.types import CycleState
from kvgate.plugins.common.state import TOKEN_IDS
from kvgate.plugins.prefix import approx_tokens
from kvgate.plugins.prefix.tokenizer import Tokenizer
from tests.plugin_helpers import make_plugin, prompt_of
from tests.unit.routing_load.helpers import req

SYSTEM = {"role": "system", "content": "You are a coding agent. " * 40}
TURNS: list[dict[str, Any]] = [
    {"role": "user", "content": "Fix the failing test in tests/test_io.py"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "read_file", "arguments": "{\"path\": \"tests/test_io.py\"}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "def test_read(): ..."},
    {"role": "assistant", "content": [{"type": "text", "text": "Found it: "},
                                      {"type": "text", "text": "the fixture is stale."}]},
    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:x"}}]},
]


@pytest.mark.parametrize("n", range(1, len(TURNS)))
def test_a_growing_conversation_extends_its_previous_rendering(n: int) -> None:
    before = approx_tokens.render_chat([SYSTEM, *TURNS[:n]])
    after = approx_tokens.render_chat([SYSTEM, *TURNS[: n + 1]])
    assert after.startswith(before) and len(after) > len(before)
    ids_before = approx_tokens.tokenize(before)
    ids_after = approx_tokens.tokenize(after)
    full = len(before.encode()) // 4  # the last, partial pseudo-token may change
    assert ids_after[:full] == ids_before[:full]


@pytest.mark.parametrize(("a", "b"), [
    ({"role": "user", "content": "hi"}, {"role": "system", "content": "hi"}),
    ({"role": "user", "content": "hi", "name": "x"}, {"role": "user", "content": "hi"}),
    ({"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]},
     {"role": "assistant", "content": ""}),
])
def test_different_messages_render_differently(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert approx_tokens.render_chat([a]) != approx_tokens.render_chat([b])


def test_about_one_pseudo_token_per_four_bytes() -> None:
    text = approx_tokens.render_chat([SYSTEM])
    ids = approx_tokens.tokenize(text)
    assert len(ids) == -(-len(text.encode()) // 4)
    assert all(0 <= t < 2**32 for t in ids)
    assert list(approx_tokens.tokenize("")) == []
    assert list(approx_tokens.tokenize("abcd")) == [int.from_bytes(b"abcd", "little")]


def test_not_a_list_is_refused() -> None:
    with pytest.raises(TypeError):
        approx_tokens.render_chat("hello")  # type: ignore[arg-type]


async def test_the_tokenizer_plugin_loads_it_by_name() -> None:
    plugin = make_plugin(Tokenizer, tokenizer={"kind": "module", "module": "approx"})
    await plugin.start()
    try:
        state = CycleState()
        request = req(body={"model": "m", "messages": [SYSTEM, TURNS[0]]})
        await plugin.prepare(request, state, [])
        ids = state.get(TOKEN_IDS)
        assert ids is not None
        assert list(ids) == list(approx_tokens.tokenize(approx_tokens.render_chat([SYSTEM, TURNS[0]])))
        assert request.prompt_token_estimate == len(ids)
    finally:
        await plugin.stop()


async def test_pseudo_tokens_are_flagged_inexact_but_client_token_ids_are_not() -> None:
    from kvgate.middleware.framework.types import Api
    from kvgate.plugins.common.state import TOKEN_IDS_INEXACT

    plugin = make_plugin(Tokenizer, tokenizer={"kind": "module", "module": "approx"})
    await plugin.start()
    try:
        chat = CycleState()
        await plugin.prepare(req(body={"model": "m", "messages": [SYSTEM]}), chat, [])
        assert chat.get(TOKEN_IDS_INEXACT) == approx_tokens.PSEUDO_TOKENS
        ids = CycleState()
        completion = req(body={"model": "m", "prompt": [1, 2, 3]})
        completion.api = Api.COMPLETIONS
        completion.prompt = prompt_of(Api.COMPLETIONS, completion.body)
        await plugin.prepare(completion, ids, [])
        assert ids.get(TOKEN_IDS) == (1, 2, 3) and ids.get(TOKEN_IDS_INEXACT) is None
    finally:
        await plugin.stop()


@pytest.mark.parametrize("text", ["", "a", "ab", "abc", "abcde", "é", "x" * 4097 + "€"])
def test_a_partial_last_pseudo_token_is_zero_padded(text: str) -> None:
    data = text.encode()
    padded = data + b"\x00" * (-len(data) % 4)
    expected = [int.from_bytes(padded[i:i + 4], "little") for i in range(0, len(padded), 4)]
    assert list(approx_tokens.tokenize(text)) == expected


async def test_large_bodies_are_tokenized_inline_not_on_the_pool() -> None:
    plugin = make_plugin(Tokenizer, tokenizer={"kind": "module", "module": "approx"},
                         offload_min_chars=16)
    await plugin.start()
    try:
        state = CycleState()
        request = req(body={"model": "m", "messages": [SYSTEM]})
        request.raw_body = b"x" * 100_000
        await plugin.prepare(request, state, [])
        assert state.get(TOKEN_IDS) is not None
        assert plugin.stats.tokenized == 1 and plugin.stats.offloaded == 0
    finally:
        await plugin.stop()
