"""Answers recorded from a real vLLM 0.32 CPU engine (the project's tiny model, prefix caching
and ``--enable-prompt-tokens-details`` on, ``VLLM_ENABLE_RESPONSES_API_STORE=1``): one request
twice, so the second reads the 640 tokens (5 blocks of 128) the first wrote."""

from __future__ import annotations

import json

from kvgate.apis.anthropic import MessagesAdapter
from kvgate.apis.responses import ResponsesAdapter
from kvgate.middleware.framework.errors import UpstreamHTTPError
from kvgate.middleware.framework.types import Usage
from tests.unit.apis.samples import load_json, load_sse, raw


def _stream_usage(adapter: MessagesAdapter | ResponsesAdapter, name: str) -> tuple[
        Usage | None, list[str]]:
    tap = adapter.new_tap(True)
    for event in load_sse(name):
        tap.on_event(event)
    assert tap.final
    return tap.usage, tap.state_ids


def test_messages_first_turn_writes_then_second_reads() -> None:
    start = load_sse("live_vllm_messages_turn0.sse")[0]
    assert start.data["message"]["usage"] == {"input_tokens": 691, "output_tokens": 0}
    assert _stream_usage(MessagesAdapter(), "live_vllm_messages_turn0.sse") == (
        Usage(691, 8, 0, 640), [])
    assert _stream_usage(MessagesAdapter(), "live_vllm_messages_turn1.sse") == (
        Usage(691, 8, 640, 0), [])
    tap = MessagesAdapter().new_tap(False)
    tap.on_json(load_json("live_vllm_messages_turn1.json"))
    assert tap.usage == Usage(691, 8, 640, 0)


def test_responses_stream_and_json() -> None:
    usage, ids = _stream_usage(ResponsesAdapter(), "live_vllm_responses_turn1.sse")
    assert usage == Usage(692, 8, 640, 0) and len(ids) == 1 and ids[0].startswith("resp_")
    answer = load_json("live_vllm_responses_turn1.json")
    tap = ResponsesAdapter().new_tap(True)
    tap.on_json(answer)
    assert tap.usage == Usage(692, 8, 640, 0) and tap.state_ids == [answer["id"]]
    assert answer["status"] == "incomplete"  # max_output_tokens reached: still billed


def test_engine_validation_error_is_openai_shaped_and_rendered_anthropic() -> None:
    """vLLM's request validation answers /v1/messages in OpenAI's shape; rendered through the
    adapter it becomes Anthropic's, with the engine's message."""
    body = raw("live_vllm_messages_validation_error.json")
    assert set(json.loads(body)) == {"error"}
    out = json.loads(MessagesAdapter().error_body(UpstreamHTTPError(400, body)))
    assert out["type"] == "error" and out["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in out["error"]["message"]
