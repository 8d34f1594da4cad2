"""The agent APIs end to end: the real ``anthropic`` and ``openai`` SDKs, unchanged, through
``kvgate serve --engine A --engine B`` (billing on) in front of two real vLLM CPU engines.

The engines run like agent deployments run them: ``--enable-auto-tool-choice
--tool-call-parser pythonic`` (Claude Code always sends tools; ``llama3_json`` refuses the tiny
model's tokenizer, which has no ``<|python_tag|>``) and ``VLLM_ENABLE_RESPONSES_API_STORE=1``
(without it vLLM ignores ``store`` and every ``previous_response_id`` is a 404).

* A multi-turn session on each API: cached tokens rise turn over turn, every turn lands on the
  engine holding the prefix (``x-kvgate-engine``), and the client's usage, the ledger row and
  the JSONL export agree, billed with the cached discount. Anthropic's ``input_tokens`` excludes
  cache reads and writes: the ledger's prompt is their sum.
* Tools and ``count_tokens`` (the tiny model's template ignores tools: the count is the prompt).
* Errors in each API's own shape: malformed JSON, missing fields, unknown model, oversized body,
  then (killing the engines, last) an engine dying mid-stream and no healthy engine.

Responses continue only when ``instructions`` are sent again: vLLM does not carry them over
(docs/simulator.md, "agent APIs: what the real engine answers").
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from kvgate.engines.local.launcher import (
    LocalEngine,
    engine_args,
    engine_env,
    free_port,
    stop,
    wait_healthy,
)
from kvgate.engines.local.model import SERVED_NAME
from kvgate.engines.local.paths import kvgate_home
from kvgate.pricing.records import LedgerRecord
from tests.e2e.conftest import KVGATE
from tests.integration.billing_helpers import (
    Keys,
    expected_cost,
    final_ledger_rows,
    write_keys,
)

pytestmark = pytest.mark.e2e
BLOCK = 128  # vLLM's CPU KV block size
TURNS = (False, True, False, True)  # stream?
AGENT_ARGS = ["--enable-auto-tool-choice", "--tool-call-parser", "pythonic", "--enable-scale-out"]
TOOLS: list[Any] = [{"name": "get_weather", "description": "Weather of a city",
                     "input_schema": {"type": "object",
                                      "properties": {"city": {"type": "string"}}}}]


def _code(seed: int, lines: int) -> str:
    """Code-like text (the tiny tokenizer was trained on Python): ~20 tokens a line."""
    return "\n".join(f"def step_{seed}_{i}(value): return helper_{i % 7}(value, {seed * i})"
                     for i in range(lines))


def _spawn(model: Path, name: str, core: int) -> LocalEngine:
    port = free_port()
    logs = kvgate_home() / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{name}-{port}.log"
    env = {**engine_env(core, None), "VLLM_ENABLE_RESPONSES_API_STORE": "1"}
    with log.open("wb") as out:
        proc = subprocess.Popen([*engine_args(model, name, port, None, None), *AGENT_ARGS],
                                stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    return LocalEngine(name, port, proc.pid, str(log), time.monotonic())


@pytest.fixture(scope="module")
def agent_fleet(tiny_model: Path) -> Iterator[list[LocalEngine]]:
    cores = len(os.sched_getaffinity(0))
    engines = [_spawn(tiny_model, f"agent-{i}", i % cores) for i in range(2)]
    try:
        wait_healthy(engines)
        yield engines
    finally:
        for engine in engines:
            stop(engine)


@contextlib.contextmanager
def _serve(engine_urls: list[str], tmp: Path, keys: Keys) -> Iterator[str]:
    """``kvgate serve --engine ... --prices --ledger --keys`` as a real process."""
    prices = tmp / "prices.yaml"
    prices.write_text(f"models:\n  {SERVED_NAME}:\n    input_per_mtok: 0.60\n"
                      "    cached_input_per_mtok: 0.10\n    output_per_mtok: 3.00\n"
                      "tenants:\n  globex: {discount: 0.25}\n")
    port = free_port()
    argv = [KVGATE, "serve", *(a for u in engine_urls for a in ("--engine", u)),
            "--prices", str(prices), "--ledger", f"sqlite://{tmp}/ledger.sqlite",
            "--keys", str(keys.path), "--port", str(port)]
    log = (tmp / "gateway.log").open("wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=1).status_code in (200, 503):
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError((tmp / "gateway.log").read_text()[-3000:])
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(15)
        log.close()


@pytest.fixture(scope="module")
def gateway(agent_fleet: list[LocalEngine],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, Keys]]:
    tmp = tmp_path_factory.mktemp("agent-apis")
    keys = write_keys(tmp)
    with _serve([e.url for e in agent_fleet], tmp, keys) as url:
        time.sleep(1.0)  # first health and metrics scrapes
        yield url, tmp, keys


def _exported(tmp: Path) -> dict[str, LedgerRecord]:
    out = tmp / f"export-{uuid.uuid4().hex}.jsonl"
    subprocess.run([KVGATE, "usage", "export", "--ledger", f"sqlite://{tmp}/ledger.sqlite",
                    "--since", "2020-01-01", "--until", "2100-01-01", "--format", "jsonl",
                    "--out", str(out)], check=True, capture_output=True, timeout=60)
    records = map(LedgerRecord.from_json, out.read_text().splitlines())
    return {str(r.client_request_id): r for r in records}


def _check_billing(tmp: Path, seen: dict[str, tuple[int, int, int, str | None]]) -> None:
    """Each turn's (prompt incl. cache, cached, completion, engine) as the client saw it equals
    the ledger's and the export's; the cost is the discounted formula's."""
    rows = final_ledger_rows(tmp / "ledger.sqlite", list(seen))
    exported = _exported(tmp)
    for rid, (prompt, cached, completion, engine) in seen.items():
        r = rows[rid]
        assert (r.prompt_tokens, r.cached_tokens, r.completion_tokens, r.engine) == \
            (prompt, cached, completion, engine), rid
        assert (r.tenant, r.outcome, r.priced, r.cached_source) == \
            ("globex", "done", True, "reported")
        assert abs(r.cost_total - expected_cost(prompt, cached, completion, "globex")) <= \
            Decimal("1e-8")
        assert exported[rid] == r


