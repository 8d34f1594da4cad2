"""Tokenization producer (plugin ``tokenizer``): writes TOKEN_IDS the way the engine tokenizes.

Token-id prompts pass through; text prompts are encoded with special tokens (vLLM's completions
default); chats are rendered by the chat template, then encoded without (vLLM's chat default).
Backends: ``hf`` (``tokenizer.json`` via ``tokenizers`` + a jinja2 chat template, no
transformers) or ``module`` (``tokenize``/``render_chat`` functions named by an entry point of
group ``kvgate.tokenizers`` or a dotted path). A growing chat is served from a cache of the token
ids of its rendered message-list prefix (cut after a special token), checked against the text.
Long prompts are tokenized on a thread pool. Algorithm, params, costs: docs/plugins/tokenization.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from hashlib import blake2b
from importlib import import_module
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvgate.middleware.framework.errors import ConfigError
from kvgate.middleware.framework.plugin import DataProducer, Lifecycle, Plugin, PluginLookup
from kvgate.middleware.framework.types import (
    ChatPrompt,
    CycleState,
    Endpoint,
    InferenceRequest,
    TextPrompt,
    TokenPrompt,
)
from kvgate.plugins.common.state import TOKEN_IDS, TOKEN_IDS_INEXACT

log = logging.getLogger("kvgate.tokenization")

TOKENIZER_GROUP = "kvgate.tokenizers"
Messages = Sequence[Mapping[str, Any]]
_PROBES: tuple[tuple[str, ...], ...] = (
    ("You are terse.", "Hello there, how are you?", " Fine, thanks!", "Tell me 3 jokes."),
    ("Sys", "a", "b c", "12345 six"),
)


class TokenizationError(ValueError):
    """The prompt cannot be tokenized (bad messages for the template, odd content)."""


class TokenizerBackend(Protocol):
    """What the producer needs from a tokenizer."""

    #: Strings the tokenizer always cuts text at (text on each side is tokenized alone).
    boundaries: tuple[str, ...]

    def encode(self, text: str, add_special_tokens: bool) -> Sequence[int]: ...

    def render_chat(
        self, messages: Messages, add_generation_prompt: bool, extra: Mapping[str, Any]
    ) -> str: ...


class ModuleBackend:
    """Adapts an object with ``tokenize``/``render_chat`` (e.g. the simulator's tokenizer)."""

    def __init__(self, obj: Any) -> None:
        if not all(callable(getattr(obj, a, None)) for a in ("tokenize", "render_chat")):
            raise ConfigError(f"{obj!r} has no tokenize() and render_chat()")
        self._obj = obj
        self.boundaries = tuple(str(s) for s in getattr(obj, "SPECIAL_TOKENS", ()))
        pseudo = getattr(obj, "PSEUDO_TOKENS", None)
        #: Why these ids are not the engine's (a pseudo-tokenizer), or None.
        self.inexact: str | None = str(pseudo) if pseudo else None
        #: False when the module says its work is cheaper than a thread hop (``INLINE = True``).
        self.offload = not getattr(obj, "INLINE", False)

    def encode(self, text: str, add_special_tokens: bool) -> Sequence[int]:
        try:
            ids = self._obj.tokenize(text)
            return ids if isinstance(ids, array) else list(ids)
        except (ValueError, TypeError) as exc:
            raise TokenizationError(str(exc)) from None

    def render_chat(
        self, messages: Messages, add_generation_prompt: bool, extra: Mapping[str, Any]
    ) -> str:
        try:
            return str(self._obj.render_chat(messages, add_generation_prompt))
        except (ValueError, TypeError, KeyError) as exc:
            raise TokenizationError(str(exc)) from None


def _token_text(value: object) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class HfBackend:
    """``tokenizer.json`` + chat template of a Hugging Face model folder (no transformers)."""

    def __init__(self, model_dir: Path, chat_template: Path | None = None) -> None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        path = model_dir / "tokenizer_config.json"
        config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        self._vars = {
            name: _token_text(config.get(name)) or ""
            for name in ("bos_token", "eos_token", "pad_token", "unk_token")
        }
        source = (chat_template.read_text(encoding="utf-8") if chat_template is not None
                  else _chat_template_source(model_dir, config))
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True,
            extensions=["jinja2.ext.loopcontrols", _generation_extension()],
        )
        env.globals["raise_exception"] = _raise_template_error
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False,
                                                                   indent=indent)
        self._template = None if source is None else env.from_string(source)
        self.boundaries = tuple(
            t.content for t in self._tok.get_added_tokens_decoder().values()
            if t.special and not (t.lstrip or t.rstrip or t.single_word or t.normalized)
        )

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # ``encode_batch``, not ``encode``: tokenizers' ``encode`` holds the GIL for the whole
        # call (a 10k-token prompt: ~20 ms during which the event loop cannot run, even with
        # the call on a worker thread); ``encode_batch`` releases it. Same ids, ~8 % slower.
        batch = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)
        ids: list[int] = batch[0].ids
        return ids

    def render_chat(
        self, messages: Messages, add_generation_prompt: bool, extra: Mapping[str, Any]
    ) -> str:
        from jinja2 import TemplateError

        if self._template is None:
            raise TokenizationError("the model folder has no chat template")
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                **{**self._vars, **extra},
            )
        except (TemplateError, TypeError, ValueError) as exc:
            raise TokenizationError(f"chat template: {exc}") from None


