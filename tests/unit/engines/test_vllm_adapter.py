"""vLLM adapter: metrics parsing (a real vLLM 0.32 CPU /metrics capture), usage extraction,
request shaping."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from kvgate.engines.vllm import VllmAdapter, parse_prometheus
from kvgate.middleware.framework.types import Api, InferenceRequest, Usage

FIXTURE = Path(__file__).with_name("fixtures") / "vllm-0.32-metrics.txt"


def test_real_vllm_metrics_capture() -> None:
    m = VllmAdapter().parse_metrics(FIXTURE.read_text(), 1.0)
    assert (m.running, m.waiting, m.kv_usage) == (0.0, 0.0, 0.0)
    assert m.prefix_cache_queries == 2308.0
    assert m.prefix_cache_hits == 1152.0
    assert m.extra["prompt_tokens_local_cache_hit"] == 1152.0
    assert m.extra["prompt_tokens_local_compute"] == 1156.0
    assert m.extra["prompt_tokens_external_kv_transfer"] == 0.0
    assert m.extra["kv_capacity_tokens"] == 128 * 128.0  # num_gpu_blocks x block_size
    assert m.scraped_at == 1.0


@pytest.mark.parametrize(("labels", "expected"), [
    ('block_size="16",num_gpu_blocks="27000"', 432_000.0),
    ('num_gpu_blocks="None",block_size="16"', None),  # before profiling
    ('block_size="16"', None),
    ('block_size="0",num_gpu_blocks="10"', None),
])
def test_kv_capacity_from_cache_config_info(labels: str, expected: float | None) -> None:
    text = f"vllm:cache_config_info{{{labels}}} 1.0\n"
    assert VllmAdapter().parse_metrics(text, 0.0).extra.get("kv_capacity_tokens") == expected


def test_simulator_publishes_its_capacity() -> None:
    from kvgate.engines.sim.core.config import SimConfig
    from kvgate.engines.sim.core.engine import SimEngine
    from kvgate.engines.sim.core.metrics import render_metrics

    engine = SimEngine(SimConfig(block_size=32, capacity_blocks=100))
    m = VllmAdapter().parse_metrics(render_metrics(engine), 0.0)
    assert m.extra["kv_capacity_tokens"] == 3200.0


@pytest.mark.parametrize(("text", "expected"), [
    ('vllm:num_requests_running{engine="0"} 3\n', {"running": 3.0}),
    ('vllm:num_requests_running{engine="0"} 3\nvllm:num_requests_running{engine="1"} 2\n',
     {"running": 5.0}),  # data-parallel ranks add up
    ("vllm:gpu_cache_usage_perc 0.5\n", {"kv_usage": 0.5}),  # older name
    ("vllm:gpu_prefix_cache_hits_total 7\n", {"prefix_cache_hits": 7.0}),
    ("# HELP x\nnot a sample\nvllm:num_requests_waiting NaNx\n", {}),
    ("", {}),
])
def test_metrics_variants(text: str, expected: dict[str, float]) -> None:
    m = VllmAdapter().parse_metrics(text, 0.0)
    got = {k: getattr(m, k) for k in ("running", "waiting", "kv_usage", "prefix_cache_hits")
           if getattr(m, k) is not None}
    assert got == expected


def test_parse_prometheus_labels_with_braces_and_timestamps() -> None:
    samples = parse_prometheus('a{x="1",y="2"} 4 1700000000\nb 2\n')
    assert samples == {("a", 'x="1",y="2"'): 4.0, ("b", ""): 2.0}


USAGE_CASES: list[tuple[str, dict[str, Any], Usage | None]] = [
    ("with cached", {"usage": {"prompt_tokens": 1154, "completion_tokens": 5,
                               "prompt_tokens_details": {"cached_tokens": 1152}}},
     Usage(1154, 5, 1152)),
    ("details absent", {"usage": {"prompt_tokens": 9, "completion_tokens": 1}}, Usage(9, 1, None)),
    ("details null", {"usage": {"prompt_tokens": 9, "completion_tokens": 1,
                                "prompt_tokens_details": None}}, Usage(9, 1, None)),
    ("cached null", {"usage": {"prompt_tokens": 9, "completion_tokens": 1,
                               "prompt_tokens_details": {"cached_tokens": None}}},
     Usage(9, 1, None)),
    ("cached zero", {"usage": {"prompt_tokens": 9, "completion_tokens": 1,
                               "prompt_tokens_details": {"cached_tokens": 0}}}, Usage(9, 1, 0)),
    ("vLLM cache writes", {"usage": {"prompt_tokens": 1200, "completion_tokens": 7,
                                     "prompt_tokens_details": {"cached_tokens": 1024,
                                                               "created_cache_tokens": 160}}},
     Usage(1200, 7, 1024, 160)),
    ("cache writes, reads unknown", {"usage": {"prompt_tokens": 9, "completion_tokens": 1,
                                               "prompt_tokens_details": {
                                                   "created_cache_tokens": 8}}},
     Usage(9, 1, None, 8)),
    ("no usage", {"choices": []}, None),
    ("usage null (stream chunk)", {"usage": None}, None),
    ("garbage", {"usage": {"prompt_tokens": "9"}}, None),
]


@pytest.mark.parametrize(("case", "payload", "expected"), USAGE_CASES,
                         ids=[c[0] for c in USAGE_CASES])
def test_extract_usage(case: str, payload: dict[str, Any], expected: Usage | None) -> None:
    assert VllmAdapter().extract_usage(payload) == expected


def _req(stream: bool, wants: bool) -> InferenceRequest:
    return InferenceRequest(request_id="r", api=Api.CHAT, model="m", body={}, headers={},
                            stream=stream, client_wants_usage=wants, prompt_token_estimate=1,
                            received_at=time.monotonic())


@pytest.mark.parametrize(("stream", "wants", "changed"), [
    (True, False, True), (True, True, False), (False, False, False)])
def test_prepare_body_always_asks_for_stream_usage(stream: bool, wants: bool,
                                                   changed: bool) -> None:
    body: dict[str, Any] = {"model": "m", "cache_salt": "t", "kv_transfer_params": {"a": 1}}
    out = VllmAdapter().prepare_body(_req(stream, wants), body)
    assert (out is not body) == changed
    if changed:
        assert out["stream_options"] == {"include_usage": True}
        assert "stream_options" not in body  # the client's body is not mutated
    assert out["cache_salt"] == "t"
    assert out["kv_transfer_params"] == {"a": 1}  # vLLM-only fields pass through