def _increasing(cached: list[int]) -> None:
    assert cached[0] == 0, cached
    assert all(b > a for a, b in itertools.pairwise(cached)), cached
    assert all(c % BLOCK == 0 for c in cached), cached


# ---- the simulator answers like the real engine ------------------------------------------


def _shape(x: Any) -> Any:
    """A JSON value's structure: keys and value types (a list: its first item's)."""
    if isinstance(x, dict):
        return {k: _shape(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_shape(x[0])] if x else []
    return type(x).__name__


def _answer_shape(resp: httpx.Response) -> Any:
    """Status and JSON structure, or for SSE the event names (repeats collapsed) and the
    structure of each name's first event."""
    if not resp.headers.get("content-type", "").startswith("text/event-stream"):
        return resp.status_code, _shape(resp.json())
    names: list[str] = []
    first: dict[str, Any] = {}
    for block in resp.text.strip().split("\n\n"):
        name, data = (line.split(": ", 1)[1] for line in block.splitlines())
        if not names or names[-1] != name:
            names.append(name)
        first.setdefault(name, _shape(json.loads(data)))
    return resp.status_code, names, first


MSG = [{"role": "user", "content": "Hello there"}]
PARITY: list[tuple[str, str, str, Any]] = [
    ("messages", "POST", "/v1/messages", {"model": SERVED_NAME, "max_tokens": 4, "messages": MSG}),
    ("messages stream", "POST", "/v1/messages",
     {"model": SERVED_NAME, "max_tokens": 4, "messages": MSG, "stream": True}),
    ("count_tokens", "POST", "/v1/messages/count_tokens", {"model": SERVED_NAME, "messages": MSG}),
    ("messages unknown model", "POST", "/v1/messages",
     {"model": "nope", "max_tokens": 4, "messages": MSG}),
    ("messages missing max_tokens", "POST", "/v1/messages", {"model": SERVED_NAME,
                                                             "messages": MSG}),
    ("messages too long", "POST", "/v1/messages",
     {"model": SERVED_NAME, "max_tokens": 10**5, "messages": MSG}),
    ("responses", "POST", "/v1/responses",
     {"model": SERVED_NAME, "input": "Hello there", "max_output_tokens": 4}),
    ("responses stream", "POST", "/v1/responses",
     {"model": SERVED_NAME, "input": "Hello there", "max_output_tokens": 4, "stream": True}),
    ("responses unknown id", "GET", "/v1/responses/resp_nope", None),
    ("responses cancel unknown", "POST", "/v1/responses/resp_nope/cancel", None),
    ("responses missing input", "POST", "/v1/responses", {"model": SERVED_NAME}),
    ("responses unknown model", "POST", "/v1/responses", {"model": "nope", "input": "x"}),
    ("tokenize prompt", "POST", "/tokenize", {"model": SERVED_NAME, "prompt": "Hello there"}),
    ("tokenize messages", "POST", "/tokenize", {"model": SERVED_NAME, "messages": MSG}),
    ("detokenize", "POST", "/detokenize", {"model": SERVED_NAME, "tokens": [0, 1000]}),
    ("embeddings on a generate runner", "POST", "/v1/embeddings", {"input": "x"}),
    ("messages tools", "POST", "/v1/messages",
     {"model": SERVED_NAME, "max_tokens": 4, "messages": MSG, "tools": TOOLS}),
    ("messages tools stream", "POST", "/v1/messages",
     {"model": SERVED_NAME, "max_tokens": 4, "messages": MSG, "tools": TOOLS, "stream": True}),
    ("messages system blocks", "POST", "/v1/messages",
     {"model": SERVED_NAME, "max_tokens": 4, "messages": MSG,
      "system": [{"type": "text", "text": "Be terse."}]}),
    ("count_tokens tools", "POST", "/v1/messages/count_tokens",
     {"model": SERVED_NAME, "messages": MSG, "tools": TOOLS, "system": "Be terse."}),
    ("responses tools", "POST", "/v1/responses", {
        "model": SERVED_NAME, "input": "x", "max_output_tokens": 4, "tools": [{
            "type": "function", "name": "f", "description": "d",
            "parameters": {"type": "object", "properties": {}}}]}),
    ("responses instructions and items", "POST", "/v1/responses", {
        "model": SERVED_NAME, "instructions": "Be terse.", "max_output_tokens": 4, "input": [
            {"role": "user", "content": "Hi"},
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "Yo"}]},
            {"role": "user", "content": [{"type": "input_text", "text": "again"}]}]}),
    ("responses not stored", "POST", "/v1/responses",
     {"model": SERVED_NAME, "input": "x", "max_output_tokens": 4, "store": False}),
    ("responses too long", "POST", "/v1/responses",
     {"model": SERVED_NAME, "input": "x", "max_output_tokens": 10**5}),
    ("tokenize token strs", "POST", "/tokenize",
     {"model": SERVED_NAME, "messages": MSG, "return_token_strs": True}),
    ("tokenize unknown model", "POST", "/tokenize", {"model": "nope", "prompt": "x"}),
    ("render chat", "POST", "/v1/chat/completions/render", {"model": SERVED_NAME,
                                                            "messages": MSG}),
    ("render messages", "POST", "/v1/messages/render",
     {"model": SERVED_NAME, "max_tokens": 8, "messages": MSG}),
    ("render responses", "POST", "/v1/responses/render",
     {"model": SERVED_NAME, "input": "Hello there", "max_output_tokens": 8}),
    ("render unknown model", "POST", "/v1/messages/render",
     {"model": "nope", "max_tokens": 8, "messages": MSG}),
]


