"""vLLM engine adapter: health, Prometheus metrics, request shaping, usage extraction.

Also used for the simulated engine, which speaks vLLM's wire format.
Metric names are vLLM's (0.32): ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc`` (older: ``vllm:gpu_cache_usage_perc``),
``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total`` (tokens),
``vllm:prompt_tokens_by_source_total{source=...}``, and the KV capacity from the labels of
``vllm:cache_config_info`` (``num_gpu_blocks`` x ``block_size``; summed over data-parallel
engines) as ``EngineMetrics.extra["kv_capacity_tokens"]`` (absent when not reported: a router
must then take the capacity from its configuration).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from kvgate.apis.openai import openai_usage
from kvgate.middleware.framework.types import (
    KV_CAPACITY_TOKENS,
    EngineMetrics,
    InferenceRequest,
    Usage,
)

_GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",
    "vllm:prefix_cache_hits_total": "prefix_cache_hits",
    "vllm:prefix_cache_queries_total": "prefix_cache_queries",
    # vLLM < 0.10 names
    "vllm:gpu_prefix_cache_hits_total": "prefix_cache_hits",
    "vllm:gpu_prefix_cache_queries_total": "prefix_cache_queries",
}
_COUNTERS_EXTRA = frozenset(
    {"vllm:external_prefix_cache_hits_total", "vllm:prompt_tokens_cached_total"}
)


def _parse_sample(line: str) -> tuple[str, str, float] | None:
    """``name{labels} value [timestamp]`` -> (name, labels, value); None for other lines."""
    if not line or line[0] == "#":
        return None
    brace = line.find("{")
    if brace >= 0:
        end = line.rfind("}")
        name, labels, rest = line[:brace], line[brace + 1 : end], line[end + 1 :]
    else:
        name, _, rest = line.partition(" ")
        labels = ""
    parts = rest.split()
    if not parts:
        return None
    try:
        return name, labels, float(parts[0])
    except ValueError:
        return None


def parse_prometheus(text: str) -> dict[tuple[str, str], float]:
    """Samples keyed by (metric name, raw label string). Samples with equal keys are summed."""
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        sample = _parse_sample(line.strip())
        if sample is not None:
            key = (sample[0], sample[1])
            out[key] = out.get(key, 0.0) + sample[2]
    return out


def _label_value(labels: str, key: str) -> str | None:
    for part in labels.split(","):
        k, _, v = part.partition("=")
        if k.strip() == key:
            return v.strip().strip('"')
    return None


def _capacity_tokens(labels: str) -> float | None:
    """``num_gpu_blocks x block_size`` of a ``vllm:cache_config_info`` sample (None if either
    is missing or not a positive integer, e.g. ``"None"`` before the profiler ran)."""
    blocks, size = _label_value(labels, "num_gpu_blocks"), _label_value(labels, "block_size")
    if blocks is None or size is None or not blocks.isdigit() or not size.isdigit():
        return None
    value = int(blocks) * int(size)
    return float(value) if value > 0 else None


class VllmAdapter:
    """Adapter for vLLM's OpenAI-compatible server (and the simulator)."""

    kind: ClassVar[str] = "vllm"
    health_path: ClassVar[str] = "/health"
    metrics_path: ClassVar[str | None] = "/metrics"
    models_path: ClassVar[str | None] = "/v1/models"

    def parse_metrics(self, text: str, scraped_at: float) -> EngineMetrics:
        values: dict[str, float] = {}
        extra: dict[str, float] = {}
        for (name, labels), value in parse_prometheus(text).items():
            field_name = _GAUGES.get(name)
            if field_name is not None:
                values[field_name] = values.get(field_name, 0.0) + value
            elif name == "vllm:prompt_tokens_by_source_total":
                source = _label_value(labels, "source") or "unknown"
                key = f"prompt_tokens_{source}"
                extra[key] = extra.get(key, 0.0) + value
            elif name == "vllm:cache_config_info":
                capacity = _capacity_tokens(labels)
                if capacity is not None:
                    extra[KV_CAPACITY_TOKENS] = extra.get(KV_CAPACITY_TOKENS, 0.0) + capacity
            elif name in _COUNTERS_EXTRA:
                short = name.removeprefix("vllm:")
                extra[short] = extra.get(short, 0.0) + value
        return EngineMetrics(
            running=values.get("running"),
            waiting=values.get("waiting"),
            kv_usage=values.get("kv_usage"),
            prefix_cache_hits=values.get("prefix_cache_hits"),
            prefix_cache_queries=values.get("prefix_cache_queries"),
            scraped_at=scraped_at,
            extra=extra,
        )

    def parse_models(self, payload: Mapping[str, Any]) -> frozenset[str]:
        data = payload.get("data")
        if not isinstance(data, list):
            return frozenset()
        return frozenset(
            str(m["id"]) for m in data if isinstance(m, Mapping) and isinstance(m.get("id"), str)
        )

    def prepare_body(self, req: InferenceRequest, body: dict[str, Any]) -> dict[str, Any]:
        """Streams always ask for the final usage chunk (stripped later if the client didn't)."""
        if req.stream and not req.client_wants_usage:
            opts = dict(body.get("stream_options") or {})
            opts["include_usage"] = True
            body = {**body, "stream_options": opts}
        return body

    def extract_usage(self, payload: Mapping[str, Any]) -> Usage | None:
        """OpenAI-shaped usage (``cached_tokens`` None when not reported; vLLM's
        ``created_cache_tokens`` as ``cache_write_tokens``), as the chat adapter reads it."""
        return openai_usage(payload)
