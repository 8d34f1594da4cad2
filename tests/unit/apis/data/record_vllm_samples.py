# mypy: ignore-errors
"""Record the JSON answers and SSE streams vLLM 0.32 sends for Messages and Responses.

Run with the ENGINE venv's python (it imports vLLM), from the repository root::

    ~/.cache/kvgate/engine-venv/bin/python tests/unit/apis/data/record_vllm_samples.py

It drives vLLM's own converters (``AnthropicServingMessages.messages_full_converter`` /
``message_stream_converter`` fed with chat chunks shaped like ``OpenAIServingChat`` emits with
``include_usage`` + ``continuous_usage_stats``, which is what serving.py:683 asks for) and
serialises vLLM's own Responses models the way responses/api_router.py does, so the samples
are byte-for-byte what the engine sends. Output: ``*.json`` / ``*.sse`` next to this file.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from vllm import SamplingParams
from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse
from vllm.entrypoints.openai.responses.protocol import (
    InputTokensDetails,
    OutputTokensDetails,
    ResponseCompletedEvent,
    ResponseCreatedEvent,
    ResponseInProgressEvent,
    ResponsesRequest,
    ResponsesResponse,
    ResponseUsage,
)

OUT = Path(__file__).parent
PROMPT, CACHED, CREATED, OUTPUT = 1200, 1024, 160, 7


def _usage(details: bool, completion: int = OUTPUT, prompt: int = PROMPT) -> dict:
    usage = {"prompt_tokens": prompt, "completion_tokens": completion,
             "total_tokens": prompt + completion}
    if details:
        usage["prompt_tokens_details"] = {"cached_tokens": CACHED,
                                          "created_cache_tokens": CREATED}
    return usage


def _chunk(delta: dict, finish: str | None = None, usage: dict | None = None,
           choices: bool = True) -> str:
    body = {"id": "chatcmpl-abc", "object": "chat.completion.chunk", "created": 1,
            "model": "m", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]
            if choices else []}
    if usage is not None:
        body["usage"] = usage
    return f"data: {json.dumps(body)}\n\n"


def _text_chunks(details: bool) -> list[str]:
    return [
        _chunk({"role": "assistant", "content": ""}, usage=_usage(False, 0)),
        _chunk({"content": "Hello"}, usage=_usage(False, 1)),
        _chunk({"content": " world"}, finish="stop", usage=_usage(False, OUTPUT)),
        _chunk({}, usage=_usage(details), choices=False),
        "data: [DONE]\n\n",
    ]


def _tool_chunks() -> list[str]:
    call = {"index": 0, "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": ""}}
    args = {"index": 0, "function": {"arguments": '{"city": "Paris"}'}}
    return [
        _chunk({"role": "assistant", "content": ""}, usage=_usage(False, 0)),
        _chunk({"tool_calls": [call]}, usage=_usage(False, 3)),
        _chunk({"tool_calls": [args]}, finish="tool_calls", usage=_usage(False, OUTPUT)),
        _chunk({}, usage=_usage(True), choices=False),
        "data: [DONE]\n\n",
    ]


async def _stream(chunks: list[str]) -> str:
    async def gen():
        for c in chunks:
            yield c
    # message_stream_converter uses no instance state.
    return "".join([e async for e in AnthropicServingMessages.message_stream_converter(None, gen())])


def _messages_json(details: bool) -> dict:
    chat = ChatCompletionResponse.model_validate({
        "id": "chatcmpl-abc", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello world"},
                     "finish_reason": "stop"}],
        "usage": _usage(details)})
    return AnthropicServingMessages.messages_full_converter(None, chat).model_dump(
        exclude_none=True)


def _responses_usage() -> ResponseUsage:
    return ResponseUsage(
        input_tokens=PROMPT, output_tokens=OUTPUT, total_tokens=PROMPT + OUTPUT,
        input_tokens_details=InputTokensDetails(
            cached_tokens=CACHED, cache_write_tokens=CREATED,
            input_tokens_per_turn=[PROMPT], cached_tokens_per_turn=[CACHED]),
        output_tokens_details=OutputTokensDetails(reasoning_tokens=0))


def _response(status: str, usage: ResponseUsage | None) -> ResponsesResponse:
    request = ResponsesRequest(model="m", input="Hi", request_id="resp_abc123")
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=16)
    output = [] if usage is None else [{
        "id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
        "content": [{"type": "output_text", "text": "Hello world", "annotations": []}]}]
    return ResponsesResponse.from_request(request, params, model_name="m", created_time=1,
                                          output=output, status=status, usage=usage)


def _responses_stream() -> str:
    start = _response("in_progress", None).model_dump(mode="json", by_alias=True)
    events = [ResponseCreatedEvent(type="response.created", sequence_number=0, response=start),
              ResponseInProgressEvent(type="response.in_progress", sequence_number=1,
                                      response=start),
              ResponseCompletedEvent(type="response.completed", sequence_number=2,
                                     response=_response("completed", _responses_usage()))]
    # responses/api_router.py:41-44
    return "".join(f"event: {e.type}\ndata: {e.model_dump_json(indent=None, by_alias=True)}\n\n"
                   for e in events)


def _jsonable(value):
    return json.loads(json.dumps(value, default=lambda o: o.model_dump(mode="json")))


def _messages_golden(body: dict) -> dict:
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest

    out = {}
    for merge in (False, True):
        chat = AnthropicServingMessages.to_chat_completion_request(
            AnthropicMessagesRequest.model_validate(body), merge_inline_system=merge)
        # online_renderer.py:287: the template sees tool.model_dump() of each tool.
        tools = None if chat.tools is None else [t.model_dump() for t in chat.tools]
        params = chat.build_chat_params(None, "auto")
        out["merged" if merge else "inline"] = {"messages": _jsonable(chat.messages),
                                                "tools": tools,
                                                "template_kwargs": params.chat_template_kwargs}
    return out


def _responses_golden(body: dict) -> dict:
    from vllm.entrypoints.openai.responses.utils import (
        construct_input_messages,
        construct_tool_dicts,
    )

    request = ResponsesRequest.model_validate(body)
    messages = construct_input_messages(request_instructions=request.instructions,
                                        request_input=request.input)
    return {"messages": _jsonable(messages),
            "tools": construct_tool_dicts(request.tools, request.tool_choice),
            "template_kwargs": request.build_chat_params(None, "auto").chat_template_kwargs}


def _prompt_golden() -> None:
    cases = json.loads((OUT / "prompt_cases.json").read_text())
    golden = {"messages": {k: _messages_golden(v) for k, v in cases["messages"].items()},
              "responses": {k: _responses_golden(v) for k, v in cases["responses"].items()}}
    (OUT / "prompt_golden.json").write_text(json.dumps(golden, indent=1, ensure_ascii=False)
                                            + "\n")


def main() -> None:
    _prompt_golden()
    (OUT / "vllm_messages.json").write_text(json.dumps(_messages_json(True), indent=1) + "\n")
    (OUT / "vllm_messages_no_details.json").write_text(
        json.dumps(_messages_json(False), indent=1) + "\n")
    (OUT / "vllm_messages_text.sse").write_text(asyncio.run(_stream(_text_chunks(True))))
    (OUT / "vllm_messages_no_details.sse").write_text(asyncio.run(_stream(_text_chunks(False))))
    (OUT / "vllm_messages_tool.sse").write_text(asyncio.run(_stream(_tool_chunks())))
    completed = _response("completed", _responses_usage())
    (OUT / "vllm_responses.json").write_text(
        json.dumps(completed.model_dump(mode="json", by_alias=True), indent=1) + "\n")
    (OUT / "vllm_responses.sse").write_text(_responses_stream())


if __name__ == "__main__":
    main()