async def test_simulator_answers_like_the_real_engine(agent_fleet: list[LocalEngine]) -> None:
    """Every agent route: the same status, JSON structure and SSE event sequence from the
    simulator as from real vLLM 0.32 (text and counts aside)."""
    from kvgate.engines.sim.core.config import SimConfig
    from kvgate.engines.sim.testing import serve_sim

    cfg = SimConfig(served_model_names=[SERVED_NAME], block_size=BLOCK, max_model_len=4096,
                    capacity_blocks=128, time_scale=0)
    mismatches = []
    async with serve_sim(cfg) as sim, httpx.AsyncClient(timeout=60) as http:
        for name, method, path, body in PARITY:
            real = _answer_shape(await http.request(method, agent_fleet[0].url + path, json=body))
            simulated = _answer_shape(await http.request(method, sim.url + path, json=body))
            if real != simulated:
                mismatches.append((name, real, simulated))
    assert not mismatches, "\n".join(f"{n}:\n real {r}\n sim  {s}" for n, r, s in mismatches)


# ---- sessions -----------------------------------------------------------------------------


def _message_turn(client: anthropic.Anthropic, stream: bool,
                  **kw: Any) -> tuple[anthropic.types.Message, str | None]:
    if stream:
        with client.messages.stream(**kw) as s:
            return s.get_final_message(), s.response.headers.get("x-kvgate-engine")
    raw = client.messages.with_raw_response.create(**kw)
    return raw.parse(), raw.headers.get("x-kvgate-engine")


