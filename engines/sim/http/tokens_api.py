"""Token utilities as vLLM 0.32 serves them: ``POST /tokenize``, ``/detokenize``,
``/v1/embeddings`` (a pooling engine only) and the render API (``/v1/chat/completions/render``,
``/v1/messages/render``, ``/v1/responses/render``; vLLM's ``--enable-scale-out``).

* ``/tokenize``: ``{"count", "max_model_len", "tokens", "token_strs"}``; a ``prompt`` gets
  ``<|begin_of_text|>`` first unless ``add_special_tokens: false`` (vLLM's default; the
  simulator's own ``/v1/completions`` adds none), ``messages`` are rendered with the chat
  template (``add_generation_prompt`` default true).
* ``/detokenize``: ``{"prompt": text}``. The simulator's hashed vocabulary cannot be inverted:
  special ids give their text, other ids ``<tok_N>``; ids outside the vocabulary are dropped
  (vLLM answers ``""`` for them).
* ``/v1/embeddings``: one unit vector of :data:`EMBED_DIM` floats per input, a deterministic
  function of its ids; usage ``{"prompt_tokens", "total_tokens", "completion_tokens": 0,
  "prompt_tokens_details": null, "completion_tokens_details": null}`` (text gets
  ``<|begin_of_text|>``). No prefix cache, no engine time.
* render: vLLM's ``GenerateRequest``: the exact ``token_ids`` the engine would prefill and the
  sampling parameters.
"""

from __future__ import annotations

import base64
import random
import secrets
import struct
import time
from collections.abc import Callable, Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvgate.engines.sim.core.config import SimConfig
from kvgate.engines.sim.core.tokenizer import (
    SPECIAL_TOKENS,
    VOCAB_TOTAL,
    TemplateError,
    chat_token_ids,
    render_chat,
    split_pieces,
)
from kvgate.engines.sim.http.agent_common import (
    Field,
    check_fields,
    output_limit,
    read_body,
    resolve_model,
)
from kvgate.engines.sim.http.messages_api import parse_messages
from kvgate.engines.sim.http.protocol import ApiError, check_cache_salt, completion_prompt_ids
from kvgate.engines.sim.http.responses_api import ResponseStore, new_response_id, parse_responses

#: Embedding width (the tiny test model's hidden size).
EMBED_DIM = 256
_BOS = SPECIAL_TOKENS["<|begin_of_text|>"]
_SPECIAL_TEXT = {v: k for k, v in SPECIAL_TOKENS.items()}
_TOKENIZE_FIELDS = (Field("model", "str"), Field("prompt", "str|list"), Field("messages", "list"),
                    Field("add_special_tokens", "bool"), Field("add_generation_prompt", "bool"),
                    Field("return_token_strs", "bool"))
_DETOKENIZE_FIELDS = (Field("model", "str"), Field("tokens", "list", True))
_EMBED_FIELDS = (Field("model", "str"), Field("input", "str|list", True),
                 Field("encoding_format", "str"), Field("dimensions", "int"))
_CHAT_FIELDS = (Field("model", "str"), Field("messages", "list", True),
                Field("max_tokens", "int"), Field("max_completion_tokens", "int"),
                Field("temperature", "number"))
_SCALE_OUT_OFF = ("Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out "
                  "to enable them.")


def token_strs(ids: list[int], text_pieces: list[str]) -> list[str]:
    """Readable token strings: specials by name, regular pieces as written."""
    pieces = iter(text_pieces)
    return [_SPECIAL_TEXT[i] if i in _SPECIAL_TEXT else next(pieces, "") for i in ids]


def _pieces_of(text: str) -> list[str]:
    out: list[str] = []
    for part in _split_special(text):
        if part not in SPECIAL_TOKENS:
            out.extend(split_pieces(part))
    return out


def _split_special(text: str) -> list[str]:
    parts, rest = [], text
    while rest:
        hits = [(rest.find(s), s) for s in SPECIAL_TOKENS if s in rest]
        if not hits:
            parts.append(rest)
            break
        at, special = min(hits)
        parts.extend([rest[:at], special])
        rest = rest[at + len(special):]
    return [p for p in parts if p]