def _chat_template_source(model_dir: Path, config: Mapping[str, Any]) -> str | None:
    path = model_dir / "chat_template.jinja"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    tpl = config.get("chat_template")
    if isinstance(tpl, list):  # named templates: prefer "default"
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default", next(iter(named.values()), None))
    return tpl if isinstance(tpl, str) else None


def _raise_template_error(message: str) -> None:
    from jinja2 import TemplateError

    raise TemplateError(message)


def _generation_extension() -> type:
    """Accepts transformers' ``{% generation %}...{% endgeneration %}`` (renders the body)."""
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.parser import Parser

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser: Parser) -> nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    return Generation


class ChatPrefixCache:
    """Token ids of rendered chat prefixes by message-list hash; LRU bounded by token count
    (ids as ``array('I')``, 4 bytes each; an entry over the whole capacity is not kept).
    Thread-safe: tokenization may run on the producer's thread pool."""

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_tokens = capacity_tokens
        self._entries: OrderedDict[bytes, tuple[int, int, array[int]]] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: bytes) -> tuple[int, int, array[int]] | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def put(self, key: bytes, split: int, text_hash: int, ids: array[int]) -> None:
        if len(ids) > self.capacity_tokens:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._tokens -= len(old[2])
            self._entries[key] = (split, text_hash, ids)
            self._tokens += len(ids)
            while self._tokens > self.capacity_tokens:
                _, (_, _, dropped) = self._entries.popitem(last=False)
                self._tokens -= len(dropped)

    def __len__(self) -> int:
        return len(self._entries)


def message_prefix_keys(messages: Messages, context: Mapping[str, Any]) -> list[bytes]:
    """``keys[k]`` identifies ``messages[:k]`` rendered under ``context`` (k = 0..len)."""
    h = blake2b(json.dumps(context, sort_keys=True, default=str).encode(), digest_size=16)
    keys = [h.digest()]
    for message in messages:
        h.update(json.dumps(message, sort_keys=True, separators=(",", ":"), default=str).encode())
        keys.append(h.digest())
    return keys


def last_boundary_end(
    text: str, pattern: re.Pattern[str] | None, start: int, end: int | None = None
) -> int:
    """End of the last boundary-token occurrence in ``text[start:end]`` (``start`` if none)."""
    end = len(text) if end is None else end
    if pattern is None:
        return start
    window = 512
    while True:
        lo = max(start, end - window)
        ends = [m.end() for m in pattern.finditer(text, lo, end)]
        if ends:
            return ends[-1]
        if lo == start:
            return start
        window *= 8


def generation_suffix(backend: TokenizerBackend) -> str:
    """What ``add_generation_prompt`` appends to a rendered chat ("" if it is not a suffix)."""
    probe = [{"role": "user", "content": "x"}]
    try:
        with_gen = backend.render_chat(probe, True, {})
        without = backend.render_chat(probe, False, {})
    except TokenizationError:
        return ""
    return with_gen[len(without):] if with_gen.startswith(without) else ""