def test_anthropic_session_cached_routed_billed(gateway: tuple[str, Path, Keys]) -> None:
    url, tmp, keys = gateway
    client = anthropic.Anthropic(base_url=url, auth_token=keys.user, max_retries=0)
    system, history = _code(1, 60), []
    seen: dict[str, tuple[int, int, int, str | None]] = {}
    cached = []
    for turn, stream in enumerate(TURNS):
        history.append({"role": "user", "content": _code(100 + turn, 8)})
        rid = f"anthropic-{uuid.uuid4().hex[:8]}-{turn}"
        msg, engine = _message_turn(client, stream, model=SERVED_NAME, max_tokens=8,
                                    system=system, messages=history,
                                    tools=TOOLS, extra_headers={"x-request-id": rid})
        u = msg.usage
        read, written = u.cache_read_input_tokens or 0, u.cache_creation_input_tokens or 0
        seen[rid] = (u.input_tokens + read + written, read, u.output_tokens, engine)
        cached.append(read)
        history.append({"role": "assistant", "content": msg.content[0].text})  # type: ignore[union-attr]
    print("anthropic cached per turn:", cached, "engines:", {s[3] for s in seen.values()})
    _increasing(cached)
    assert len({s[3] for s in seen.values()}) == 1
    _check_billing(tmp, seen)


def _response_turn(client: openai.OpenAI, stream: bool, **kw: Any) -> tuple[Any, str | None]:
    if stream:
        events = client.responses.create(stream=True, **kw)
        final = [e for e in events if e.type == "response.completed"]
        return final[0].response, events.response.headers.get("x-kvgate-engine")
    raw = client.responses.with_raw_response.create(**kw)
    return raw.parse(), raw.headers.get("x-kvgate-engine")


def test_responses_session_cached_routed_billed(gateway: tuple[str, Path, Keys]) -> None:
    url, tmp, keys = gateway
    client = openai.OpenAI(base_url=url + "/v1", api_key=keys.user, max_retries=0)
    instructions, prev = _code(2, 60), None
    seen: dict[str, tuple[int, int, int, str | None]] = {}
    cached = []
    for turn, stream in enumerate(TURNS):
        rid = f"responses-{uuid.uuid4().hex[:8]}-{turn}"
        resp, engine = _response_turn(
            client, stream, model=SERVED_NAME, instructions=instructions,
            input=_code(200 + turn, 8), max_output_tokens=8, temperature=0,
            previous_response_id=prev, extra_headers={"x-request-id": rid})
        assert resp.previous_response_id == prev
        u = resp.usage
        seen[rid] = (u.input_tokens, u.input_tokens_details.cached_tokens, u.output_tokens, engine)
        cached.append(u.input_tokens_details.cached_tokens)
        assert client.responses.retrieve(resp.id).output_text == resp.output_text
        prev = resp.id
    print("responses cached per turn:", cached, "engines:", {s[3] for s in seen.values()})
    _increasing(cached)
    assert len({s[3] for s in seen.values()}) == 1
    _check_billing(tmp, seen)
    with pytest.raises(openai.BadRequestError, match="synchronous"):
        client.responses.cancel(prev or "")