def tokenize_body(body: Any, config: SimConfig) -> dict[str, Any]:
    """``/tokenize``: a ``prompt`` or chat ``messages``."""
    body = check_fields(body, _TOKENIZE_FIELDS)
    resolve_model(body.get("model"), config.served_model_names)
    try:
        if body.get("messages") is not None:
            ids = chat_token_ids(body["messages"], body.get("add_generation_prompt", True))
            text = _render_text(body)
        else:
            ids = completion_prompt_ids(body.get("prompt"))
            text = body["prompt"] if isinstance(body.get("prompt"), str) else ""
            if body.get("add_special_tokens", True):
                ids, text = [_BOS, *ids], "<|begin_of_text|>" + text
    except TemplateError as exc:
        raise ApiError(400, str(exc), "messages") from None
    strs = token_strs(ids, _pieces_of(text)) if body.get("return_token_strs") else None
    return {"count": len(ids), "max_model_len": config.effective_max_model_len, "tokens": ids,
            "token_strs": strs}


def _render_text(body: Mapping[str, Any]) -> str:
    return render_chat(body["messages"], body.get("add_generation_prompt", True))


def detokenize_body(body: Any, config: SimConfig) -> dict[str, Any]:
    body = check_fields(body, _DETOKENIZE_FIELDS)
    resolve_model(body.get("model"), config.served_model_names)
    out = []
    for tok in body["tokens"]:
        if not isinstance(tok, int) or not 0 <= tok < VOCAB_TOTAL:
            continue
        out.append(_SPECIAL_TEXT.get(tok, f"<tok_{tok}>"))
    return {"prompt": "".join(out)}


def embedding(ids: list[int]) -> list[float]:
    """A unit vector, deterministic in the ids."""
    rng = random.Random(_seed(ids))
    vec = [rng.gauss(0.0, 1.0) for _ in range(EMBED_DIM)]
    norm = sum(v * v for v in vec) ** 0.5 or 1.0
    return [v / norm for v in vec]


def _seed(ids: list[int]) -> int:
    seed = 0
    for tok in ids:
        seed = (seed * 1_000_003 + tok) & 0xFFFFFFFFFFFF
    return seed


def _embed_inputs(value: Any) -> list[list[int]]:
    if isinstance(value, str):
        return [[_BOS, *completion_prompt_ids(value)]]
    if value and all(isinstance(v, str) for v in value):
        return [[_BOS, *completion_prompt_ids(v)] for v in value]
    if value and all(isinstance(v, list) for v in value):
        return [completion_prompt_ids(v) for v in value]
    return [completion_prompt_ids(value)]


def embeddings_body(body: Any, config: SimConfig) -> dict[str, Any]:
    """``/v1/embeddings`` (vLLM's unknown-model message here has no alias list, param null)."""
    body = check_fields(body, _EMBED_FIELDS)
    check_cache_salt(body.get("cache_salt"))
    model = body.get("model") or config.model_name
    if model not in config.served_model_names:
        raise ApiError(404, f"The model `{model}` does not exist.")
    inputs = _embed_inputs(body["input"])
    b64 = body.get("encoding_format") == "base64"
    data = [{"index": i, "object": "embedding", "embedding": _encode(embedding(ids), b64)}
            for i, ids in enumerate(inputs)]
    n = sum(len(ids) for ids in inputs)
    return {"id": "embd-" + secrets.token_hex(8), "object": "list", "created": int(time.time()),
            "model": model, "data": data,
            "usage": {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0,
                      "prompt_tokens_details": None, "completion_tokens_details": None}}


def _encode(vec: list[float], b64: bool) -> list[float] | str:
    if not b64:
        return vec
    return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()


def _sampling_params(max_tokens: int, temperature: float, responses: bool) -> dict[str, Any]:
    """vLLM's dump: ``top_p``/``min_p`` only when sampling (not greedy), ``extra_args`` from
    the Responses route."""
    params: dict[str, Any] = {"presence_penalty": 0.0, "frequency_penalty": 0.0,
                              "repetition_penalty": 1.0, "temperature": temperature}
    if temperature > 0:
        params |= {"top_p": 1.0, "min_p": 0.0}
    params |= {"stop": [], "stop_token_ids": [], "max_tokens": max_tokens, "output_kind": 2,
               "skip_clone": True}
    if responses:
        params["extra_args"] = {}
    return params | {"bad_words": [], "skip_reading_prefix_cache": False}


