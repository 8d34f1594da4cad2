"""``kvgate serve --engine A --engine B`` (a real process, no config file) in front of two real
vLLM CPU engines: what a user gets without configuring anything.

* With ``x-session-affinity`` the header is echoed, each session's turns land on one engine and
  every turn after the first finds the previous turn's prompt cached.
* Without any header the default is still cache-aware: interleaved conversations with distinct
  prompts each keep finding their previous turn cached. A cache-blind spread over two engines
  would send each later turn to the other engine half the time (0.5^8 to pass by chance).

"The previous turn's prompt cached" is exact: the full blocks that the previous prompt's token
ids share with this prompt's (``return_token_ids``: the engine's own tokenization), capped
like vLLM at ``(prompt - 1) // 128`` blocks.

Each test salts its prompts with its own ``cache_salt`` so no test reuses another's blocks.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench import agentic, procs, venvs
from bench.agentic_ideal import chain
from bench.agentic_systems import KVGATE, SYSTEMS, running
from bench.kv_pressure import fleet_of, token_counter
from kvgate.engines.local.launcher import LocalEngine
from kvgate.engines.local.model import SERVED_NAME

pytestmark = pytest.mark.e2e

BLOCK = 128
TURNS = 3


#: Seconds within which a mis-set topic must show on /health.
MISSET_WITHIN_S = 10.0


@pytest.fixture(scope="module")
def gateway(vllm_fleet: list[LocalEngine], tiny_model: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    fleet = fleet_of(vllm_fleet, tiny_model)
    logs = tmp_path_factory.mktemp("serve-default")
    with running(SYSTEMS["kvgate-default"], fleet, logs, venvs.DEFAULT_ROOT) as url:
        yield url


@dataclass
class Conversation:
    sid: str
    messages: list[dict[str, str]]
    replies: list[httpx.Response] = field(default_factory=list)

    def cached(self, turn: int) -> int:
        usage: dict[str, Any] = self.replies[turn].json()["usage"]
        return int(usage["prompt_tokens_details"]["cached_tokens"])

    def prompt_ids(self, turn: int) -> list[int]:
        ids: list[int] = self.replies[turn].json()["prompt_token_ids"]
        return ids

    def shared_with_previous(self, turn: int) -> int:
        """Tokens in the full blocks this turn's prompt shares with the previous turn's, capped
        as vLLM caps a hit."""
        now, before = chain(self.prompt_ids(turn)), set(chain(self.prompt_ids(turn - 1)))
        shared = next((i for i, key in enumerate(now) if key not in before), len(now))
        return min(shared, (len(self.prompt_ids(turn)) - 1) // BLOCK) * BLOCK


def _conversations(tiny_model: Path, count: int, seed: int) -> list[Conversation]:
    """``count`` conversations, each with its own ~1.3k-token system prompt."""
    tokens = token_counter(tiny_model)
    rng = random.Random(seed)
    return [Conversation(f"chat-{seed}-{i}", [{"role": "system", "content": agentic.text(
        rng, 1_300, tokens)[0]}]) for i in range(count)]


def _talk(url: str, conversations: list[Conversation], headers: bool, salt: str,
          tiny_model: Path) -> None:
    """``TURNS`` turns of every conversation, interleaved turn by turn, one request at a time."""
    tokens = token_counter(tiny_model)
    rng = random.Random(salt)
    with httpx.Client(base_url=url, timeout=120) as client:
        for _ in range(TURNS):
            for conv in conversations:
                conv.messages.append({"role": "user", "content": agentic.text(rng, 200, tokens)[0]})
                reply = client.post("/v1/chat/completions", json={
                    "model": SERVED_NAME, "messages": conv.messages, "max_tokens": 16,
                    "temperature": 0, "ignore_eos": True, "cache_salt": salt,
                    "return_token_ids": True,
                }, headers={"x-session-affinity": conv.sid} if headers else {})
                assert reply.status_code == 200, reply.text
                conv.replies.append(reply)
                conv.messages.append({"role": "assistant",
                                      "content": reply.json()["choices"][0]["message"]["content"]})


def _later_turns_cached(conversations: list[Conversation]) -> list[tuple[str, int, int, int]]:
    """(sid, turn, cached, shared with the previous turn) of every later turn whose cached
    tokens fall short of what it shares with the previous turn's prompt."""
    short = []
    for conv in conversations:
        for turn in range(1, TURNS):
            shared = conv.shared_with_previous(turn)
            assert shared >= 10 * BLOCK  # the system prompt at least: a meaningful check
            if conv.cached(turn) < shared:
                short.append((conv.sid, turn, conv.cached(turn), shared))
    return short


