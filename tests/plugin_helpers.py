"""Building plugins in unit tests: a lookup that knows nothing, and a constructor that
validates params the way the pipeline does."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from middleware.plugin import Plugin


class NoLookup:
    """A plugin lookup that knows nothing."""

    def lookup(self, name: str) -> object:
        raise KeyError(name)


def make_plugin(cls: type[Plugin], **params: Any) -> Any:
    """``cls`` built with validated ``params`` and no other plugins to look up."""
    validated: BaseModel = cls.Params.model_validate(params)
    return cls(cls.type_name, validated, NoLookup())
