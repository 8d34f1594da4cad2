"""One vLLM request's usage in its three client shapes (chat, Messages, Responses) reads as the
same :class:`Usage` through each adapter's tap, JSON and stream alike, so the same engine bills
the same whichever API the client used (cache writes included)."""

from __future__ import annotations

from typing import Any

import pytest

from kvgate.apis.anthropic import MessagesAdapter
from kvgate.apis.openai import ChatCompletions, Completions
from kvgate.apis.responses import ResponsesAdapter
from kvgate.engines.vllm import VllmAdapter
from kvgate.middleware.framework.api import ApiAdapter, SseEvent
from kvgate.middleware.framework.types import Usage

#: The docs/apis.md golden row "vLLM 0.32 chat / Messages / Responses (same request)".
CHAT_USAGE = {"prompt_tokens": 1200, "completion_tokens": 7, "total_tokens": 1207,
              "prompt_tokens_details": {"cached_tokens": 1024, "created_cache_tokens": 160}}
MESSAGES_USAGE = {"input_tokens": 16, "cache_read_input_tokens": 1024,
                  "cache_creation_input_tokens": 160, "output_tokens": 7}
RESPONSES_USAGE = {"input_tokens": 1200, "output_tokens": 7, "total_tokens": 1207,
                   "input_tokens_details": {"cached_tokens": 1024, "cache_write_tokens": 160},
                   "output_tokens_details": {"reasoning_tokens": 0}}
WANT = Usage(prompt_tokens=1200, completion_tokens=7, cached_tokens=1024, cache_write_tokens=160)

CHAT_ANSWER = {"id": "chatcmpl-1", "object": "chat.completion", "choices": [],
               "usage": CHAT_USAGE}
CHAT_CHUNK = SseEvent(None, {"id": "chatcmpl-1", "object": "chat.completion.chunk",
                             "choices": [], "usage": CHAT_USAGE})
MESSAGES_ANSWER = {"id": "msg_1", "type": "message", "role": "assistant", "content": [],
                   "usage": MESSAGES_USAGE}
MESSAGES_DELTA = SseEvent("message_delta", {"type": "message_delta", "delta": {},
                                            "usage": MESSAGES_USAGE})
RESPONSE = {"id": "resp_1", "object": "response", "status": "completed", "output": [],
            "usage": RESPONSES_USAGE}
RESPONSES_DONE = SseEvent("response.completed", {"type": "response.completed",
                                                 "response": RESPONSE})

CASES: list[tuple[str, ApiAdapter, dict[str, Any], SseEvent]] = [
    ("chat", ChatCompletions(), CHAT_ANSWER, CHAT_CHUNK),
    ("completions", Completions(), CHAT_ANSWER, CHAT_CHUNK),
    ("messages", MessagesAdapter(), MESSAGES_ANSWER, MESSAGES_DELTA),
    ("responses", ResponsesAdapter(), RESPONSE, RESPONSES_DONE),
]


@pytest.mark.parametrize(("api", "adapter", "answer", "event"), CASES,
                         ids=[c[0] for c in CASES])
def test_same_usage_through_every_api(api: str, adapter: ApiAdapter, answer: dict[str, Any],
                                      event: SseEvent) -> None:
    tap = adapter.new_tap(True)
    tap.on_json(answer)
    assert tap.usage == WANT
    tap = adapter.new_tap(True)
    tap.on_event(event)
    assert tap.final and tap.usage == WANT


def test_engine_adapter_reads_chat_cache_writes() -> None:
    assert VllmAdapter().extract_usage(CHAT_ANSWER) == WANT
