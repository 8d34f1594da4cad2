"""Real processes: ``kvgate serve`` in front of a simulated engine process, used through the
real ``openai`` client; ``kvgate demo``; config errors at startup."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.servers import free_port, running_process

KVGATE = str(Path(sys.executable).with_name("kvgate"))


@pytest.fixture(scope="module")
def served() -> Iterator[str]:
    sim_port, gw_port = free_port(), free_port()
    sim = [sys.executable, "-m", "kvgate.engines.sim", "--port", str(sim_port), "--time-scale", "0"]
    gw = [KVGATE, "serve", "--engine", f"http://127.0.0.1:{sim_port}", "--port", str(gw_port)]
    with running_process(sim, f"http://127.0.0.1:{sim_port}/health"), \
            running_process(gw, f"http://127.0.0.1:{gw_port}/health"):
        yield f"http://127.0.0.1:{gw_port}/v1"


def test_openai_client_chat_and_stream(served: str) -> None:
    client = openai.OpenAI(base_url=served, api_key="sk-test-not-logged")
    chat = client.chat.completions.create(
        model="sim-model", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].message.content
    assert chat.usage is not None
    assert chat.usage.completion_tokens == 4
    chunks = list(client.chat.completions.create(
        model="sim-model", max_tokens=4, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "hi"}]))
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens_details is not None
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens is not None
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    completion = client.completions.create(model="sim-model", prompt=[1, 2, 3], max_tokens=2)
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == 3
    assert [m.id for m in client.models.list()] == ["sim-model"]


@pytest.mark.parametrize(("kwargs", "error"), [
    ({"model": "nope"}, openai.NotFoundError),
    ({"model": "sim-model", "max_tokens": -1}, openai.BadRequestError),
])
def test_openai_client_errors(served: str, kwargs: dict[str, object],
                              error: type[Exception]) -> None:
    client = openai.OpenAI(base_url=served, api_key="x", max_retries=0)
    with pytest.raises(error):
        client.chat.completions.create(messages=[{"role": "user", "content": "hi"}],
                                       **kwargs)  # type: ignore[call-overload]


def test_demo_runs_and_serves() -> None:
    port = free_port()
    args = [KVGATE, "demo", "--port", str(port), "--engines", "2", "--time-scale", "0",
            "--duration", "30"]
    with running_process(args, f"http://127.0.0.1:{port}/health") as proc:
        resp = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={
            "model": "sim-model", "max_tokens": 3, "messages": [{"role": "user", "content": "x"}]})
        assert resp.status_code == 200
        assert resp.json()["usage"]["completion_tokens"] == 3
        assert proc.poll() is None


@pytest.mark.parametrize(("config", "needle"), [
    ("engines: [{name: a, url: 'ftp://x'}]\n", "engines[0] (name 'a').url"),
    ("plugins: [{type: no-such-plugin}]\nprofiles: []\n", "unknown plugin type"),
])
def test_serve_refuses_bad_config(tmp_path: Path, config: str, needle: str) -> None:
    path = tmp_path / "gw.yaml"
    path.write_text(config)
    done = subprocess.run([KVGATE, "serve", "--config", str(path)], capture_output=True,
                          text=True, timeout=30, check=False)
    assert done.returncode == 2
    assert str(path) in done.stderr
    assert needle in done.stderr
