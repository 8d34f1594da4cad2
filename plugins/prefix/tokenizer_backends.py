"""Tokenizer backends of the ``tokenizer`` plugin (plugins/prefix/tokenizer.py): ``hf`` (a Hugging
Face model folder's ``tokenizer.json`` through ``tokenizers`` and its chat template through
jinja2, no transformers) and ``module`` (``tokenize``/``render_chat`` functions of a module);
the spec that names one, and :func:`load_backend`. docs/plugins/tokenization.md.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Mapping, Sequence
from datetime import datetime
from importlib import import_module
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, model_validator

from kvgate.middleware.framework.errors import ConfigError

TOKENIZER_GROUP = "kvgate.tokenizers"
Messages = Sequence[Mapping[str, Any]]


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
        self._encode = getattr(Tokenizer, "encode_batch_fast", Tokenizer.encode_batch)
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
        # ``encode_batch_fast`` (tokenizers >= 0.20) is the same without the character offsets
        # kvgate never reads: same ids, ~30 % less CPU (1.6 KB of code: 0.47 -> 0.33 ms).
        batch = self._encode(self._tok, [text], add_special_tokens=add_special_tokens)
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


def generation_suffix(backend: TokenizerBackend) -> str:
    """What ``add_generation_prompt`` appends to a rendered chat ("" if it is not a suffix)."""
    probe = [{"role": "user", "content": "x"}]
    try:
        with_gen = backend.render_chat(probe, True, {})
        without = backend.render_chat(probe, False, {})
    except TokenizationError:
        return ""
    return with_gen[len(without):] if with_gen.startswith(without) else ""
