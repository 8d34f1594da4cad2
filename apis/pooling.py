"""Passthrough APIs: ``POST /v1/embeddings``, ``POST /tokenize``, ``POST /detokenize``
(``kvgate.apis`` entries ``embeddings``, ``tokenize``, ``detokenize``).

They get what every API gets (auth, the model catalog and allow-lists, routing, metrics,
errors in OpenAI's shape) with nothing to match for prefix routing (``prompt`` None). Embeddings
are billed on their ``usage.prompt_tokens`` (no completion tokens, no stream); tokenize and
detokenize report no usage and are not billed (no ledger record).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from kvgate.apis.openai import (
    OpenAIErrors,
    UsageOnlyTap,
    check_model,
    text_estimate,
    text_prompt,
)
from kvgate.middleware.framework.api import ParsedRequest
from kvgate.middleware.framework.errors import BadRequest


class NoUsageTap(UsageOnlyTap):
    """Answers without usage (tokenize, detokenize)."""

    __slots__ = ()

    def on_json(self, payload: dict[str, Any]) -> None:
        self.final = True


def _no_stream(data: Mapping[str, Any], api: str) -> None:
    if data.get("stream") not in (None, False):
        raise BadRequest(f"{api} does not stream; leave stream out", param="stream")


class _Passthrough(OpenAIErrors):
    disaggregable: ClassVar[bool] = False

    def prepare_body(self, body: dict[str, Any], stream: bool) -> dict[str, Any] | None:
        return None

    def new_tap(self, client_wants_usage: bool) -> UsageOnlyTap:
        return NoUsageTap()


class Embeddings(_Passthrough):
    """``POST /v1/embeddings``: ``input`` a string, strings, token ids or token-id lists."""

    name: ClassVar[str] = "embeddings"
    routes: ClassVar[tuple[tuple[str, str], ...]] = (("POST", "/v1/embeddings"),)

    def parse(self, data: dict[str, Any], headers: Mapping[str, str]) -> ParsedRequest:
        model = check_model(data)
        _no_stream(data, "embeddings")
        if "input" not in data:
            raise BadRequest("input is required", param="input")
        _, estimate = text_prompt(data["input"], "input", True)
        return ParsedRequest(model, False, None, estimate, client_wants_usage=False)

    def new_tap(self, client_wants_usage: bool) -> UsageOnlyTap:
        return UsageOnlyTap()


class Tokenize(_Passthrough):
    """``POST /tokenize`` (vLLM): ``prompt`` text or chat ``messages``."""

    name: ClassVar[str] = "tokenize"
    routes: ClassVar[tuple[tuple[str, str], ...]] = (("POST", "/tokenize"),)
    billed: ClassVar[bool] = False

    def parse(self, data: dict[str, Any], headers: Mapping[str, str]) -> ParsedRequest:
        model = check_model(data)
        _no_stream(data, "tokenize")
        prompt, messages = data.get("prompt"), data.get("messages")
        if isinstance(prompt, str):
            size = len(prompt)
        elif isinstance(messages, list) and messages:
            size = sum(len(str(m.get("content", ""))) for m in messages if isinstance(m, dict))
        else:
            raise BadRequest("prompt (a string) or messages (a non-empty array) is required",
                             param="prompt")
        return ParsedRequest(model, False, None, text_estimate(size), client_wants_usage=False)


class Detokenize(_Passthrough):
    """``POST /detokenize`` (vLLM): ``tokens`` a list of token ids."""

    name: ClassVar[str] = "detokenize"
    routes: ClassVar[tuple[tuple[str, str], ...]] = (("POST", "/detokenize"),)
    billed: ClassVar[bool] = False

    def parse(self, data: dict[str, Any], headers: Mapping[str, str]) -> ParsedRequest:
        model = check_model(data)
        _no_stream(data, "detokenize")
        tokens = data.get("tokens")
        if not isinstance(tokens, list) or any(
                not isinstance(t, int) or isinstance(t, bool) for t in tokens):
            raise BadRequest("tokens must be a list of token ids", param="tokens")
        return ParsedRequest(model, False, None, 1, client_wants_usage=False)
