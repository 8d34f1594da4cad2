"""Tokenization producer (plugin ``tokenizer``): writes TOKEN_IDS the way the engine tokenizes.

Token-id prompts pass through; text prompts are encoded with special tokens (vLLM's completions
default); chats are rendered by the chat template, then encoded without (vLLM's chat default).
Backends (plugins/prefix/tokenizer_backends.py): ``hf`` (``tokenizer.json`` via ``tokenizers`` + a
jinja2 chat template, no transformers) or ``module`` (``tokenize``/``render_chat`` functions
named by an entry point of group ``kvgate.tokenizers`` or a dotted path). A growing chat encodes
only what its turn appended (plugins/prefix/chat_prefix.py: the longest cached rendering that is a
prefix of its text). Long work is tokenized on a thread pool, a bounded number at a time: for a
cached chat, only the encoding of what is new, after the rendering and the lookup on the loop.
Algorithm, params, costs: docs/plugins/tokenization.md.
"""

from __future__ import annotations

import asyncio
import logging
from array import array
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, ClassVar, TypeGuard

from pydantic import BaseModel, ConfigDict, Field

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
from kvgate.plugins.prefix.chat_prefix import (
    DEFAULT_MAX_BYTES,
    ChatCacheStats,
    ChatPrefixCache,
    ChatTokenizer,
    boundary_ends,
    last_boundary_end,
)
from kvgate.plugins.prefix.tokenizer_backends import (
    TOKENIZER_GROUP,
    HfBackend,
    Messages,
    ModuleBackend,
    TokenizationError,
    TokenizerBackend,
    TokenizerSpec,
    _token_text,
    generation_suffix,
    load_backend,
)

log = logging.getLogger("kvgate.tokenization")

__all__ = [
    "TOKENIZER_GROUP", "ChatCacheStats", "ChatPrefixCache", "ChatTokenizer", "HfBackend",
    "ModuleBackend", "TokenizationError", "TokenizationStats", "Tokenizer", "TokenizerBackend",
    "TokenizerSpec", "boundary_ends", "generation_suffix", "last_boundary_end", "load_backend",
]


@dataclass(slots=True)
class TokenizationStats:
    requests: int = 0
    passthrough: int = 0
    tokenized: int = 0
    offloaded: int = 0
    failures: int = 0
    no_tokenizer: int = 0
    #: Offloaded prompts that waited for a pool slot (``max_in_flight`` were in flight), and the
    #: offloaded prompts in flight now (queued or running on the pool).
    waited: int = 0
    in_flight: int = 0


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
        #: Work of at least this many characters is tokenized off the event loop: for a chat
        #: served by the chat-prefix cache, the characters after its cached prefix (rendering
        #: and the lookup run on the loop); else the body's bytes. Measured cost is 0.07-0.55 us
        #: per character (docs), so 4,096 chars is 0.3-2.2 ms of work, 3-20x a thread hop
        #: (~0.1 ms); less is cheaper to tokenize inline.
        offload_min_chars: int = Field(4_096, ge=0)
        #: Threads of the tokenization pool (HF tokenizers release the GIL while encoding).
        threads: int = Field(2, ge=1, le=64)
        #: Offloaded prompts queued or running on the pool at once; more wait (on the event
        #: loop, without blocking it) for a slot. 64: a few hundred ms of work at 100k-token
        #: misses, and a bound on the memory their texts hold while queued.
        max_in_flight: int = Field(64, ge=1)
        #: Bytes held by the chat-prefix cache per tokenizer (rendered text + 4-byte ids +
        #: marks; 128 MiB: ~170 agent sessions at 100k tokens); 0 disables it.
        cache_bytes: int = Field(DEFAULT_MAX_BYTES, ge=0)

    example_params: ClassVar[Mapping[str, object]] = {
        "tokenizer": {"kind": "module", "module": "kvgate.engines.sim.core.tokenizer"}
    }

    def __init__(self, name: str, params: BaseModel, plugins: PluginLookup) -> None:
        super().__init__(name, params, plugins)
        assert isinstance(params, Tokenizer.Params)
        self.p = params
        self.stats = TokenizationStats()
        #: The chat-prefix caches' counters and sizes, all tokenizers together (/metrics).
        self.chat_cache = ChatCacheStats()
        self._slots: asyncio.Semaphore | None = None
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
        self._slots = asyncio.Semaphore(self.p.max_in_flight)

    def _build(self, spec: TokenizerSpec) -> ChatTokenizer:
        try:
            backend = load_backend(spec)
        except Exception as exc:  # tokenizers raises bare Exception for unreadable files
            raise ConfigError(f"plugin {self.name!r}: cannot load tokenizer {spec}: {exc}") from exc
        if not self.p.cache_bytes:
            return ChatTokenizer(backend, None)
        if not ChatTokenizer(backend, ChatPrefixCache(self.p.cache_bytes)).self_check():
            log.warning("tokenizer %s: split tokenization differs; prefix cache disabled", spec)
            return ChatTokenizer(backend, None)
        # probes left out
        return ChatTokenizer(backend, ChatPrefixCache(self.p.cache_bytes, self.chat_cache))

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
            offload = chat.offloads and self._pool is not None
            if offload and _cacheable(prompt):  # rendered and looked up here, encoded there
                plan = chat.plan(list(prompt.messages), prompt.add_generation_prompt,
                                 _template_extra(prompt))
                if plan.new_chars >= self.p.offload_min_chars:
                    ids = await self._offloaded(partial(chat.finish, plan))
                else:
                    ids = chat.finish(plan)
            elif offload and _text_size(req) >= self.p.offload_min_chars:
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
        GIL), at most ``max_in_flight`` at once; smaller ones run inline, without a coroutine
        of their own."""
        assert self._pool is not None and self._slots is not None
        stats = self.stats
        stats.offloaded += 1
        if self._slots.locked():
            stats.waited += 1
        async with self._slots:
            stats.in_flight += 1
            try:
                return await asyncio.get_running_loop().run_in_executor(self._pool, work)
            finally:
                stats.in_flight -= 1


def _put(req: InferenceRequest, state: CycleState, ids: Sequence[int],
         inexact: str | None) -> None:
    """The ids into the cycle state (and their count into the request's estimate)."""
    state.put(TOKEN_IDS, ids if isinstance(ids, (tuple, array)) else tuple(ids))
    req.prompt_token_estimate = len(ids)
    if inexact is not None:
        state.put(TOKEN_IDS_INEXACT, inexact)


def _cacheable(prompt: TextPrompt | ChatPrompt) -> TypeGuard[ChatPrompt]:
    """A chat served through the chat-prefix cache (:meth:`ChatTokenizer.tokenize`)."""
    return isinstance(prompt, ChatPrompt) and not (
        prompt.add_special_tokens or prompt.continue_final_message)


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
