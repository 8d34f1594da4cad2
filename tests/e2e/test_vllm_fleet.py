"""The gateway in front of two real vLLM CPU engines, through the real ``openai`` client.

Engines: the tiny random-weight model (babbles), so tests use ``temperature=0``,
``ignore_eos`` and small ``max_tokens``. CPU block size is 128: cached counts are multiples.
The engine-kill test runs last in this module (it stops one engine of the session's shared
fleet; a later module on that fleet finds it dead and gets it started again).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvgate.engines.local.launcher import LocalEngine, stop
from kvgate.engines.local.model import SERVED_NAME
from tests.e2e.conftest import kvgate_serve, precise_plugins

pytestmark = pytest.mark.e2e
EXTRA = {"ignore_eos": True}
LONG = "The quick brown fox jumps over the lazy dog near the river bank. " * 60


def _config(engines: list[LocalEngine], events_port: int, model_dir: Path) -> dict[str, Any]:
    return {
        "pool": {"health_interval_s": 0.5, "metrics_interval_s": 0.5, "unhealthy_after": 1},
        "engines": [{"name": e.name, "url": e.url} for e in engines],
        "plugins": [
            *precise_plugins(events_port, model_dir),
            {"type": "health-filter"}, {"type": "model-filter"}, {"type": "token-load-scorer"},
            {"type": "prefix-cache-scorer"}, {"type": "session-affinity-scorer"},
            {"type": "max-score-picker"},
        ],
        "profiles": [{"name": "default", "plugins": [
            {"ref": "health-filter"}, {"ref": "model-filter"},
            {"ref": "prefix-cache-scorer", "weight": 3}, {"ref": "token-load-scorer", "weight": 2},
            {"ref": "session-affinity-scorer", "weight": 1}, {"ref": "max-score-picker"}]}],
    }


@pytest.fixture(scope="module")
def gateway_url(vllm_fleet: list[LocalEngine], events_port: int, tiny_model: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    config = _config(vllm_fleet, events_port, tiny_model)
    with kvgate_serve(config, tmp_path_factory.mktemp("gw")) as url:
        yield url


@pytest.fixture
def client(gateway_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway_url + "/v1", api_key="unused", max_retries=0)


def test_chat_and_completions_json(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model=SERVED_NAME, max_tokens=6, temperature=0, extra_body=EXTRA,
        messages=[{"role": "user", "content": "Hello there"}])
    assert chat.usage is not None
    assert chat.usage.completion_tokens == 6
    assert chat.choices[0].message.content
    comp = client.completions.create(model=SERVED_NAME, prompt=[1, 2, 3, 4, 5], max_tokens=4,
                                     temperature=0, extra_body=EXTRA)
    assert comp.usage is not None
    assert comp.usage.prompt_tokens == 5
    assert comp.usage.completion_tokens == 4


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_streaming_with_usage(client: openai.OpenAI, api: str) -> None:
    kwargs: dict[str, Any] = {"model": SERVED_NAME, "max_tokens": 5, "temperature": 0,
                              "stream": True, "stream_options": {"include_usage": True},
                              "extra_body": EXTRA}
    if api == "chat":
        chunks = list(client.chat.completions.create(
            messages=[{"role": "user", "content": "stream please"}], **kwargs))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        chunks = list(client.completions.create(prompt="stream please", **kwargs))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text
    usage = chunks[-1].usage
    assert usage is not None
    assert usage.completion_tokens == 5


def test_cached_tokens_on_repeated_long_prompt(client: openai.OpenAI) -> None:
    cached = []
    for _ in range(3):
        chat = client.chat.completions.create(
            model=SERVED_NAME, max_tokens=2, temperature=0, extra_body=EXTRA,
            messages=[{"role": "user", "content": LONG}])
        assert chat.usage is not None
        assert chat.usage.prompt_tokens_details is not None
        cached.append(chat.usage.prompt_tokens_details.cached_tokens)
        prompt_tokens = chat.usage.prompt_tokens
    assert cached[0] == 0
    # the prefix-cache scorer sent the repeats where the prompt is cached
    assert cached[1] == cached[2] == (prompt_tokens - 1) // 128 * 128
    assert cached[1] > 0


def test_engine_metrics_and_kv_events_reach_the_gateway(
    gateway_url: str, client: openai.OpenAI
) -> None:
    client.chat.completions.create(model=SERVED_NAME, max_tokens=2, extra_body=EXTRA,
                                   messages=[{"role": "user", "content": LONG + "metrics"}])
    time.sleep(1.5)  # a metrics scrape
    text = httpx.get(gateway_url + "/metrics").text
    hits = [line for line in text.splitlines()
            if line.startswith("kvgate_engine_prefix_cache_queries{")]
    assert len(hits) == 2
    assert sum(float(h.rsplit(" ", 1)[1]) for h in hits) > 0
    applied = [line for line in text.splitlines() if line.startswith("kvgate_kv_events_applied")]
    assert sum(float(a.rsplit(" ", 1)[1]) for a in applied) > 0


@pytest.mark.parametrize(("kwargs", "error"), [
    ({"model": "no-such-model"}, openai.NotFoundError),
    ({"model": SERVED_NAME, "max_tokens": -3}, openai.BadRequestError),
    ({"model": SERVED_NAME, "max_tokens": 100000}, openai.BadRequestError),  # engine's own 400
])
def test_bad_requests_get_openai_errors(client: openai.OpenAI, kwargs: dict[str, Any],
                                        error: type[Exception]) -> None:
    with pytest.raises(error):
        client.chat.completions.create(messages=[{"role": "user", "content": "x"}], **kwargs)


def test_zz_engine_killed_traffic_moves(client: openai.OpenAI, gateway_url: str,
                                        vllm_fleet: list[LocalEngine]) -> None:
    victim = vllm_fleet[1]
    stop(victim, grace_s=0)
    for i in range(4):
        chat = client.chat.completions.create(
            model=SERVED_NAME, max_tokens=2, extra_body=EXTRA,
            messages=[{"role": "user", "content": f"after the kill {i}"}])
        assert chat.choices[0].message.content is not None
    health = httpx.get(gateway_url + "/health").json()
    engines = {e["name"]: e["healthy"] for e in health["engines"]}
    assert engines == {vllm_fleet[0].name: True, victim.name: False}
