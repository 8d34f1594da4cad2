"""KV-transfer connectors for prefill/decode disaggregation (``kvgate.connectors`` entry points).

Each one shapes the two hops of a disaggregated request for one engine protocol; the gateway
(``middleware/disagg.py``) does the I/O. Wire facts: ``../shared/design/PROTOCOLS.md``.

``vllm-nixl`` (sequential) — vLLM's NixlConnector
    Hop 1 to the prefill engine: the client's request with ``stream: false``, ``max_tokens: 1``
    (and ``max_completion_tokens: 1`` for chat), no ``stream_options``, no ``min_tokens``, and
    ``kv_transfer_params = {"do_remote_decode": true, "do_remote_prefill": false,
    "remote_engine_id": null, "remote_block_ids": null, "remote_host": null,
    "remote_port": null}``. Its JSON answer's ``kv_transfer_params`` (``do_remote_prefill``,
    ``remote_block_ids``, ``remote_engine_id``, ``remote_host``/``port``, ...) go verbatim into
    hop 2, the client's own request to the decode engine. A prefill answer without them means
    no transfer: the gateway decodes locally.

``vllm-mooncake`` (concurrent) — vLLM's MooncakeConnector
    Both hops at once with the same ``X-Request-Id``. Prefill: as for NIXL, with
    ``kv_transfer_params = {"do_remote_decode": true, "do_remote_prefill": false,
    "transfer_id": <request id>}``. Decode: the client's request with ``kv_transfer_params =
    {"do_remote_prefill": true, "do_remote_decode": false, "transfer_id": <request id>,
    <host_key>: <prefill bootstrap host>, <port_key>: <bootstrap port>}``.

``sglang`` (concurrent) — SGLang's PD disaggregation
    Both hops get the client's request plus ``bootstrap_host``, ``bootstrap_port`` and
    ``bootstrap_room`` (random in [0, 2^63 - 1], shared by both); the prefill hop is sent
    non-streaming (its answer is only read for its cache hit), decode streams as asked.

Bootstrap address (concurrent connectors): the prefill engine's ``bootstrap_host`` /
``bootstrap_port`` labels (config ``engines[].labels``), else the host of its URL and
``bootstrap_port`` (8998: the default of both SGLang's ``--disaggregation-bootstrap-port`` and
vLLM's ``VLLM_MOONCAKE_BOOTSTRAP_PORT``).

Cache hit (for the client's usage): the prefill answer's
``usage.prompt_tokens_details.cached_tokens``; for vLLM also
``kv_transfer_params.remote_prefill_cached_tokens`` (0.32). ``decode_reports`` says what the
decode engine's own ``cached_tokens`` means, used only when the prefill hit is unknown.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field

from middleware.connector import (
    DecodeCachedConvention,
    HopContext,
    TransferUnavailable,
    reported_cached,
)
from middleware.types import Api, Endpoint, InferenceRequest

_PREFILL_DROP = ("stream_options", "min_tokens")


class ConnectorParams(BaseModel):
    """Params shared by every connector."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    #: ``prefill-hit``: the decode engine's ``cached_tokens`` already is the prefill's hit
    #: (vLLM >= 0.32); ``transferred``: it counts the received KV too (older vLLM, SGLang).
    #: Only used when the prefill answer reports no hit. Default ``transferred``: when unsure,
    #: report "unknown" rather than a hit that was never computed locally.
    decode_reports: DecodeCachedConvention = "transferred"
    #: Bootstrap port when the prefill engine has no ``bootstrap_port`` label.
    bootstrap_port: int = Field(8998, ge=1, le=65535)


def _one_token_prefill(req: InferenceRequest, body: dict[str, Any]) -> dict[str, Any]:
    """The client's body as a non-streaming, one-token prefill request."""
    out = {k: v for k, v in body.items() if k not in _PREFILL_DROP}
    out["stream"] = False
    out["max_tokens"] = 1
    if req.api is Api.CHAT:
        out["max_completion_tokens"] = 1
    return out


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def bootstrap_address(prefill: Endpoint, default_port: int) -> tuple[str, int]:
    """Where the decode engine reaches the prefill engine's bootstrap server."""
    host = prefill.labels.get("bootstrap_host") or urlsplit(prefill.url).hostname or "127.0.0.1"
    port_label = prefill.labels.get("bootstrap_port", "")
    port = int(port_label) if port_label.isdigit() else default_port
    return host, port


