"""The simulator's agent APIs through the real ``anthropic`` and ``openai`` SDKs (and httpx for
raw shapes): Messages, count_tokens, Responses (store, continuation, retrieve, cancel), errors
in each route's shape, and cached tokens rising over a multi-turn session."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from kvgate.engines.sim.core.config import SimConfig
from kvgate.engines.sim.core.tokenizer import chat_token_ids, tokenize
from kvgate.engines.sim.http.messages_api import to_chat_messages
from kvgate.engines.sim.http.responses_api import BOS_ID
from kvgate.engines.sim.testing import RunningSim, serve_sim

from .helpers import long_text

FAST = SimConfig(time_scale=0)
MODEL = "sim-model"
TOOLS: list[Any] = [{"name": "get_weather", "description": "Weather of a city",
                     "input_schema": {"type": "object",
                                      "properties": {"city": {"type": "string"}}}}]


@pytest.fixture
async def sim() -> AsyncIterator[RunningSim]:
    async with serve_sim(FAST) as running:
        yield running


def _anthropic(sim: RunningSim) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=sim.url, api_key="x", max_retries=0)


def _openai(sim: RunningSim) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=sim.url + "/v1", api_key="x", max_retries=0)


async def _create(client: anthropic.AsyncAnthropic, stream: bool, **kw: Any) -> Any:
    if not stream:
        return await client.messages.create(**kw)
    async with client.messages.stream(**kw) as s:
        return await s.get_final_message()


# ---- Anthropic Messages -------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_messages_session_cached_tokens_rise(sim: RunningSim, stream: bool) -> None:
    """Three turns, each repeating the conversation so far: the cache read grows, and
    input + read + write is the whole rendered prompt."""
    client = _anthropic(sim)
    system, history = long_text(300, seed=1), []
    reads = []
    for turn in range(3):
        history.append({"role": "user", "content": long_text(60, seed=10 + turn)})
        msg = await _create(client, stream, model=MODEL, max_tokens=12, system=system,
                            messages=history)
        u = msg.usage
        prompt = len(chat_token_ids(to_chat_messages({"system": system, "messages": history})))
        assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens == \
            prompt
        assert u.output_tokens == 12 and msg.stop_reason == "max_tokens"
        assert msg.id.startswith("chatcmpl-") and msg.content[0].type == "text"
        reads.append(u.cache_read_input_tokens)
        history.append({"role": "assistant", "content": msg.content[0].text})
    assert reads[0] == 0 and reads[0] < reads[1] < reads[2]
    assert all(r % FAST.block_size == 0 for r in reads)


async def test_messages_stream_events(sim: RunningSim) -> None:
    """vLLM's event names and order; message_start reports the whole prompt, no cache keys."""
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 3, "stream": True,
                            "messages": [{"role": "user", "content": "Hello there"}]}
    async with httpx.AsyncClient(base_url=sim.url) as http:
        resp = await http.post("/v1/messages", json=body)
    names = [line.removeprefix("event: ") for line in resp.text.splitlines()
             if line.startswith("event: ")]
    assert names == ["message_start", "content_block_start", *["content_block_delta"] * 3,
                     "content_block_stop", "message_delta", "message_stop"]
    prompt = len(chat_token_ids(body["messages"]))
    assert f'"usage":{{"input_tokens":{prompt},"output_tokens":0}}' in resp.text
    assert '"cache_read_input_tokens":0' in resp.text.split("event: message_delta")[1]


