"""``GET /metrics``: the engine's counters in Prometheus text format under vLLM's names.

Names and labels follow vLLM 0.32 (``engine``, ``model_name``); token counters count tokens.
Rendered by hand from the engine's own counters (no process-global registry): a few dozen
lines of text per scrape.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvgate.engines.sim.core.engine import SimEngine

_Sample = tuple[str, dict[str, str], float]


def _family(name: str, kind: str, help_text: str, samples: Iterable[_Sample]) -> list[str]:
    """``# HELP`` / ``# TYPE`` lines, then one line per sample (counter names end ``_total``)."""
    base = name.removesuffix("_total") if kind == "counter" else name
    lines = [f"# HELP {base} {help_text}", f"# TYPE {base} {kind}"]
    for sample_name, labels, value in samples:
        label_text = ",".join(f'{k}="{v}"' for k, v in labels.items())
        lines.append(f"{sample_name}{{{label_text}}} {float(value)!r}")
    return lines


_Family = tuple[str, str, str, list[_Sample]]


def _gauges(engine: SimEngine, base: dict[str, str]) -> list[_Family]:
    return [
        ("vllm:num_requests_running", "gauge", "Requests in the running batch.",
         [("vllm:num_requests_running", base, engine.num_running)]),
        ("vllm:num_requests_waiting", "gauge", "Requests waiting to be admitted.",
         [("vllm:num_requests_waiting", base, engine.num_waiting)]),
        ("vllm:kv_cache_usage_perc", "gauge", "Fraction of KV blocks in use (0 to 1).",
         [("vllm:kv_cache_usage_perc", base, engine.scheduler.cache.usage)]),
    ]


def _counters(engine: SimEngine, base: dict[str, str]) -> list[_Family]:
    s = engine.scheduler.stats
    simple = [
        ("vllm:prefix_cache_queries_total", "Prompt tokens looked up in the cache.",
         s.prefix_cache_queries),
        ("vllm:prefix_cache_hits_total", "Prompt tokens found in the cache.", s.prefix_cache_hits),
        ("vllm:prompt_tokens_cached_total", "Prompt tokens served from cache.",
         s.prompt_tokens_cache_hit),
        ("vllm:prompt_tokens_total", "Prompt tokens of admitted requests.", s.prompt_tokens),
        ("vllm:generation_tokens_total", "Generated tokens.", s.generation_tokens),
        ("vllm:num_preemptions_total", "Preemptions (recompute).", s.preemptions),
    ]
    families: list[_Family] = [
        (name, "counter", text, [(name, base, float(value))]) for name, text, value in simple
    ]
    sources = (("local_compute", s.prompt_tokens_local_compute),
               ("local_cache_hit", s.prompt_tokens_cache_hit),
               ("external_kv_transfer", s.prompt_tokens_external))
    families.append(("vllm:prompt_tokens_by_source_total", "counter",
                     "Prompt tokens by where their KV came from.",
                     [("vllm:prompt_tokens_by_source_total", {**base, "source": src}, float(v))
                      for src, v in sources]))
    families.append(("vllm:request_success_total", "counter", "Finished requests by reason.",
                     [("vllm:request_success_total", {**base, "finished_reason": r}, float(n))
                      for r, n in sorted(s.finished.items())]))
    return families


def _info(engine: SimEngine) -> list[_Family]:
    """``vllm:cache_config_info``: vLLM 0.32 publishes its CacheConfig as the labels of a gauge
    of value 1 (``engine`` plus every config field; routers read ``num_gpu_blocks`` and
    ``block_size`` for the KV capacity). The simulator sets the fields a router reads."""
    cfg = engine.config
    labels = {
        "block_size": str(cfg.block_size), "enable_prefix_caching": "True",
        "engine": "0", "kv_cache_size_tokens": str(cfg.capacity_tokens),
        "num_cpu_blocks": "None", "num_gpu_blocks": str(cfg.capacity_blocks),
    }
    return [("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig",
             [("vllm:cache_config_info", labels, 1.0)])]


def render_metrics(engine: SimEngine) -> str:
    """The full ``/metrics`` page of ``engine``."""
    base = {"engine": engine.config.engine_id, "model_name": engine.config.model_name}
    lines: list[str] = []
    families = [*_info(engine), *_gauges(engine, base), *_counters(engine, base)]
    for name, kind, help_text, samples in families:
        lines.extend(_family(name, kind, help_text, samples))
    return "\n".join(lines) + "\n"