@dataclass
class ChatTokenizer:
    """Chat tokenization with the prefix cache for one backend (see the module docstring)."""

    backend: TokenizerBackend
    cache: ChatPrefixCache | None

    def __post_init__(self) -> None:
        marks = sorted(set(self.backend.boundaries), key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, marks))) if marks else None
        self._gen_suffix = generation_suffix(self.backend) if self.cache is not None else ""
        #: Whether large prompts go to the thread pool (the backend does not say it is cheaper
        #: inline), and why its ids are not the engine's (None: they are): read per request.
        self.offloads = getattr(self.backend, "offload", True) is not False
        inexact = getattr(self.backend, "inexact", None)
        self.inexact: str | None = str(inexact) if inexact else None

    def tokenize(self, messages: Messages, gen: bool, extra: Mapping[str, Any]) -> Sequence[int]:
        text = self.backend.render_chat(messages, gen, extra)
        if self.cache is None or self._pattern is None:
            return self.backend.encode(text, False)
        keys = message_prefix_keys(messages, extra)
        start, base = self._lookup(keys, text)
        # Cut before the generation prompt: the next turn has the assistant's reply there.
        end = len(text)
        if gen and self._gen_suffix and text.endswith(self._gen_suffix):
            end = max(start, end - len(self._gen_suffix))
        split = last_boundary_end(text, self._pattern, start, end)
        head = array("I", base)
        head.extend(self.backend.encode(text[start:split], False))
        self.cache.put(keys[-1], split, hash(text[:split]), head)
        return [*head, *self.backend.encode(text[split:], False)]

    def _lookup(self, keys: Sequence[bytes], text: str) -> tuple[int, array[int]]:
        assert self.cache is not None
        for key in reversed(keys):  # longest message-list prefix first
            entry = self.cache.get(key)
            if entry is not None and entry[0] <= len(text) and hash(text[: entry[0]]) == entry[1]:
                self.cache.hits += 1
                return entry[0], entry[2]
        self.cache.misses += 1
        return 0, array("I")

    def self_check(self) -> bool:
        """Whether split tokenization equals whole tokenization on probe conversations."""
        if self.cache is None:
            return True
        for contents in _PROBES:
            roles = ["system"] + ["user", "assistant"] * len(contents)
            msgs = [{"role": r, "content": c} for r, c in zip(roles, contents, strict=False)]
            for n in range(1, len(msgs) + 1):
                whole = self.backend.encode(self.backend.render_chat(msgs[:n], True, {}), False)
                if self.tokenize(msgs[:n], True, {}) != whole:
                    return False
        return True