def generate_request(request_id: str, model: str, ids: list[int], max_tokens: int,
                     temperature: float, cache_salt: Any) -> dict[str, Any]:
    """vLLM's ``GenerateRequest`` as the render API answers it."""
    params = _sampling_params(max_tokens, temperature, request_id.startswith("resp_"))
    return {"request_id": request_id, "token_ids": ids, "token_offsets": None, "features": None,
            "content_parts": None, "sampling_params": params, "model": model,
            "reasoning_ended": None, "reasoning_parser_kwargs": None, "return_token_ids": None,
            "output_mode": "tokens", "stream": False, "stream_options": None,
            "cache_salt": cache_salt, "priority": 0, "kv_transfer_params": None,
            "ec_transfer_params": None}


class TokensApi:
    """Route handlers of the token utilities, bound to one engine's config and store."""

    def __init__(self, config: SimConfig, store: ResponseStore) -> None:
        self.config = config
        self.store = store

    def routes(self) -> list[Route]:
        routes = [Route("/tokenize", self._json(tokenize_body), methods=["POST"]),
                  Route("/detokenize", self._json(detokenize_body), methods=["POST"])]
        if self.config.runner == "pooling":
            return [*routes, Route("/v1/embeddings", self._json(embeddings_body),
                                   methods=["POST"])]
        return [*routes,
                Route("/v1/chat/completions/render", self.render_chat, methods=["POST"]),
                Route("/v1/messages/render", self.render_messages, methods=["POST"]),
                Route("/v1/responses/render", self.render_responses, methods=["POST"])]

    def _json(self, fn: Callable[[Any, SimConfig], dict[str, Any]]) -> Any:
        async def handler(request: Request) -> Response:
            try:
                return JSONResponse(fn(await read_body(request), self.config))
            except ApiError as exc:
                return JSONResponse(exc.body(), exc.status)
        return handler

    def _scale_out(self) -> None:
        if not self.config.enable_scale_out:
            raise ApiError(403, _SCALE_OUT_OFF)

    async def render_chat(self, request: Request) -> Response:
        try:
            self._scale_out()
            body = check_fields(await read_body(request), _CHAT_FIELDS)
            check_cache_salt(body.get("cache_salt"))  # vLLM renders a ChatCompletionRequest
            model = resolve_model(body.get("model"), self.config.served_model_names)
            try:
                ids = chat_token_ids(body["messages"])
            except TemplateError as exc:
                raise ApiError(400, str(exc), "messages") from None
            asked = body.get("max_completion_tokens") or body.get("max_tokens")
            limit = output_limit("max_tokens", asked, len(ids),
                                 self.config.effective_max_model_len)
            return JSONResponse(generate_request(
                "chatcmpl-" + secrets.token_hex(8), model, ids, limit,
                float(body.get("temperature", 1.0)), body.get("cache_salt")))
        except ApiError as exc:
            return JSONResponse(exc.body(), exc.status)

    async def render_messages(self, request: Request) -> Response:
        """Errors in the OpenAI shape, as vLLM's render router answers them."""
        try:
            self._scale_out()
            body = await read_body(request)
            req = parse_messages(body, self.config)
            return JSONResponse(generate_request(
                "chatcmpl-" + secrets.token_hex(8), req.model, req.prompt_ids, req.max_tokens,
                float(body.get("temperature", 1.0)), req.cache_salt))
        except ApiError as exc:
            return JSONResponse(exc.body(), exc.status)

    async def render_responses(self, request: Request) -> Response:
        try:
            self._scale_out()
            rr = parse_responses(await read_body(request), self.config, self.store)
            temperature = float(rr.body.get("temperature", 1.0))
            return JSONResponse(generate_request(
                new_response_id(), rr.req.model, rr.req.prompt_ids, rr.req.max_tokens,
                temperature, rr.req.cache_salt))
        except ApiError as exc:
            return JSONResponse(exc.body(), exc.status)

