"""Incremental chat tokenization (plugins/prefix/chat_prefix.py): always the ids of tokenizing the whole
rendered chat, on real tokenizers and templates; bounded; off the event loop."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Any

import pytest

from bench.tokenization import build_hf_folder, corpus
from kvgate.engines.local.model import MARKER, model_dir
from kvgate.middleware.framework.types import Api, CycleState
from kvgate.middleware.observe.metrics import counter_holders
from kvgate.plugins.common.state import TOKEN_IDS
from kvgate.plugins.prefix.chat_prefix import ChatPrefixCache, ChatTokenizer
from kvgate.plugins.prefix.tokenizer import HfBackend, Tokenizer, TokenizerBackend
from tests.unit.routing.helpers import NoLookup, request

Messages = list[dict[str, Any]]
#: Contents that stress the cut: whitespace at either end, nothing, non-ASCII, text that looks
#: like a special token, a literal special token, digits (split per digit by Llama's regex).
ODD = ["  leading spaces", "trailing newlines\n\n", "", "naïve café — 日本語 🙂", "<|eot_id",
       "a literal <|eot_id|> inside", "1234567890 12", "\t\tdef f(x):\n    return x  \n", " "]


def _tiny_llama() -> Path | None:
    folder = model_dir(0)
    return folder if (folder / MARKER).is_file() else None


@pytest.fixture(scope="module", params=["tiny-llama-0", "trained-byte-level"])
def backend(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> HfBackend:
    if request.param == "tiny-llama-0":
        folder = _tiny_llama()
        if folder is None:
            pytest.skip("the tiny model is built by the e2e tests (kvgate.engines.local.model)")
        return HfBackend(folder)
    texts = corpus()[:40]
    return HfBackend(build_hf_folder(tmp_path_factory.mktemp("bpe"), texts))


def _content(rng: random.Random, text: str) -> str:
    if rng.random() < 0.3:
        return rng.choice(ODD)
    start = rng.randrange(len(text) - 3000)
    return text[start:start + rng.randrange(1, 2500)]


def _whole(backend: TokenizerBackend, msgs: Messages, gen: bool) -> list[int]:
    return list(backend.encode(backend.render_chat(msgs, gen, {}), False))


SCENARIOS = ["grow", "regenerate", "fork", "edit", "interleaved", "no-generation-prompt"]


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("seed", [1, 2])
def test_incremental_equals_whole_tokenization(backend: HfBackend, scenario: str,
                                               seed: int) -> None:
    rng = random.Random(f"{scenario}-{seed}")
    text = "".join(corpus()[40:80])
    chat = ChatTokenizer(backend, ChatPrefixCache())
    assert chat.self_check()
    system = {"role": "system", "content": _content(rng, text)}
    sessions: list[Messages] = [[system] for _ in range(3)]
    gen = scenario != "no-generation-prompt"
    for turn in range(12):
        i = rng.randrange(3) if scenario == "interleaved" else 0
        msgs = sessions[i]
        if turn:
            msgs.append({"role": "assistant", "content": _content(rng, text)})
        msgs.append({"role": "user", "content": _content(rng, text)})
        asked = list(msgs)
        if scenario == "regenerate" and turn % 3 == 2:
            asked = list(msgs)  # the same conversation again
        if scenario == "fork" and turn > 3 and turn % 2:
            cut = rng.randrange(1, len(msgs) // 2) * 2 - 1  # an earlier user turn
            asked = [*msgs[:cut], {"role": "user", "content": _content(rng, text)}]
        if scenario == "edit" and turn > 2 and turn % 3 == 0:
            asked = list(msgs)
            j = rng.randrange(1, len(asked) - 1)
            asked[j] = {**asked[j], "content": asked[j]["content"] + " (edited)"}
        got = chat.tokenize(asked, gen, {})
        assert list(got) == _whole(backend, asked, gen), (scenario, turn)
    assert chat.cache is not None and chat.cache.hits > 0


def test_a_session_holds_one_entry_reachable_at_every_earlier_turn(backend: HfBackend) -> None:
    chat = ChatTokenizer(backend, ChatPrefixCache())
    cache = chat.cache
    assert cache is not None
    msgs: Messages = [{"role": "system", "content": "You are an agent."}]
    asked = []
    for turn in range(8):
        msgs += [{"role": "user", "content": f"step {turn}: run the tests"},
                 {"role": "assistant", "content": f"done {turn}, all green"}]
        asked.append(msgs[:-1])
        chat.tokenize(msgs[:-1], True, {})
    assert len(cache) == 1 and cache.stats.superseded == 7
    hits = cache.hits
    fork = [*asked[3], {"role": "assistant", "content": "another answer"},
            {"role": "user", "content": "and then?"}]
    assert list(chat.tokenize(fork, True, {})) == _whole(backend, fork, True)
    assert cache.hits == hits + 1  # served from turn 3's cut in the session's one entry


@pytest.mark.parametrize("max_bytes", [100_000, 200_000])
def test_bounded_in_bytes_with_evictions_counted(backend: HfBackend, max_bytes: int) -> None:
    rng = random.Random(max_bytes)
    text = "".join(corpus()[80:90])
    chat = ChatTokenizer(backend, ChatPrefixCache(max_bytes))
    cache = chat.cache
    assert cache is not None
    sessions: list[Messages] = [[{"role": "system", "content": f"agent {i}"}] for i in range(10)]
    for _ in range(60):
        msgs = rng.choice(sessions)
        start = rng.randrange(len(text) - 3000)
        msgs += [{"role": "user", "content": text[start:start + rng.randrange(1500, 2500)]},
                 {"role": "assistant", "content": "ok"}]
        assert list(chat.tokenize(msgs[:-1], True, {})) == _whole(backend, msgs[:-1], True)
        assert cache.bytes <= max_bytes
        assert (cache.stats.bytes, cache.stats.entries) == (cache.bytes, len(cache))
    assert cache.stats.evictions > 0


def test_entries_over_a_quarter_of_the_bound_are_not_kept(backend: HfBackend) -> None:
    chat = ChatTokenizer(backend, ChatPrefixCache(max_bytes=4_000))
    msgs = [{"role": "user", "content": "x " * 3000}, {"role": "assistant", "content": "y"},
            {"role": "user", "content": "z"}]
    assert list(chat.tokenize(msgs, True, {})) == _whole(backend, msgs, True)
    assert chat.cache is not None and len(chat.cache) == 0 and chat.cache.bytes == 0


async def _plugin(backend_dir: Path, **params: Any) -> Tokenizer:
    spec = {"kind": "hf", "model_dir": str(backend_dir)}
    plugin = Tokenizer("tok", Tokenizer.Params(tokenizer=spec, **params), NoLookup())
    await plugin.start()
    return plugin


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_hf_folder(tmp_path_factory.mktemp("bpe-plugin"), corpus()[:40])


def _big_chat(chars: int) -> Messages:
    text = "".join(corpus()[100:140])[:chars]
    return [{"role": "system", "content": "sys"}, {"role": "user", "content": text}]


async def test_a_small_request_is_answered_while_a_huge_prompt_tokenizes(bpe_dir: Path) -> None:
    plugin = await _plugin(bpe_dir)
    order: list[str] = []

    async def run(name: str, msgs: Messages) -> None:
        state = CycleState()
        req = request(Api.CHAT, {"messages": msgs})
        req.raw_body = json.dumps({"messages": msgs}).encode()  # sizes the work, as served
        await plugin.prepare(req, state, [])
        assert state.get(TOKEN_IDS)
        order.append(name)

    huge = asyncio.create_task(run("huge", _big_chat(400_000)))  # a miss: ~100 ms and more
    await asyncio.sleep(0)  # the huge one is on the pool
    await run("small", [{"role": "user", "content": "hi"}])  # inline (< offload_min_chars)
    assert order == ["small"] and not huge.done()
    await huge
    assert order == ["small", "huge"] and plugin.stats.offloaded == 1
    await plugin.stop()


async def test_offloading_is_bounded_in_flight(bpe_dir: Path) -> None:
    plugin = await _plugin(bpe_dir, max_in_flight=1, offload_min_chars=0)
    bodies = [_big_chat(60_000 + i) for i in range(3)]
    states = [CycleState() for _ in bodies]
    await asyncio.gather(*(plugin.prepare(request(Api.CHAT, {"messages": b}), s, [])
                           for b, s in zip(bodies, states, strict=True)))
    chat = plugin.chat_tokenizer("m")
    assert chat is not None
    for body, state in zip(bodies, states, strict=True):
        ids = state.get(TOKEN_IDS)
        assert ids is not None and list(ids) == _whole(chat.backend, body, True)
    assert plugin.stats.waited == 2 and plugin.stats.in_flight == 0
    holders = counter_holders(plugin)
    assert holders["chat_cache"]["bytes"] > 0 and "evictions" in holders["chat_cache"]
    assert holders["stats"]["waited"] == 2
    await plugin.stop()


async def test_a_cached_turn_encodes_its_small_suffix_inline(bpe_dir: Path) -> None:
    """The rendering and the lookup run on the loop; only a large encode goes to the pool: the
    first turn of a 200 KB chat (a miss) is offloaded, the next (a short new message) is not."""
    plugin = await _plugin(bpe_dir)
    msgs = _big_chat(200_000)
    chat = plugin.chat_tokenizer("m")
    assert chat is not None
    for turn in range(3):
        req = request(Api.CHAT, {"messages": msgs})
        req.raw_body = json.dumps({"messages": msgs}).encode()
        state = CycleState()
        await plugin.prepare(req, state, [])
        ids = state.get(TOKEN_IDS)
        assert ids is not None and list(ids) == _whole(chat.backend, msgs, True)
        msgs = [*msgs, {"role": "assistant", "content": f"ok {turn}"},
                {"role": "user", "content": "next step"}]
    assert plugin.stats.offloaded == 1 and plugin.chat_cache.hits == 2
    await plugin.stop()


@pytest.mark.parametrize(("seed", "special"), [(1, False), (2, True), (3, False)])
def test_backend_encode_gives_the_tokenizers_own_ids(backend: HfBackend, seed: int,
                                                     special: bool) -> None:
    """The backend encodes without offsets (``encode_batch_fast`` where tokenizers has it):
    the ids are ``Tokenizer.encode``'s, odd texts included."""
    rng = random.Random(seed)
    text = "\n".join(corpus()[:40])
    for _ in range(40):
        piece = _content(rng, text)
        assert list(backend.encode(piece, special)) == backend._tok.encode(
            piece, add_special_tokens=special).ids