class TokenizerSpec(BaseModel):
    """One tokenizer: ``hf`` with ``model_dir``, or ``module`` with ``module``."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["hf", "module"]
    #: hf: folder holding tokenizer.json (and tokenizer_config.json / chat_template.jinja).
    model_dir: str | None = None
    #: hf: a Jinja chat template file used instead of the folder's (the engine's
    #: ``--chat-template``: the gateway must render chats with the same template).
    chat_template: str | None = None
    #: module: entry-point name in group kvgate.tokenizers, or a dotted import path.
    module: str | None = None

    @model_validator(mode="after")
    def _check(self) -> TokenizerSpec:
        needed = "model_dir" if self.kind == "hf" else "module"
        if getattr(self, needed) is None:
            raise ValueError(f"kind {self.kind!r} needs {needed}")
        if self.chat_template is not None and self.kind != "hf":
            raise ValueError("chat_template is for kind 'hf' (a module renders chats itself)")
        return self


def load_backend(spec: TokenizerSpec) -> TokenizerBackend:
    """Build a backend (reads files / imports modules: call at startup, off the event loop)."""
    if spec.kind == "hf":
        assert spec.model_dir is not None
        template = None if spec.chat_template is None else Path(spec.chat_template)
        return HfBackend(Path(spec.model_dir), template)
    assert spec.module is not None
    name, _, attr = spec.module.partition(":")
    found = [ep for ep in entry_points(group=TOKENIZER_GROUP) if ep.name == spec.module]
    try:
        obj: Any = found[0].load() if found else import_module(name)
    except ImportError as exc:
        raise ConfigError(f"tokenizer module {spec.module!r}: {exc}") from None
    if attr and not found:
        obj = getattr(obj, attr, None)
    return ModuleBackend(obj)


@dataclass(slots=True)
class TokenizationStats:
    requests: int = 0
    passthrough: int = 0
    tokenized: int = 0
    offloaded: int = 0
    failures: int = 0
    no_tokenizer: int = 0


class Tokenizer(Plugin, DataProducer, Lifecycle):
    """Plugin ``tokenizer``: produces TOKEN_IDS (see the module docstring and
    docs/plugins/tokenization.md). Also sets ``req.prompt_token_estimate`` to the exact count."""

    type_name: ClassVar[str] = "tokenizer"
    produces: ClassVar[frozenset[str]] = frozenset({TOKEN_IDS.name, TOKEN_IDS_INEXACT.name})

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)
        #: Tokenizer for every model not in ``models`` (None: only token-id prompts).
        tokenizer: TokenizerSpec | None = None
        #: Per served model name.
        models: dict[str, TokenizerSpec] = Field(default_factory=dict)
        #: Bodies of at least this many bytes are tokenized off the event loop. Measured cost is
        #: 0.07-0.55 us per character (docs), so 4,096 chars is 0.3-2.2 ms of work, 3-20x a
        #: thread hop (~0.1 ms); smaller prompts are cheaper to tokenize inline.
        offload_min_chars: int = Field(4_096, ge=0)
        #: Threads of the tokenization pool (HF tokenizers release the GIL while encoding).
        threads: int = Field(2, ge=1, le=64)
        #: Token ids kept by the chat-prefix cache per tokenizer (4 bytes each: 16 MiB).
        cache_tokens: int = Field(4_000_000, ge=0)

    example_params: ClassVar[Mapping[str, object]] = {
        "tokenizer": {"kind": "module", "module": "kvgate.engines.sim.core.tokenizer"}
    }

    def __init__(self, name: str, params: BaseModel, plugins: PluginLookup) -> None:
        super().__init__(name, params, plugins)
        assert isinstance(params, Tokenizer.Params)
        self.p = params
        self.stats = TokenizationStats()
        #: The built tokenizer of each model in ``models``, and of every other model (set at
        #: start: one dict lookup per request; a frozen pydantic spec as the key would hash in
        #: Python, its fields' tuple, on each lookup).
        self._by_model: dict[str, ChatTokenizer | None] = {}
        self._default: ChatTokenizer | None = None
        self._pool: ThreadPoolExecutor | None = None
        for spec in (self.p.tokenizer, *self.p.models.values()):
            if spec is not None and spec.kind == "hf":
                paths = [Path(spec.model_dir or "") / "tokenizer.json"]
                paths += [Path(spec.chat_template)] if spec.chat_template is not None else []
                for path in paths:
                    if not path.is_file():
                        raise ConfigError(f"tokenizer: {path} does not exist")

    async def start(self) -> None:
        given = [s for s in (self.p.tokenizer, *self.p.models.values()) if s is not None]
        built: dict[TokenizerSpec, ChatTokenizer] = {}  # equal specs: built once
        for spec in given:
            if spec not in built:
                built[spec] = await asyncio.to_thread(self._build, spec)
        self._by_model = {model: built[spec] for model, spec in self.p.models.items()}
        self._default = None if self.p.tokenizer is None else built[self.p.tokenizer]
        self._pool = ThreadPoolExecutor(self.p.threads, thread_name_prefix="kvgate-tokenize")

    def _build(self, spec: TokenizerSpec) -> ChatTokenizer:
        try:
            backend = load_backend(spec)
        except Exception as exc:  # tokenizers raises bare Exception for unreadable files
            raise ConfigError(f"plugin {self.name!r}: cannot load tokenizer {spec}: {exc}") from exc
        if not self.p.cache_tokens:
            return ChatTokenizer(backend, None)
        if not ChatTokenizer(backend, ChatPrefixCache(self.p.cache_tokens)).self_check():
            log.warning("tokenizer %s: split tokenization differs; prefix cache disabled", spec)
            return ChatTokenizer(backend, None)
        return ChatTokenizer(backend, ChatPrefixCache(self.p.cache_tokens))  # probes left out

    async def stop(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def chat_tokenizer(self, model: str) -> ChatTokenizer | None:
        """The built tokenizer of ``model`` (None before start, or for no tokenizer)."""
        return self._by_model.get(model, self._default)

    async def prepare(
        self, req: InferenceRequest, state: CycleState, eps: Sequence[Endpoint]
    ) -> None:
        stats = self.stats
        stats.requests += 1
        prompt = req.prompt
        if isinstance(prompt, TokenPrompt):  # a client's token ids are the engine's own
            stats.passthrough += 1
            _put(req, state, prompt.ids, None)
            return
        if prompt is None:
            return
        chat = self._by_model.get(req.model, self._default)
        if chat is None:
            stats.no_tokenizer += 1
            return
        try:
            if (chat.offloads and self._pool is not None
                    and _text_size(req) >= self.p.offload_min_chars):
                ids = await self._offloaded(partial(_tokenize, chat, prompt))
            else:
                ids = _tokenize(chat, prompt)
        except TokenizationError as exc:
            stats.failures += 1
            log.debug("request %s: not tokenized: %s", req.request_id, exc)
            return
        stats.tokenized += 1
        _put(req, state, ids, chat.inexact)

    async def _offloaded(self, work: Callable[[], Sequence[int]]) -> Sequence[int]:
        """``work`` on the tokenization pool (a large prompt with a tokenizer that releases the
        GIL); smaller ones run inline, without a coroutine of their own."""
        assert self._pool is not None
        self.stats.offloaded += 1
        return await asyncio.get_running_loop().run_in_executor(self._pool, work)


def _put(req: InferenceRequest, state: CycleState, ids: Sequence[int],
         inexact: str | None) -> None:
    """The ids into the cycle state (and their count into the request's estimate)."""
    state.put(TOKEN_IDS, ids if isinstance(ids, (tuple, array)) else tuple(ids))
    req.prompt_token_estimate = len(ids)
    if inexact is not None:
        state.put(TOKEN_IDS_INEXACT, inexact)


def _tokenize(chat: ChatTokenizer, prompt: TextPrompt | ChatPrompt) -> Sequence[int]:
    """The prompt (any API: the adapter's view of it) tokenized with ``chat``."""
    if isinstance(prompt, TextPrompt):
        return chat.backend.encode(prompt.text, prompt.add_special_tokens)
    messages = list(prompt.messages)
    extra = _template_extra(prompt)
    if prompt.add_special_tokens or prompt.continue_final_message:
        return _tokenize_plain(chat.backend, messages, extra, prompt)
    return chat.tokenize(messages, prompt.add_generation_prompt, extra)


#: The template extras of a prompt with no tools and no template arguments (most): one shared
#: empty dict, read-only by its type (backends copy extras, never change them; a plain dict, so
#: the prefix cache's context key is the same ``{}`` as for any other empty extras).
_NO_EXTRA: Mapping[str, Any] = {}


def _template_extra(prompt: ChatPrompt) -> Mapping[str, Any]:
    if prompt.tools is None and not prompt.template_kwargs:
        return _NO_EXTRA
    extra: dict[str, Any] = {} if prompt.tools is None else {"tools": prompt.tools}
    extra.update(prompt.template_kwargs)
    return extra


def _tokenize_plain(
    backend: TokenizerBackend, messages: Messages, extra: Mapping[str, Any], prompt: ChatPrompt,
) -> Sequence[int]:
    """Uncached path: special tokens added by the tokenizer, or the final message continued."""
    gen = prompt.add_generation_prompt and not prompt.continue_final_message
    text = backend.render_chat(messages, gen, extra)
    if prompt.continue_final_message:
        last = _token_text(messages[-1]) if messages else None
        cut = text.rfind(last) if last else -1
        text = text[: cut + len(last)] if last and cut >= 0 else text
    return backend.encode(text, prompt.add_special_tokens)


def _text_size(req: InferenceRequest) -> int:
    """Characters to tokenize, estimated cheaply (the body size bounds it)."""
    return len(req.raw_body) if req.raw_body is not None else req.prompt_token_estimate * 4