def _engines(conv: Conversation) -> set[str | None]:
    return {r.headers.get("x-kvgate-engine") for r in conv.replies}


def test_session_header_is_echoed_and_keeps_a_session_cached_on_one_engine(
        gateway: str, tiny_model: Path) -> None:
    conversations = _conversations(tiny_model, 3, seed=1)
    _talk(gateway, conversations, True, f"serve-headers-{uuid.uuid4().hex}", tiny_model)
    placement = {c.sid: sorted(str(e) for e in _engines(c)) for c in conversations}
    print(f"\nkvgate serve --engine x2, with x-session-affinity: {placement}")
    for conv in conversations:
        assert [r.headers.get("x-session-affinity") for r in conv.replies] == [conv.sid] * TURNS
        assert len(_engines(conv)) == 1 and None not in _engines(conv), placement
    assert _later_turns_cached(conversations) == []


def test_default_is_cache_aware_without_headers(
        gateway: str, tiny_model: Path, vllm_fleet: list[LocalEngine]) -> None:
    conversations = _conversations(tiny_model, 4, seed=2)
    _talk(gateway, conversations, False, f"serve-plain-{uuid.uuid4().hex}", tiny_model)
    placement = {c.sid: sorted(str(e) for e in _engines(c)) for c in conversations}
    print(f"\nkvgate serve --engine x2, no session header: {placement}")
    assert all("x-session-affinity" not in r.headers for c in conversations for r in c.replies)
    assert _later_turns_cached(conversations) == []
    # the ids these checks (and bench/kv_pressure.py's ideal) rely on are the engine's own
    # tokenization of the chat: the same as POST /tokenize of the same messages
    conv = conversations[0]
    for turn in range(TURNS):
        tokenized = httpx.post(vllm_fleet[0].url + "/tokenize", timeout=30, json={
            "model": SERVED_NAME, "messages": conv.messages[:2 + 2 * turn],
            "add_generation_prompt": True}).json()["tokens"]
        assert tokenized == conv.prompt_ids(turn)


def _kv_states(url: str) -> dict[str, dict[str, Any]]:
    doc: dict[str, Any] = httpx.get(url + "/health", timeout=5).json()
    engines: dict[str, dict[str, Any]] = doc["plugins"]["kv-events"]["engines"]
    return engines


def test_misset_topic_shows_on_health_within_seconds(
        vllm_fleet: list[LocalEngine], events_port: int, tiny_model: Path,
        tmp_path: Path) -> None:
    port = procs.free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [KVGATE, "serve", *(a for e in vllm_fleet for a in ("--engine", e.url)),
            "--kv-events-bind", f"tcp://127.0.0.1:{events_port}", "--tokenizer", str(tiny_model),
            "--host", "127.0.0.1", "--port", str(port)]
    log = tmp_path / "gateway.log"
    with procs.running(argv, "0-1", log) as proc:
        procs.wait_healthy(url + "/v1/models", proc, 60.0, log, SERVED_NAME.encode())
        assert all(e["state"] != "degraded" for e in _kv_states(url).values())
        rng = random.Random(3)
        for _ in range(2):  # uncached prompts: each engine stores blocks and publishes
            reply = httpx.post(url + "/v1/chat/completions", timeout=60, json={
                "model": SERVED_NAME, "max_tokens": 4, "ignore_eos": True,
                "messages": [{"role": "user", "content": agentic.text(
                    rng, 400, token_counter(tiny_model))[0]}]})
            assert reply.status_code == 200, reply.text
        # the engines have published by now (blocks are stored before the answer): the bound is
        # on the gateway noticing, not on the engines' compute (slow on a loaded machine)
        started = time.monotonic()
        states = _kv_states(url)
        while (any(e["state"] != "degraded" for e in states.values())
               and time.monotonic() - started < MISSET_WITHIN_S):
            time.sleep(0.2)
            states = _kv_states(url)
        seen_after = time.monotonic() - started
        metrics = httpx.get(url + "/metrics", timeout=5).text
    print(f"\nmis-set topic: /health after {seen_after:.1f} s: "
          f"{ {name: (e['state'], e['reason']) for name, e in states.items()} }")
    assert {e["state"] for e in states.values()} == {"degraded"}, states
    assert all("kv@vllm-" in e["reason"] for e in states.values()), states
    unknown = [line for line in metrics.splitlines()
               if line.startswith("kvgate_kv_events_unknown_topics_total")]
    assert unknown and float(unknown[0].rsplit(" ", 1)[1]) > 0, unknown
    assert "WARNING" in log.read_text() and "kv@vllm-" in log.read_text()
