"""Building plugins in unit tests: a lookup that knows nothing, and a constructor that
validates params the way the pipeline does."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from kvgate.apis.openai import ChatCompletions, Completions
from kvgate.middleware.framework.errors import BadRequest
from kvgate.middleware.framework.plugin import Plugin
from kvgate.middleware.framework.types import Prompt


class NoLookup:
    """A plugin lookup that knows nothing."""

    def lookup(self, name: str) -> object:
        raise KeyError(name)


def make_plugin(cls: type[Plugin], **params: Any) -> Any:
    """``cls`` built with validated ``params`` and no other plugins to look up."""
    validated: BaseModel = cls.Params.model_validate(params)
    return cls(cls.type_name, validated, NoLookup())


def prompt_of(api: str, body: dict[str, Any] | None) -> Prompt | None:
    """The prompt the gateway's OpenAI adapter would put on a request with ``body`` (None when
    the body has none, or an invalid one): for requests built by hand in unit tests."""
    adapter = ChatCompletions() if api == "chat" else Completions()
    try:
        return adapter.parse({"model": "m", **(body or {})}, {}).prompt
    except BadRequest:
        return None