def test_tools_and_count_tokens(gateway: tuple[str, Path, Keys]) -> None:
    url, _, keys = gateway
    client = anthropic.Anthropic(base_url=url, auth_token=keys.user, max_retries=0)
    messages: list[Any] = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                           "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": "sunny"}]}]
    counted = client.messages.count_tokens(model=SERVED_NAME, messages=messages, tools=TOOLS)
    for stream in (False, True):
        msg, _ = _message_turn(client, stream, model=SERVED_NAME, max_tokens=4,
                               messages=messages, tools=TOOLS)
        u = msg.usage
        total = u.input_tokens + (u.cache_read_input_tokens or 0) + \
            (u.cache_creation_input_tokens or 0)
        assert counted.input_tokens == total
        assert msg.stop_reason in ("max_tokens", "end_turn", "tool_use")


# ---- errors -------------------------------------------------------------------------------


def _anthropic_shape(resp: httpx.Response, status: int) -> None:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert body["type"] == "error", body
    assert isinstance(body["error"]["type"], str) and isinstance(body["error"]["message"], str)


def _openai_shape(resp: httpx.Response, status: int) -> None:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert isinstance(error["message"], str) and "type" in error, error


BIG = b'{"model": "tiny-llama", "pad": "' + b"x" * (9 << 20) + b'"}'
ERRORS: list[tuple[str, str, bytes, int]] = [
    ("malformed", "/v1/messages", b"{not json", 400),
    ("missing max_tokens", "/v1/messages",
     b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}]}', 400),
    ("unknown model", "/v1/messages",
     b'{"model": "nope", "max_tokens": 3, "messages": [{"role": "user", "content": "x"}]}', 404),
    ("oversized", "/v1/messages", BIG, 413),
    ("malformed", "/v1/responses", b"{not json", 400),
    ("missing input", "/v1/responses", b'{"model": "tiny-llama"}', 400),
    ("unknown model", "/v1/responses", b'{"model": "nope", "input": "x"}', 404),
    ("oversized", "/v1/responses", BIG, 413),
    ("unknown id", "/v1/responses/resp_doesnotexist", b"", 404),
]


@pytest.mark.parametrize(("name", "path", "body", "status"), ERRORS,
                         ids=[f"{p.split('/')[2]}-{n}" for n, p, _, _ in ERRORS])
def test_errors_in_each_api_shape(gateway: tuple[str, Path, Keys], name: str, path: str,
                                  body: bytes, status: int) -> None:
    url, _, keys = gateway
    headers = {**keys.auth("user"), "content-type": "application/json"}
    method = "GET" if name == "unknown id" else "POST"
    resp = httpx.request(method, url + path, content=body or None, headers=headers, timeout=60)
    (_anthropic_shape if path.startswith("/v1/messages") else _openai_shape)(resp, status)


# ---- engines dying (last: they do not come back) ------------------------------------------


def _kill_mid_stream(url: str, keys: Keys, path: str, body: dict[str, Any],
                     fleet: list[LocalEngine]) -> str | None:
    """Start a long stream, SIGKILL the engine serving it once the stream has started; the
    whole stream as the client sees it, or None when the engine's whole answer had reached
    the gateway before the kill (on two busy cores vLLM's API server once sent its first
    byte only after its engine core had generated all 3,900 tokens, 9 s: then no kill can
    land mid-answer; each API's mid-stream error shape is covered deterministically by
    tests/integration/test_api_adapters.py)."""
    with httpx.stream("POST", url + path, json=body, headers=keys.auth("user"),
                      timeout=120) as resp:
        assert resp.status_code == 200
        served = resp.headers["x-kvgate-engine"]
        # killed as soon as the stream has started (the gateway sends its head on the engine's
        # first bytes): an engine that got ahead of a CPU-starved client and gateway can flush
        # its whole answer into the sockets' buffers within a few lines' reading time
        os.killpg(fleet[int(served.rsplit("-", 1)[1])].pid, signal.SIGKILL)  # engine-<i>
        lines = list(resp.iter_lines())
    if any("message_stop" in line or "response.completed" in line for line in lines):
        assert not any(line.startswith("event: error") for line in lines)  # a whole answer
        print(f"{path}: the answer was complete before the engine was killed")
        return None
    return "\n".join(lines)