async def test_count_tokens_and_tools(sim: RunningSim) -> None:
    client = _anthropic(sim)
    messages: list[Any] = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                           "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": "sunny"}]}]
    counted = await client.messages.count_tokens(model=MODEL, messages=messages, tools=TOOLS)
    msg = await client.messages.create(model=MODEL, max_tokens=4, messages=messages,
                                       tools=TOOLS)
    assert counted.input_tokens == msg.usage.input_tokens + \
        (msg.usage.cache_creation_input_tokens or 0)
    assert counted.model_extra is not None and "context_management" in counted.model_extra
    assert to_chat_messages({"messages": messages})[1:] == [
        {"role": "assistant", "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}]


ANTHROPIC_ERRORS: list[tuple[str, Any, int, str]] = [
    ("malformed", b"{not json", 400, "openai:Bad Request"),
    ("missing max_tokens", {"model": MODEL, "messages": []}, 400, "openai:Bad Request"),
    ("unknown model", {"model": "nope", "max_tokens": 3, "messages": []}, 404,
     "anthropic:NotFoundError"),
    ("too many tokens", {"model": MODEL, "max_tokens": 10**6,
                         "messages": [{"role": "user", "content": "x"}]}, 400,
     "anthropic:BadRequestError"),
    ("oversized", b"{" + b" " * (17 << 20) + b"}", 413, "anthropic:RequestTooLargeError"),
]


@pytest.mark.parametrize(("name", "body", "status", "shape"), ANTHROPIC_ERRORS,
                         ids=[e[0] for e in ANTHROPIC_ERRORS])
async def test_messages_errors(sim: RunningSim, name: str, body: Any, status: int,
                              shape: str) -> None:
    content = body if isinstance(body, bytes) else httpx.Request("POST", "/", json=body).content
    async with httpx.AsyncClient(base_url=sim.url) as http:
        resp = await http.post("/v1/messages", content=content,
                               headers={"content-type": "application/json"})
    assert resp.status_code == status
    kind, type_ = shape.split(":")
    payload = resp.json()
    if kind == "anthropic":
        assert payload["type"] == "error" and payload["error"]["type"] == type_
    else:
        assert payload["error"]["type"] == type_ and payload["error"]["code"] == 400


async def test_messages_faults_and_tools_off() -> None:
    """A failing engine answers in the Anthropic shape (the SDK raises its typed error);
    tools without auto tool choice: vLLM's 400; a stream cut mid-way raises in the SDK."""
    async with serve_sim(SimConfig(time_scale=0, enable_auto_tool_choice=False)) as sim:
        client = _anthropic(sim)
        msgs: Any = [{"role": "user", "content": "hi"}]
        sim.faults.fail_next, sim.faults.status = 1, 503
        with pytest.raises(anthropic.InternalServerError):
            await client.messages.create(model=MODEL, max_tokens=3, messages=msgs)
        with pytest.raises(anthropic.BadRequestError, match="enable-auto-tool-choice"):
            await client.messages.create(model=MODEL, max_tokens=3, messages=msgs, tools=TOOLS)
        sim.faults.drop_after_chunks, sim.faults.drop_streams = 3, 1
        with pytest.raises(Exception, match=r"incomplete|peer closed"):
            await _create(client, True, model=MODEL, max_tokens=20, messages=msgs)


# ---- OpenAI Responses ---------------------------------------------------------------------


async def _respond(client: openai.AsyncOpenAI, stream: bool, **kw: Any) -> Any:
    if not stream:
        return await client.responses.create(**kw)
    events = [e async for e in await client.responses.create(stream=True, **kw)]
    assert [e.type for e in events[:4]] == ["response.created", "response.in_progress",
                                            "response.output_item.added",
                                            "response.content_part.added"]
    assert [e.type for e in events[-4:]] == ["response.output_text.done",
                                             "response.content_part.done",
                                             "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events[-1].response


@pytest.mark.parametrize("stream", [False, True])
async def test_responses_previous_response_id_session(sim: RunningSim, stream: bool) -> None:
    """A continued conversation (instructions repeated) reads more of the cache each turn;
    each response is retrievable and echoes its predecessor."""
    client = _openai(sim)
    instructions, prev, cached = long_text(300, seed=2), None, []
    for turn in range(3):
        resp = await _respond(client, stream, model=MODEL, instructions=instructions,
                              input=long_text(50, seed=20 + turn), max_output_tokens=10,
                              previous_response_id=prev)
        assert resp.previous_response_id == prev and resp.status == "incomplete"
        assert resp.usage.output_tokens == 10
        cached.append(resp.usage.input_tokens_details.cached_tokens)
        got = await client.responses.retrieve(resp.id)
        assert got.id == resp.id and got.output_text == resp.output_text
        prev = resp.id
    assert cached[0] == 0 and cached[0] < cached[1] < cached[2]


async def test_responses_prompt_has_vllm_double_bos(sim: RunningSim) -> None:
    resp = await _openai(sim).responses.create(model=MODEL, input="Hello there",
                                               max_output_tokens=2)
    ids = [BOS_ID, *chat_token_ids([{"role": "user", "content": "Hello there"}])]
    assert resp.usage is not None and resp.usage.input_tokens == len(ids)
    async with httpx.AsyncClient(base_url=sim.url) as http:
        rendered = (await http.post("/v1/responses/render", json={
            "model": MODEL, "input": "Hello there"})).json()
    assert rendered["token_ids"] == ids


RESPONSES_ERRORS: list[tuple[str, str, str, Any, int, str]] = [
    ("get unknown", "GET", "/v1/responses/resp_nope", None, 404, "invalid_request_error"),
    ("cancel unknown", "POST", "/v1/responses/resp_nope/cancel", None, 404,
     "invalid_request_error"),
    ("previous unknown", "POST", "/v1/responses", {"input": "x", "previous_response_id": "r"},
     404, "invalid_request_error"),
    ("missing input", "POST", "/v1/responses", {"model": MODEL}, 400, "Bad Request"),
    ("malformed", "POST", "/v1/responses", b"{x", 400, "Bad Request"),
    ("unknown model", "POST", "/v1/responses", {"model": "m", "input": "x"}, 404,
     "NotFoundError"),
    ("too many tokens", "POST", "/v1/responses", {"input": "x", "max_output_tokens": 10**6},
     400, "BadRequestError"),
]


@pytest.mark.parametrize(("name", "method", "path", "body", "status", "kind"), RESPONSES_ERRORS,
                         ids=[e[0] for e in RESPONSES_ERRORS])
async def test_responses_errors(sim: RunningSim, name: str, method: str, path: str, body: Any,
                                status: int, kind: str) -> None:
    content = body if isinstance(body, bytes) or body is None else \
        httpx.Request("POST", "/", json=body).content
    async with httpx.AsyncClient(base_url=sim.url) as http:
        resp = await http.request(method, path, content=content)
    assert resp.status_code == status
    assert resp.json()["error"]["type"] == kind


async def test_responses_store_cancel_background(sim: RunningSim) -> None:
    client = _openai(sim)
    done = await client.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="synchronous"):
        await client.responses.cancel(done.id)
    unstored = await client.responses.create(model=MODEL, input="hi", max_output_tokens=2,
                                             store=False)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(unstored.id)


async def test_responses_background_cancel() -> None:
    """A background response is queued, then cancelled while it runs (real step times)."""
    async with serve_sim(SimConfig(natural_output_len=(3000, 3000))) as sim:
        client = _openai(sim)
        queued = await client.responses.create(model=MODEL, input="hi", max_output_tokens=3000,
                                               background=True)
        assert queued.status == "queued" and queued.usage is None
        cancelled = await client.responses.cancel(queued.id)
        assert cancelled.status == "cancelled"
        assert (await client.responses.retrieve(queued.id)).status == "cancelled"
        assert sim.engine.num_running == 0


async def test_responses_store_off_like_vllm_default() -> None:
    async with serve_sim(SimConfig(time_scale=0, responses_store=False)) as sim:
        client = _openai(sim)
        first = await client.responses.create(model=MODEL, input="hi", max_output_tokens=2)
        with pytest.raises(openai.NotFoundError):
            await client.responses.create(model=MODEL, input="more", max_output_tokens=2,
                                          previous_response_id=first.id)
        with pytest.raises(openai.BadRequestError, match="VLLM_ENABLE_RESPONSES_API_STORE"):
            await client.responses.create(model=MODEL, input="x", background=True)


# ---- token utilities, embeddings, render --------------------------------------------------


async def test_tokenize_detokenize_render(sim: RunningSim) -> None:
    msgs = [{"role": "user", "content": "Hello there"}]
    async with httpx.AsyncClient(base_url=sim.url) as http:
        tok = (await http.post("/tokenize", json={"model": MODEL, "messages": msgs,
                                                  "return_token_strs": True})).json()
        plain = (await http.post("/tokenize", json={"prompt": "Hello there"})).json()
        detok = (await http.post("/detokenize", json={"tokens": plain["tokens"]})).json()
        chat = (await http.post("/v1/chat/completions/render", json={"messages": msgs})).json()
        anth = (await http.post("/v1/messages/render", json={
            "model": MODEL, "max_tokens": 5, "messages": msgs})).json()
    ids = chat_token_ids(msgs)
    assert tok == {"count": len(ids), "max_model_len": FAST.effective_max_model_len,
                   "tokens": ids, "token_strs": tok["token_strs"]}
    assert tok["token_strs"][:2] == ["<|begin_of_text|>", "<|start_header_id|>"]
    assert plain["tokens"] == [BOS_ID, *tokenize("Hello there")]
    assert detok["prompt"].startswith("<|begin_of_text|><tok_")
    assert chat["token_ids"] == anth["token_ids"] == ids
    assert anth["sampling_params"]["max_tokens"] == 5


async def test_runners_and_scale_out() -> None:
    """Embeddings only on a pooling runner (which serves no generation); render off: 403."""
    async with serve_sim(SimConfig(time_scale=0, runner="pooling")) as sim:
        client = _openai(sim)
        emb = await client.embeddings.create(model=MODEL, input=["Hello there", "again"])
        assert [d.index for d in emb.data] == [0, 1] and len(emb.data[0].embedding) == 256
        assert emb.usage.prompt_tokens == 2 + len(tokenize("Hello there")) + len(tokenize("again"))
        async with httpx.AsyncClient(base_url=sim.url) as http:
            chat = await http.post("/v1/chat/completions", json={"messages": []})
        assert (chat.status_code, chat.json()) == (404, {"detail": "Not Found"})
    async with serve_sim(SimConfig(time_scale=0, enable_scale_out=False)) as sim:
        async with httpx.AsyncClient(base_url=sim.url) as http:
            emb_resp = await http.post("/v1/embeddings", json={"input": "x"})
            render = await http.post("/v1/messages/render", json={})
        assert emb_resp.status_code == 404
        assert render.status_code == 403
        assert render.json()["error"]["type"] == "PermissionDeniedError"


async def test_messages_prefill_decode_nixl() -> None:
    """A prefill-role engine answers a NIXL Messages request with vLLM's kv_transfer_params
    after one token; the decode engine given them reports the transferred KV as cache read."""
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 6,
                            "messages": [{"role": "user", "content": long_text(200, seed=5)}]}
    async with serve_sim(SimConfig(time_scale=0, role="prefill")) as prefill, \
            serve_sim(SimConfig(time_scale=0, role="decode")) as decode, \
            httpx.AsyncClient(timeout=30) as http:
        first = (await http.post(prefill.url + "/v1/messages", json={
            **body, "kv_transfer_params": {"do_remote_decode": True}})).json()
        params = first["kv_transfer_params"]
        assert params["do_remote_prefill"] is True and first["usage"]["output_tokens"] == 1
        second = (await http.post(decode.url + "/v1/messages", json={
            **body, "kv_transfer_params": params})).json()
    prompt = params["remote_num_tokens"]
    usage = second["usage"]
    assert usage["output_tokens"] == 6 and "kv_transfer_params" not in second
    assert usage["cache_read_input_tokens"] == prompt - 1
