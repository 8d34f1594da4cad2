"""Configuration of the simulated engine (:class:`SimConfig`).

Every field has a unit and a default; ``docs/simulator.md`` lists them all. Timing defaults are
calibrated from ``H100_TIMING.md`` (one H100 80GB, a Llama-3.1-8B-shaped model):

* prefill of a whole prompt of n tokens ≈ ``prefill_overhead_s + max(weight_read_s, n *
  prefill_s_per_token) + attention_s_per_pair * n²/2``; least-squares fit of the five measured
  points (512…32,768 tokens → 30…1,408 ms) within 7 %;
* a decode step ≈ ``weight_read_s + kv_read_s_per_token * Σ context`` (16.1 GB of weights and
  131 KB of KV per context token, read at the measured 3.0 TB/s).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

#: Longest context a default engine accepts, in tokens, when ``max_model_len`` is not set (it is
#: also capped by what the KV cache holds). 32k keeps default prompts inside the calibrated range.
DEFAULT_MAX_MODEL_LEN = 32_768


class TimingParams(BaseModel):
    """Cost model of one engine step (see :mod:`kvgate.engines.sim.core.timing`).

    All values in seconds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: Reading every weight once per step: 16.1 GB / 3.0 TB/s ≈ 5.4 ms. Also the floor of the
    #: GEMM time of any step (memory-bound until the batch has ~230 tokens).
    weight_read_s: float = Field(default=5.4e-3, ge=0)
    #: Reading one context token's KV in a step: 131 KB (2 * 32 layers * 8 heads * 128 * 2 B)
    #: / 3.0 TB/s ≈ 0.044 µs. A sequence at 8k context adds ≈ 0.36 ms per decode step.
    kv_read_s_per_token: float = Field(default=4.4e-8, ge=0)
    #: GEMM compute per scheduled token once compute-bound (fit: 23.3 µs ≈ 2 * 8.03 GFLOP at
    #: ~690 TFLOP/s effective).
    prefill_s_per_token: float = Field(default=2.33e-5, ge=0)
    #: Attention compute per (query token, key token) pair over all layers (fit: 1.26 ns,
    #: close to 4 * 4096 * 32 FLOP at 500 TFLOP/s = 1.05 ns). Quadratic in a prompt's length,
    #: linear in a cached prefix's length.
    attention_s_per_pair: float = Field(default=1.26e-9, ge=0)
    #: Fixed cost of a step that runs any prefill chunk (more than one token of a sequence);
    #: the fit's intercept (17 ms: the measured 512-token prefill takes 30 ms).
    prefill_overhead_s: float = Field(default=1.7e-2, ge=0)
    #: Fixed cost of every step (scheduling, launches). 0: decode steps are CUDA-graph replays
    #: and the measured batch-1 decode step (5.5 ms at 2k context) is fully explained without it.
    step_overhead_s: float = Field(default=0.0, ge=0)


