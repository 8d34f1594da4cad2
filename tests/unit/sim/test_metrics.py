"""/metrics text: vLLM names, parsed by the gateway's own vLLM adapter."""

from __future__ import annotations

import random

import pytest

from kvgate.engines.sim.core.config import SimConfig
from kvgate.engines.sim.core.engine import SimEngine
from kvgate.engines.sim.core.metrics import render_metrics
from kvgate.engines.sim.core.scheduler import SeqSpec
from kvgate.engines.vllm import VllmAdapter, parse_prometheus


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(16, 32_000) for _ in range(n)]


def _engine_after(prompts: list[tuple[int, int]], steps: int | None = None) -> SimEngine:
    """An engine whose scheduler ran the given (length, seed) prompts, synchronously."""
    engine = SimEngine(SimConfig(engine_id="e7", time_scale=0))
    s = engine.scheduler
    for i, (n, seed) in enumerate(prompts):
        s.add(SeqSpec(f"r{i}", _prompt(n, seed), 3, ignore_eos=True))
        done = 0
        while s.has_work() and (steps is None or done < steps):
            s.complete(s.schedule())
            done += 1
    return engine


@pytest.mark.parametrize(("prompts", "hits", "queries"), [
    ([(64, 1)], 0, 64),
    ([(64, 1), (64, 1)], 48, 128),
    ([(64, 1), (64, 2), (64, 1)], 48, 192),
])
def test_adapter_reads_prefix_counters(
    prompts: list[tuple[int, int]], hits: int, queries: int
) -> None:
    text = render_metrics(_engine_after(prompts))
    m = VllmAdapter().parse_metrics(text, scraped_at=1.0)
    assert (m.prefix_cache_hits, m.prefix_cache_queries) == (hits, queries)
    assert (m.running, m.waiting, m.kv_usage) == (0, 0, 0)
    assert m.extra["prompt_tokens_local_cache_hit"] == hits
    assert m.extra["prompt_tokens_local_compute"] == queries - hits
    assert m.extra["prompt_tokens_external_kv_transfer"] == 0
    assert m.extra["prompt_tokens_cached_total"] == hits


def test_gauges_while_running() -> None:
    engine = _engine_after([(100, 1)], steps=1)
    m = VllmAdapter().parse_metrics(render_metrics(engine), scraped_at=0.0)
    assert m.running == 1 and m.waiting == 0
    assert m.kv_usage == pytest.approx(7 / 4096)


def test_names_types_and_labels() -> None:
    text = render_metrics(_engine_after([(20, 1)]))
    samples = parse_prometheus(text)
    labels = 'engine="e7",model_name="sim-model"'
    assert samples[("vllm:request_success_total", labels + ',finished_reason="length"')] == 1
    assert samples[("vllm:generation_tokens_total", labels)] == 3
    assert samples[("vllm:prompt_tokens_total", labels)] == 20
    assert "# TYPE vllm:prefix_cache_hits counter" in text
    assert "# TYPE vllm:kv_cache_usage_perc gauge" in text
    assert text.endswith("\n")
