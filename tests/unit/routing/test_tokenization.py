"""Tokenization producer: pass-through, module and HF backends, the growing-chat cache."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as HfTokenizer

from bench.tokenization import loop_ticks_while
from kvgate.engines.sim.core import tokenizer as sim_tokenizer
from kvgate.middleware.framework.errors import ConfigError
from kvgate.middleware.framework.types import Api, CycleState, InferenceRequest
from kvgate.plugins.common.state import TOKEN_IDS
from kvgate.plugins.prefix.tokenizer import (
    ChatTokenizer,
    HfBackend,
    ModuleBackend,
    Tokenizer,
    TokenizerSpec,
    last_boundary_end,
)
from tests.unit.routing.helpers import NoLookup, request

SPECIALS = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ sep }}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
    "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% endif %}{% if tools %}{{ tools | tojson }}{% endif %}"
)
CORPUS = ["Hello there, how are you? I am fine thanks. The quick brown fox jumps over the lazy "
          "dog 12345. You are a helpful assistant; answer briefly."] * 20


class SplitSensitive:
    """A tokenizer whose output depends on where the text is cut (like SentencePiece's dummy
    prefix): split tokenization differs from whole tokenization."""

    SPECIAL_TOKENS = ("<|eot_id|>",)

    @staticmethod
    def tokenize(text: str) -> list[int]:
        return [7, *sim_tokenizer.tokenize(text)]

    @staticmethod
    def render_chat(messages: Any, add_generation_prompt: bool) -> str:
        return sim_tokenizer.render_chat(messages, add_generation_prompt)


SPLIT_SENSITIVE = SplitSensitive()


def _build_hf(folder: Path, pre: str, sep: str = "") -> Path:
    from tokenizers import Tokenizer as HfTokenizer
    from tokenizers import models, pre_tokenizers, processors, trainers

    tok = HfTokenizer(models.BPE())
    if pre == "byte-level":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        alphabet = []
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=alphabet)
    tok.train_from_iterator(CORPUS, trainer)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"chat_template": TEMPLATE.replace("{{ sep }}", sep), "bos_token": {"content": "<|begin_of_text|>"},
              "eos_token": "<|eot_id|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def _conversation(turns: int) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": "You are a helpful assistant; answer briefly."}]
    for i in range(turns):
        msgs.append({"role": "user", "content": f"Question {i}: how are you, quick brown fox?"})
        msgs.append({"role": "assistant", "content": f"Fine thanks {i}. The lazy dog."})
    return msgs


async def _plugin(**params: Any) -> Tokenizer:
    plugin = Tokenizer("tok", Tokenizer.Params(**params), NoLookup())
    await plugin.start()
    return plugin


async def _tokens(plugin: Tokenizer, req: InferenceRequest) -> tuple[int, ...] | None:
    state = CycleState()
    await plugin.prepare(req, state, [])
    ids = state.get(TOKEN_IDS)
    return None if ids is None else tuple(ids)


SIM = {"kind": "module", "module": "kvgate.engines.sim.core.tokenizer"}

PASSTHROUGH = [
    ("token ids", {"prompt": [5, 6, 7]}, (5, 6, 7)),
    ("batch of token ids: first", {"prompt": [[1, 2], [3]]}, (1, 2)),
]


@pytest.mark.parametrize(("case", "body", "expected"), PASSTHROUGH, ids=[c[0] for c in PASSTHROUGH])
async def test_token_ids_pass_through_without_a_tokenizer(case: str, body: dict[str, Any],
                                                          expected: tuple[int, ...]) -> None:
    plugin = await _plugin()
    req = request(Api.COMPLETIONS, body)
    assert await _tokens(plugin, req) == expected
    assert req.prompt_token_estimate == len(expected)
    assert plugin.stats.passthrough == 1
    await plugin.stop()


async def test_text_without_tokenizer_yields_nothing() -> None:
    plugin = await _plugin()
    assert await _tokens(plugin, request(Api.COMPLETIONS, {"prompt": "hi"})) is None
    assert plugin.stats.no_tokenizer == 1
    await plugin.stop()


SIM_CASES = [
    ("completion text", Api.COMPLETIONS, {"prompt": "Hello world, 123!"},
     sim_tokenizer.tokenize("Hello world, 123!")),
    ("completion text batch", Api.COMPLETIONS, {"prompt": ["a b", "c"]},
     sim_tokenizer.tokenize("a b")),
    ("chat", Api.CHAT, {"messages": _conversation(1)},
     sim_tokenizer.chat_token_ids(_conversation(1))),
    ("chat without generation prompt", Api.CHAT,
     {"messages": _conversation(1), "add_generation_prompt": False},
     sim_tokenizer.chat_token_ids(_conversation(1), add_generation_prompt=False)),
]


@pytest.mark.parametrize(("case", "api", "body", "expected"), SIM_CASES,
                         ids=[c[0] for c in SIM_CASES])
@pytest.mark.parametrize("offload_min_chars", [0, 1 << 30])
async def test_sim_backend_matches_the_simulator(case: str, api: Api, body: dict[str, Any],
                                                 expected: list[int],
                                                 offload_min_chars: int) -> None:
    plugin = await _plugin(tokenizer=SIM, offload_min_chars=offload_min_chars)
    assert await _tokens(plugin, request(api, body)) == tuple(expected)
    assert plugin.stats.offloaded == (1 if offload_min_chars == 0 else 0)
    await plugin.stop()


async def test_per_model_tokenizers() -> None:
    plugin = await _plugin(models={"sim-model": SIM})
    body = {"messages": _conversation(1)}
    assert await _tokens(plugin, request(Api.CHAT, body, model="sim-model")) is not None
    assert await _tokens(plugin, request(Api.CHAT, body, model="other")) is None
    await plugin.stop()


async def test_growing_chat_reuses_the_cached_prefix() -> None:
    plugin = await _plugin(tokenizer=SIM)
    chat = plugin.chat_tokenizer("m")
    assert chat is not None and chat.cache is not None
    for turn in range(1, 6):
        msgs = _conversation(turn)[:-1]  # ends with the user's new question
        got = await _tokens(plugin, request(Api.CHAT, {"messages": msgs}))
        assert got == tuple(sim_tokenizer.chat_token_ids(msgs))
    assert (chat.cache.misses, chat.cache.hits) == (1, 4)
    again = await _tokens(plugin, request(Api.CHAT, {"messages": msgs}))  # a regenerate
    assert again == tuple(sim_tokenizer.chat_token_ids(msgs)) and chat.cache.hits == 5
    await plugin.stop()


async def test_edited_history_is_not_served_from_the_cache() -> None:
    plugin = await _plugin(tokenizer=SIM)
    msgs = _conversation(2)[:-1]
    await _tokens(plugin, request(Api.CHAT, {"messages": msgs[:3]}))
    edited = [*msgs[:3], {"role": "user", "content": "changed"}]
    edited[1] = {"role": "user", "content": "rewritten question"}
    got = await _tokens(plugin, request(Api.CHAT, {"messages": edited}))
    assert got == tuple(sim_tokenizer.chat_token_ids(edited))
    await plugin.stop()


async def test_split_sensitive_backend_disables_the_cache() -> None:
    module = "tests.unit.routing.test_tokenization:SPLIT_SENSITIVE"
    plugin = await _plugin(tokenizer={"kind": "module", "module": module})
    chat = plugin.chat_tokenizer("m")
    assert chat is not None and chat.cache is None
    msgs = _conversation(2)
    got = await _tokens(plugin, request(Api.CHAT, {"messages": msgs}))
    assert got == (7, *sim_tokenizer.chat_token_ids(msgs))
    await plugin.stop()


async def test_template_errors_leave_no_token_ids() -> None:
    plugin = await _plugin(tokenizer=SIM)
    bad = {"messages": [{"role": "wizard", "content": "x"}]}
    assert await _tokens(plugin, request(Api.CHAT, bad)) is None
    assert plugin.stats.failures == 1
    await plugin.stop()


@pytest.mark.parametrize(("spec", "error"), [
    ({"kind": "module", "module": "no_such_module_kvgate"}, "no_such_module_kvgate"),
    ({"kind": "module", "module": "json"}, "tokenize"),
])
async def test_bad_module_specs_fail_at_start(spec: dict[str, str], error: str) -> None:
    plugin = Tokenizer("tok", Tokenizer.Params(tokenizer=spec), NoLookup())
    with pytest.raises(ConfigError, match=error):
        await plugin.start()


def test_hf_spec_checks_the_folder(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"tokenizer\.json"):
        Tokenizer("tok", Tokenizer.Params(tokenizer=TokenizerSpec(kind="hf", model_dir=str(
            tmp_path))), NoLookup())
    with pytest.raises(ValueError, match="model_dir"):
        TokenizerSpec(kind="hf")


#: (case, spec fields besides kind/model_dir, error raised when the plugin is configured)
TEMPLATE_SPECS: list[tuple[str, dict[str, str], str | None]] = [
    ("missing file", {"chat_template": "missing.jinja"}, r"missing\.jinja does not exist"),
    ("module kind", {"kind": "module", "module": "kvgate.engines.sim.core.tokenizer",
                     "chat_template": "t.jinja"}, "chat_template is for kind 'hf'"),
]


@pytest.mark.parametrize(("case", "fields", "error"), TEMPLATE_SPECS,
                         ids=[c[0] for c in TEMPLATE_SPECS])
def test_chat_template_spec_checks(tmp_path: Path, case: str, fields: dict[str, str],
                                   error: str) -> None:
    folder = _build_hf(tmp_path / "f", "byte-level")
    spec = {"kind": "hf", "model_dir": str(folder), **fields}
    if "chat_template" in spec and spec["kind"] == "hf":
        spec["chat_template"] = str(tmp_path / spec["chat_template"])
    with pytest.raises((ConfigError, ValueError), match=error):
        Tokenizer("tok", Tokenizer.Params(tokenizer=spec), NoLookup())


async def test_configured_chat_template_replaces_the_folders(tmp_path: Path) -> None:
    """The engine's ``--chat-template`` file: chats are rendered with it, not the folder's."""
    folder = _build_hf(tmp_path / "f", "byte-level")
    custom = tmp_path / "custom.jinja"
    custom.write_text("{% for m in messages %}<|start_header_id|>{{ m['role'] | upper }}"
                      "<|end_header_id|>{{ m['content'] }}<|eot_id|>{% endfor %}")
    plugin = await _plugin(tokenizer={"kind": "hf", "model_dir": str(folder),
                                      "chat_template": str(custom)})
    msgs = _conversation(1)
    backend = HfBackend(folder)
    text = "".join(f"<|start_header_id|>{m['role'].upper()}<|end_header_id|>{m['content']}"
                   "<|eot_id|>" for m in msgs)
    assert await _tokens(plugin, request(Api.CHAT, {"messages": msgs})) == tuple(
        backend.encode(text, False))
    assert text != backend.render_chat(msgs, True, {})
    await plugin.stop()


HF_CASES = [
    # (pre-tokenizer, text between messages, split tokenization is exact -> cache on)
    ("byte-level", "", True),
    ("byte-level", "~", True),
    ("metaspace-first", "", True),  # every piece starts with a special token
    ("metaspace-first", "~", False),  # a piece starting with text gets a dummy prefix
]


@pytest.mark.parametrize(("pre", "sep", "cached"), HF_CASES)
async def test_hf_backend(tmp_path: Path, pre: str, sep: str, cached: bool) -> None:
    folder = _build_hf(tmp_path / pre, pre, sep)
    backend = HfBackend(folder)
    plugin = await _plugin(tokenizer={"kind": "hf", "model_dir": str(folder)})
    chat = plugin.chat_tokenizer("m")
    assert chat is not None and (chat.cache is not None) is cached
    for turn in range(1, 4):
        msgs = _conversation(turn)[:-1]
        whole = backend.encode(backend.render_chat(msgs, True, {}), False)
        assert whole[0] == backend.encode("", True)[0]  # the template's BOS, once
        assert await _tokens(plugin, request(Api.CHAT, {"messages": msgs})) == tuple(whole)
    if chat.cache is not None:
        assert chat.cache.hits == 2
    prompt = await _tokens(plugin, request(Api.COMPLETIONS, {"prompt": "Hello there"}))
    assert prompt == tuple(backend.encode("Hello there", True))
    bad = {"messages": [{"role": "wizard", "content": "x"}]}
    assert await _tokens(plugin, request(Api.CHAT, bad)) is None
    await plugin.stop()


async def test_hf_template_receives_tools_and_continue_final_message(tmp_path: Path) -> None:
    folder = _build_hf(tmp_path / "t", "byte-level")
    backend = HfBackend(folder)
    plugin = await _plugin(tokenizer={"kind": "hf", "model_dir": str(folder)})
    msgs = _conversation(1)
    tools = [{"type": "function", "function": {"name": "f"}}]
    got = await _tokens(plugin, request(Api.CHAT, {"messages": msgs, "tools": tools}))
    assert got == tuple(backend.encode(backend.render_chat(msgs, True, {"tools": tools}), False))
    body = {"messages": msgs, "continue_final_message": True, "add_generation_prompt": False}
    got = await _tokens(plugin, request(Api.CHAT, body))
    text = backend.render_chat(msgs, False, {})
    assert got == tuple(backend.encode(text[: text.rfind("<|eot_id|>")], False))
    await plugin.stop()


def test_boundaries_are_found_backwards_through_growing_windows() -> None:
    import re

    pattern = re.compile(re.escape("<|eot_id|>"))
    text = "a<|eot_id|>b" + "x" * 5000 + "<|eot_id|>tail"
    assert last_boundary_end(text, pattern, 0) == len(text) - 4
    assert last_boundary_end(text, pattern, 12) == len(text) - 4
    assert last_boundary_end(text, pattern, 0, len(text) - 5) == 11
    assert last_boundary_end("no marks", pattern, 0) == 0
    assert last_boundary_end("a<|eot_id|>" + "y" * 9000, pattern, 0) == 11
    assert last_boundary_end("abc", None, 2) == 2


def test_module_backend_rejects_objects_without_the_api() -> None:
    with pytest.raises(ConfigError):
        ModuleBackend(object())
    assert ChatTokenizer(ModuleBackend(sim_tokenizer), None).self_check()


def test_module_found_through_the_entry_point_group(monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib.metadata import EntryPoint

    import kvgate.plugins.prefix.tokenizer_backends as tokenization

    def fake(group: str) -> list[EntryPoint]:
        assert group == "kvgate.tokenizers"
        return [EntryPoint(name="sim", value="kvgate.engines.sim.core.tokenizer", group=group)]

    monkeypatch.setattr(tokenization, "entry_points", fake)
    backend = tokenization.load_backend(TokenizerSpec(kind="module", module="sim"))
    assert backend.encode("Hello world", True) == sim_tokenizer.tokenize("Hello world")
    assert "<|eot_id|>" in backend.boundaries


async def test_offloaded_hf_tokenization_leaves_the_event_loop_running(tmp_path: Path) -> None:
    """Regression: ``tokenizers``' ``encode`` holds the GIL for the whole call, so a prompt
    tokenized on the pool still froze the event loop; the backend uses ``encode_batch``, which
    releases it (same ids)."""
    backend = HfBackend(_build_hf(tmp_path / "gil", "byte-level"))
    text = " ".join(CORPUS) * 100
    t0 = time.perf_counter()
    whole = backend.encode(text, False)
    inline_s = time.perf_counter() - t0
    assert whole == HfTokenizer.from_file(str(tmp_path / "gil" / "tokenizer.json")).encode(
        text, add_special_tokens=False).ids
    ticks, longest = await loop_ticks_while(asyncio.to_thread(backend.encode, text, False))
    assert inline_s > 0.02  # enough work to see the loop run beside it
    assert ticks > 20 and longest < inline_s / 2, (ticks, longest, inline_s)