class KvEventsConfig(BaseModel):
    """KV-cache event publishing over ZMQ PUB, in vLLM's wire format."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: ZMQ endpoint. With ``*`` (or ``::``, ``ipc://``, ``inproc://``) the engine binds, e.g.
    #: ``tcp://*:5557`` or ``tcp://127.0.0.1:*`` (any free port); otherwise it connects, e.g. to
    #: a gateway's bound SUB socket at ``tcp://127.0.0.1:5557`` (vLLM's rule).
    endpoint: str = Field(min_length=1)
    #: First frame of every message. ``None``: ``kv@<engine_id>@<first served model name>``.
    topic: str | None = None
    #: ``tagged``: events are maps ``{"type": "BlockStored", ...}`` (vLLM ≥ 0.10);
    #: ``positional``: msgspec ``array_like`` arrays ``["BlockStored", field, ...]`` (older).
    encoding: Literal["tagged", "positional"] = "tagged"
    #: Batches (one per engine step) waiting to be sent; past it the oldest is dropped (its
    #: sequence number is then missing on the wire, as a gap subscribers can see).
    queue_limit: int = Field(default=10_000, ge=1)
    #: ZMQ send high-water mark, in messages (vLLM's default is 100,000; PUB drops past it).
    sndhwm: int = Field(default=100_000, ge=1)
    #: The ``data_parallel_rank`` field of each batch.
    data_parallel_rank: int = Field(default=0, ge=0)
    #: ZMQ ROUTER address serving replays of past batches (vLLM's ``replay_endpoint``; always
    #: bound, e.g. ``tcp://127.0.0.1:*``); ``None``: no replay socket.
    replay_endpoint: str | None = None
    #: Past batches kept for replay (vLLM's ``buffer_steps`` default).
    buffer_steps: int = Field(default=10_000, ge=1)


class PdSimConfig(BaseModel):
    """Prefill/decode roles: the KV transfer model (see :mod:`kvgate.engines.sim.core.pd`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: KV bytes per token: 131 KB for the 8B model of the timing calibration (2 * 32 layers *
    #: 8 KV heads * 128 * 2 B), the same figure as ``timing.kv_read_s_per_token``.
    kv_bytes_per_token: int = Field(default=131_072, ge=1)
    #: Effective transfer bandwidth, bytes/s: 25 GB/s, a 200 Gb/s RDMA NIC at full rate (one
    #: 8k-token prompt, 1.07 GB, moves in ≈ 43 ms).
    transfer_bytes_per_s: float = Field(default=25e9, gt=0)
    #: Fixed cost of one transfer (handshake, descriptors), seconds.
    transfer_setup_s: float = Field(default=2e-3, ge=0)
    #: Decode's ``cached_tokens``: ``transferred`` (local hit + received KV, older vLLM) or
    #: ``prefill-hit`` (the prefill side's own hit, vLLM 0.32).
    decode_reports: Literal["transferred", "prefill-hit"] = "transferred"
    #: How long a decode engine waits for a concurrent prefill (vLLM's KV lease is ~30 s).
    wait_timeout_s: float = Field(default=30.0, gt=0)
    #: Finished prefills kept for their decode engine (oldest dropped past it).
    board_limit: int = Field(default=10_000, ge=1)
    #: Prefill role: port of the Mooncake bootstrap server (``/query``, see
    #: :mod:`kvgate.engines.sim.bootstrap`); vLLM's is ``VLLM_MOONCAKE_BOOTSTRAP_PORT``, default
    #: 8998. 0: any free port (tests); ``None``: no bootstrap server.
    bootstrap_port: int | None = Field(default=None, ge=0, le=65535)
    #: Listen address of the bootstrap server.
    bootstrap_host: str = "127.0.0.1"


class SimConfig(BaseModel):
    """One simulated vLLM engine."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: Name of this engine in logs, metrics labels and the default KV-event topic.
    engine_id: str = Field(default="sim", min_length=1)
    #: Model names served (``/v1/models``); requests for another model get 404.
    served_model_names: list[str] = Field(default_factory=lambda: ["sim-model"], min_length=1)
    #: What the engine does: ``both`` (everything), ``prefill`` (every request runs for one
    #: token and its KV is offered for transfer) or ``decode`` (requests carrying transfer
    #: parameters load the prefill's KV instead of computing it). See
    #: :mod:`kvgate.engines.sim.core.pd`.
    role: Literal["both", "prefill", "decode"] = "both"
    pd: PdSimConfig = Field(default_factory=PdSimConfig)
    #: Tokens per KV block (vLLM's GPU default is 16). Cached token counts are multiples of it.
    block_size: int = Field(default=16, ge=1, le=1024)
    #: KV blocks in the cache. The H100 + 8B model of ``H100_TIMING.md`` holds ≈ 27,000 blocks
    #: of 16 tokens; the default is smaller so that tests exercise eviction cheaply.
    capacity_blocks: int = Field(default=4096, ge=1)
    #: Longest prompt + completion, in tokens. ``None``: min(32,768, capacity in tokens).
    max_model_len: int | None = Field(default=None, ge=2)
    #: Most sequences in the running batch (vLLM's ``max_num_seqs``; 256 is its long-standing
    #: default).
    max_num_seqs: int = Field(default=256, ge=1)
    #: Token budget of one step: decode tokens + prefill chunk tokens (vLLM's
    #: ``max_num_batched_tokens``; 8,192 as vLLM picks for its API server on large GPUs).
    max_num_batched_tokens: int = Field(default=8192, ge=1)
    #: Requests queued for admission; past it new requests get 503 (vLLM has no such bound).
    max_waiting_requests: int = Field(default=10_000, ge=1)
    #: Multiplies every modelled step duration. 1.0: realistic H100 seconds; 0.1: ten times
    #: faster; 0: no sleeping at all (each step only yields to the event loop).
    time_scale: float = Field(default=1.0, ge=0)
    timing: TimingParams = Field(default_factory=TimingParams)
    #: Report ``usage.prompt_tokens_details.cached_tokens`` (vLLM's
    #: ``--enable-prompt-tokens-details``). False: usage has no ``prompt_tokens_details``.
    enable_prompt_tokens_details: bool = True
    #: Publish KV-cache events; ``None``: disabled.
    kv_events: KvEventsConfig | None = None
    #: Seeds the generated text (with the prompt and the request's ``seed``).
    seed: int = 0
    #: Range (inclusive, tokens) of a completion's natural length: without ``ignore_eos`` a
    #: request stops (``finish_reason: "stop"``) after a length drawn from it, deterministically
    #: per prompt and seed, unless ``max_tokens`` comes first (``"length"``).
    natural_output_len: tuple[int, int] = (32, 256)
    #: Keep Responses (``store``, default true) for ``GET /v1/responses/{id}``, ``cancel`` and
    #: ``previous_response_id`` (vLLM's ``VLLM_ENABLE_RESPONSES_API_STORE=1``). False: vLLM's
    #: default, ``store`` silently ignored and every id unknown (404).
    responses_store: bool = True
    #: Stored responses kept (the oldest forgotten past it; vLLM never forgets).
    responses_store_limit: int = Field(default=10_000, ge=1)
    #: Accept ``tools`` with automatic tool choice (vLLM's ``--enable-auto-tool-choice
    #: --tool-call-parser``). False: such Messages requests get vLLM's 400. The simulator
    #: never generates tool calls either way.
    enable_auto_tool_choice: bool = True
    #: Serve the render API (``/v1/chat/completions/render``, ``/v1/messages/render``,
    #: ``/v1/responses/render``; vLLM's ``--enable-scale-out``). False: 403 as vLLM answers.
    enable_scale_out: bool = True
    #: vLLM's ``--runner``: ``generate`` serves chat, completions, Messages, Responses and the
    #: render API; ``pooling`` (``--runner pooling --convert embed``) serves ``/v1/embeddings``
    #: instead. Both serve ``/tokenize``, ``/detokenize``; a route not served answers 404
    #: ``{"detail": "Not Found"}``.
    runner: Literal["generate", "pooling"] = "generate"
    #: OTLP/HTTP base URL to export one ``llm_request`` span per request to, child of the
    #: request's ``traceparent`` (vLLM's ``--otlp-traces-endpoint``; engines/sim/http/tracing.py).
    #: ``None``: no tracing. Needs the ``tracing`` extra.
    otlp_traces_endpoint: str | None = Field(default=None, pattern=r"^https?://")

    @model_validator(mode="after")
    def _check(self) -> SimConfig:
        lo, hi = self.natural_output_len
        if not 1 <= lo <= hi:
            raise ValueError("natural_output_len must be (lo, hi) with 1 <= lo <= hi")
        if self.max_model_len is not None and self.max_model_len > self.capacity_tokens:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) exceeds the KV cache "
                f"({self.capacity_blocks} blocks * {self.block_size} = {self.capacity_tokens} "
                "tokens): one sequence of maximum length could never run"
            )
        if len(set(self.served_model_names)) != len(self.served_model_names):
            raise ValueError("served_model_names has duplicates")
        return self

    @property
    def capacity_tokens(self) -> int:
        """KV cache size in tokens."""
        return self.capacity_blocks * self.block_size

    @property
    def effective_max_model_len(self) -> int:
        """``max_model_len`` or its default."""
        if self.max_model_len is not None:
            return self.max_model_len
        return min(DEFAULT_MAX_MODEL_LEN, self.capacity_tokens)

    @property
    def model_name(self) -> str:
        """The first served model name (vLLM's ``model_name`` metrics label)."""
        return self.served_model_names[0]

    @property
    def kv_events_topic(self) -> str:
        """The topic frame of KV-event messages."""
        if self.kv_events is not None and self.kv_events.topic is not None:
            return self.kv_events.topic
        return f"kv@{self.engine_id}@{self.model_name}"
