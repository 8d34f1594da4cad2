"""The prompt each adapter gives routing equals what vLLM 0.32 renders for the same body.

``prompt_golden.json`` holds vLLM's own conversion of every body in ``prompt_cases.json``
(``AnthropicServingMessages.to_chat_completion_request`` with and without inline-system merging,
and ``construct_input_messages`` / ``construct_tool_dicts`` for Responses), recorded with the
engine venv by ``data/record_vllm_samples.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvgate.apis import anthropic, responses
from kvgate.middleware.framework.api import ChatPrompt
from tests.unit.apis.samples import cases, golden

MESSAGES = sorted(cases()["messages"])
RESPONSES = sorted(cases()["responses"])


def _text_parts(content: Any) -> Any:
    if not isinstance(content, list):
        return content
    return [{"type": "text", "text": p["text"]} if p.get("type") in ("input_text", "output_text")
            else p for p in content]


def _rendering_view(message: dict[str, Any]) -> dict[str, Any]:
    """vLLM passes a user/system/developer item whole; the adapter keeps role and content,
    with input_text parts as text parts (equivalent for vLLM's content parser)."""
    if message.get("role") in ("user", "system", "developer") and "type" in message:
        return {"role": message["role"], "content": _text_parts(message["content"])}
    return {**message, "content": _text_parts(message["content"])} if "content" in message else (
        message)


def _check_render_flags(prompt: ChatPrompt, want: dict[str, Any]) -> None:
    """vLLM's ``chat_template_kwargs`` = the adapter's ``template_kwargs`` plus the
    generation-prompt flags, which the adapter carries as ChatPrompt fields."""
    kwargs = dict(want)
    assert prompt.add_generation_prompt is kwargs.pop("add_generation_prompt")
    assert prompt.continue_final_message is kwargs.pop("continue_final_message")
    assert dict(prompt.template_kwargs) == kwargs


@pytest.mark.parametrize("merge", [False, True], ids=["inline", "merged"])
@pytest.mark.parametrize("case", MESSAGES)
def test_messages_prompt_is_vllms(case: str, merge: bool) -> None:
    body = cases()["messages"][case]
    want = golden()["messages"][case]["merged" if merge else "inline"]
    adapter = anthropic.MessagesAdapter(merge_inline_system=merge)
    prompt = adapter.parse(body, {}).prompt
    assert isinstance(prompt, ChatPrompt)
    assert [dict(m) for m in prompt.messages] == want["messages"]
    assert (None if prompt.tools is None else [dict(t) for t in prompt.tools]) == want["tools"]
    _check_render_flags(prompt, want["template_kwargs"])


@pytest.mark.parametrize("case", RESPONSES)
def test_responses_prompt_is_vllms(case: str) -> None:
    body = cases()["responses"][case]
    want = golden()["responses"][case]
    prompt = responses.ResponsesAdapter().parse(body, {}).prompt
    assert isinstance(prompt, ChatPrompt)
    assert [dict(m) for m in prompt.messages] == [_rendering_view(m) for m in want["messages"]]
    assert (None if prompt.tools is None else [dict(t) for t in prompt.tools]) == want["tools"]
    _check_render_flags(prompt, want["template_kwargs"])


def test_count_tokens_renders_like_messages_but_is_not_routed_on_it() -> None:
    body = dict(cases()["messages"]["tool-use-round-trip"])
    del body["max_tokens"]
    parsed = anthropic.CountTokensAdapter().parse(body, {})
    assert parsed.prompt is None and parsed.prompt_token_estimate == 0
    assert anthropic.chat_prompt(body).messages == golden()["messages"][
        "tool-use-round-trip"]["inline"]["messages"]