class _Base:
    name: ClassVar[str] = ""
    Params: ClassVar[type[BaseModel]] = ConnectorParams
    concurrent: ClassVar[bool] = False

    def __init__(self, params: BaseModel) -> None:
        assert isinstance(params, ConnectorParams)
        self.params = params
        self.decode_reports: DecodeCachedConvention = params.decode_reports

    def prefill_hit(self, prefill_answer: Mapping[str, Any]) -> int | None:
        hit = reported_cached(prefill_answer)
        if hit is not None:
            return hit
        ktp = prefill_answer.get("kv_transfer_params")
        return _int(ktp.get("remote_prefill_cached_tokens")) if isinstance(ktp, Mapping) else None


class VllmNixlConnector(_Base):
    """``vllm-nixl``: sequential NIXL transfer (module docstring)."""

    name = "vllm-nixl"

    def prefill_body(
        self, req: InferenceRequest, body: dict[str, Any], ctx: HopContext
    ) -> dict[str, Any]:
        out = _one_token_prefill(req, body)
        out["kv_transfer_params"] = {
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None,
        }
        return out

    def decode_body(
        self, req: InferenceRequest, body: dict[str, Any], ctx: HopContext,
        prefill_answer: Mapping[str, Any] | None,
    ) -> dict[str, Any]:
        params = None if prefill_answer is None else prefill_answer.get("kv_transfer_params")
        if not isinstance(params, Mapping):
            raise TransferUnavailable("the prefill answer has no kv_transfer_params")
        return {**body, "kv_transfer_params": dict(params)}


class MooncakeParams(ConnectorParams):
    #: ``kv_transfer_params`` keys naming the prefill side's bootstrap server.
    host_key: str = "bootstrap_server_host"
    port_key: str = "bootstrap_server_port"


class VllmMooncakeConnector(_Base):
    """``vllm-mooncake``: concurrent Mooncake transfer (module docstring)."""

    name = "vllm-mooncake"
    Params = MooncakeParams
    concurrent = True

    def prefill_body(
        self, req: InferenceRequest, body: dict[str, Any], ctx: HopContext
    ) -> dict[str, Any]:
        out = _one_token_prefill(req, body)
        out["kv_transfer_params"] = {
            "do_remote_decode": True, "do_remote_prefill": False, "transfer_id": ctx.request_id,
        }
        return out

    def decode_body(
        self, req: InferenceRequest, body: dict[str, Any], ctx: HopContext,
        prefill_answer: Mapping[str, Any] | None,
    ) -> dict[str, Any]:
        p = self.params
        assert isinstance(p, MooncakeParams)
        host, port = bootstrap_address(ctx.prefill, p.bootstrap_port)
        params = {"do_remote_prefill": True, "do_remote_decode": False,
                  "transfer_id": ctx.request_id, p.host_key: host, p.port_key: port}
        return {**body, "kv_transfer_params": params}


class SglangConnector(_Base):
    """``sglang``: concurrent SGLang bootstrap transfer (module docstring)."""

    name = "sglang"
    concurrent = True

    def _bootstrap(self, ctx: HopContext) -> dict[str, Any]:
        host, port = bootstrap_address(ctx.prefill, self.params.bootstrap_port)
        return {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": ctx.room}

    def prefill_body(
        self, req: InferenceRequest, body: dict[str, Any], ctx: HopContext
    ) -> dict[str, Any]:
        out = {k: v for k, v in body.items() if k != "stream_options"}
        return {**out, "stream": False, **self._bootstrap(ctx)}

    def decode_body(
        self, req: InferenceRequest, body: dict[str, Any], ctx: HopContext,
        prefill_answer: Mapping[str, Any] | None,
    ) -> dict[str, Any]:
        return {**body, **self._bootstrap(ctx)}


class SharedStoreConnector(_Base):
    """``shared-store`` (sequential): engines sharing a KV store (LMCache with a Mooncake Store
    backend). The prefill hop is a one-token request, which computes the prompt's KV and
    stores it (LMCache saves 256-token chunks); the decode hop is the client's request
    unchanged, and the decode engine's LMCache finds the prefix in the store by its hash. No
    transfer parameters exist; the decode engine counts store hits as cached, so the client's
    cached tokens come from the prefill answer."""

    name = "shared-store"

    def prefill_body(
        self, req: InferenceRequest, body: dict[str, Any], ctx: HopContext
    ) -> dict[str, Any]:
        return _one_token_prefill(req, body)

    def decode_body(
        self, req: InferenceRequest, body: dict[str, Any], ctx: HopContext,
        prefill_answer: Mapping[str, Any] | None,
    ) -> dict[str, Any]:
        return body