def test_background_response_and_queued_request_through_the_default_preset(
        gateway: tuple[str, Path, Keys]) -> None:
    """The async queue of the default preset on real vLLM: ``background: true`` with the real
    openai SDK (same id from create to completed, ``previous_response_id`` continues on the
    engine that stored it), and a queued chat request (202, then its result by id); both
    billed once at their tier."""
    url, tmp, keys = gateway
    client = openai.OpenAI(base_url=url + "/v1", api_key=keys.user, max_retries=0)
    created = client.responses.create(model=SERVED_NAME, input="Name a prime number.",
                                      background=True, max_output_tokens=8, temperature=0)
    assert (created.status, created.background) == ("queued", True)
    deadline = time.monotonic() + 120
    done = client.responses.retrieve(created.id)
    while done.status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, done
        time.sleep(0.3)
        done = client.responses.retrieve(created.id)
    assert done.status in ("completed", "incomplete") and done.id == created.id
    assert done.output_text
    follow = client.responses.with_raw_response.create(
        model=SERVED_NAME, input="And another one?", previous_response_id=created.id,
        max_output_tokens=8, temperature=0)
    assert follow.parse().status in ("completed", "incomplete")
    queued = httpx.post(url + "/v1/chat/completions", timeout=30, headers={
        **keys.auth("user"), "x-kvgate-queue": "true"}, json={
        "model": SERVED_NAME, "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "user", "content": "Say hi."}]})
    assert queued.status_code == 202, queued.text
    job_id = queued.json()["id"]
    while (got := httpx.get(f"{url}/v1/queue/requests/{job_id}", headers=keys.auth("user"),
                            timeout=30).json())["status"] in ("queued", "running"):
        assert time.monotonic() < deadline, got
        time.sleep(0.3)
    assert got["status"] == "succeeded" and got["result"]["status_code"] == 200
    assert got["result"]["body"]["choices"][0]["message"]["content"]
    records = final_ledger_rows(tmp / "ledger.sqlite", [created.id, job_id], by="request_id",
                                final=False)  # deferred jobs: request id = job id
    assert (records[created.id].service_tier, records[job_id].service_tier) == (
        "background", "queued")
    assert all(r.status == 200 and r.tenant == "globex" for r in records.values())
    assert follow.headers["x-kvgate-engine"] == records[created.id].engine


# Kills both engines of the module fixture: keep it the module's last test.
def test_engine_dies_mid_stream_then_none_healthy(
        gateway: tuple[str, Path, Keys], agent_fleet: list[LocalEngine]) -> None:
    url, _, keys = gateway
    text = _kill_mid_stream(url, keys, "/v1/messages", {
        "model": SERVED_NAME, "max_tokens": 3900, "stream": True, "temperature": 0,
        "messages": [{"role": "user", "content": _code(7, 4)}]}, agent_fleet)
    if text is not None:
        error = json.loads(text.split("event: error\ndata: ")[1].splitlines()[0])
        assert error["type"] == "error" and error["error"]["type"]
    text = _kill_mid_stream(url, keys, "/v1/responses", {
        "model": SERVED_NAME, "max_output_tokens": 3900, "stream": True, "temperature": 0,
        "input": _code(8, 4)}, agent_fleet)
    if text is not None:
        error = json.loads(text.split("event: error\ndata: ")[1].splitlines()[0])
        assert error["type"] == "error" and error["message"]
    deadline = time.monotonic() + 30
    while True:  # both engines gone: once health notices, each API answers in its shape
        msgs = httpx.post(url + "/v1/messages", headers=keys.auth("user"), timeout=30, json={
            "model": SERVED_NAME, "max_tokens": 3, "messages": [{"role": "user", "content": "x"}]})
        if msgs.status_code == 503 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    _anthropic_shape(msgs, 503)
    resp = httpx.post(url + "/v1/responses", headers=keys.auth("user"), timeout=30,
                      json={"model": SERVED_NAME, "input": "x"})
    _openai_shape(resp, 503)
